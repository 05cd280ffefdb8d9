//! A backend's periodic chore (a sweep of expired token rows or keys), started by the
//! calls that pass by: at most once per interval per process, one at a time, and only
//! inside a tokio runtime.
//!
//! A backend keeps one [`Periodic`] and asks it on its hot path whether the chore is due
//! ([`Periodic::due`]), which costs an atomic load when it is not. A due chore comes as a
//! [`Turn`], whose [`spawn`](Turn::spawn) runs it in the background; the turn ends when
//! that task ends or is dropped (aborted, its runtime shut down), so a chore cut off
//! mid-way does not keep the next one from starting.
//!
//! ```
//! use std::time::Duration;
//!
//! use distlock_core::chore::{Periodic, sweep_interval};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let sweeps = Periodic::new(sweep_interval(Duration::from_secs(24 * 3600)));
//! if let Some(turn) = sweeps.due() {
//!     turn.spawn(async { /* delete what is past its retention */ });
//! }
//! // Not due again for an hour, whether the sweep has ended or not.
//! assert!(sweeps.due().is_none());
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How often a sweep of what is older than `retention` runs: a 24th of the retention,
/// between 1 s and 1 h, so what is past its retention is gone at most that long after.
pub fn sweep_interval(retention: Duration) -> Duration {
    (retention / 24).clamp(Duration::from_secs(1), Duration::from_secs(3600))
}

/// When a chore may next start in this process, and whether it is running.
#[derive(Debug)]
pub struct Periodic {
    every: Duration,
    /// Milliseconds after `epoch` at which the chore may next start.
    next_due_ms: AtomicU64,
    epoch: Instant,
    running: Arc<AtomicBool>,
}

impl Periodic {
    /// A chore due at once, then at most once per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            next_due_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            running: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The interval between starts.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// The chore's turn if it is due and not running, and this is a tokio runtime's
    /// thread; the next one is then due an interval from now. Costs an atomic load when
    /// it is not due.
    #[must_use = "the turn ends when dropped; spawn the chore with it"]
    pub fn due(&self) -> Option<Turn> {
        let now_ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        if now_ms < self.next_due_ms.load(Ordering::Relaxed) {
            return None;
        }
        let runtime = Handle::try_current().ok()?;
        if self.running.swap(true, Ordering::AcqRel) {
            return None;
        }
        let every_ms = u64::try_from(self.every.as_millis()).unwrap_or(u64::MAX);
        self.next_due_ms
            .store(now_ms.saturating_add(every_ms), Ordering::Relaxed);
        Some(Turn {
            running: Arc::clone(&self.running),
            runtime,
        })
    }
}

/// A chore's turn to run: while it lives no other turn of its [`Periodic`] is given out.
/// Dropping it, finished or not, lets the next one start once due.
#[derive(Debug)]
pub struct Turn {
    running: Arc<AtomicBool>,
    runtime: Handle,
}

impl Turn {
    /// Runs `chore` in the background on the runtime the turn was given in; the turn ends
    /// with the task, however it ends.
    pub fn spawn<F>(self, chore: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let runtime = self.runtime.clone();
        runtime.spawn(async move {
            let _turn = self;
            chore.await;
        })
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.running.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(10);

    #[test]
    fn sweeps_run_a_24th_of_the_retention_apart_between_a_second_and_an_hour() {
        let s = Duration::from_secs;
        assert_eq!(sweep_interval(s(24 * 3600)), s(3600));
        assert_eq!(sweep_interval(s(3650 * 24 * 3600)), s(3600));
        assert_eq!(sweep_interval(s(48 * 60)), s(120));
        assert_eq!(sweep_interval(s(1)), s(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_chore_is_due_at_once_then_once_per_interval() {
        let chore = Periodic::new(EVERY);
        drop(chore.due().expect("due at first"));
        tokio::time::advance(EVERY - Duration::from_millis(1)).await;
        assert!(chore.due().is_none(), "due again before its interval");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(chore.due().is_some(), "not due after its interval");
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_chore_is_not_started_again_when_due() {
        let chore = Periodic::new(EVERY);
        let running = chore.due().expect("due at first");
        tokio::time::advance(EVERY).await;
        assert!(chore.due().is_none(), "a second turn while the first runs");
        drop(running);
        assert!(chore.due().is_some(), "no turn after the first ended");
    }

    /// A sweep task dropped mid-way (aborted, its runtime shut down) must not leave the
    /// chore marked running, or it never runs again in this process.
    #[tokio::test(start_paused = true)]
    async fn a_turn_dropped_without_finishing_lets_the_next_due_check_start_again() {
        let chore = Periodic::new(EVERY);
        let task = chore
            .due()
            .expect("due at first")
            .spawn(std::future::pending());
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        tokio::time::advance(EVERY).await;
        assert!(chore.due().is_some(), "the aborted chore is still running");
    }

    #[test]
    fn nothing_is_due_outside_a_tokio_runtime() {
        let chore = Periodic::new(EVERY);
        assert!(chore.due().is_none());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let _inside = runtime.enter();
        assert!(
            chore.due().is_some(),
            "outside a runtime it must not count a start"
        );
    }
}
