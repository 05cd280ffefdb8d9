//! Lock handoff under contention: one key, many tasks waiting in `Locker::lock`, and how
//! long the key sits free between a release and the next grant, with the backend's
//! release notifications and without them (backoff polling only), in one run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendLayer, Capabilities, Layered, Lease, LockBackend, LockError, LockKey, Locker,
    async_trait,
};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::error::BenchError;
use crate::load::new_histogram;
use crate::subject::{SubjectId, TTL};

/// One handoff measurement.
#[derive(Clone, Debug)]
pub struct HandoffRow {
    /// The backend.
    pub subject: SubjectId,
    /// Whether waiters were woken by the backend's release notifications (`false`: the
    /// same backend with notifications hidden, so waiters poll with backoff).
    pub notified: bool,
    /// Tasks waiting for the key.
    pub waiters: usize,
    /// Handoffs measured.
    pub handoffs: u64,
    /// Time from sending a release to the next grant, p50, µs.
    pub p50_us: f64,
    /// The same, p99, µs.
    pub p99_us: f64,
    /// Acquire calls the store served per handoff (the waiters' attempts, the winning one
    /// included).
    pub acquires_per_handoff: f64,
}

/// How long each holder keeps the key before it releases it: a short job.
pub const HOLD: Duration = Duration::from_millis(2);

/// How long the waiters of a round wait before the first release: long enough that
/// polling waiters have backed off as waiters in a job system do.
pub const QUEUED: Duration = Duration::from_millis(300);

/// Measures about `handoffs` handoffs of one key on `backend`, in rounds: `waiters` tasks
/// queue in `Locker::lock` (default settings) behind a held key for [`QUEUED`], then the
/// key is released and passes from task to task, each holding it for [`HOLD`]. Reports
/// the time from each release to the next grant and the acquire calls the store served
/// from the first release of a round to its last grant, per handoff. With `notified`
/// false the backend's release notifications are hidden from the waiters.
pub async fn handoff(
    subject: SubjectId,
    backend: Arc<dyn LockBackend>,
    waiters: usize,
    handoffs: u64,
    notified: bool,
) -> Result<HandoffRow, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: subject.slug(),
        source,
    };
    let counted = Arc::new(Counted {
        notified,
        acquires: AtomicU64::new(0),
    });
    let locker = Locker::builder(Arc::new(Layered::new(backend, counted.clone())))
        .ttl(TTL)
        .wait_timeout(Some(Duration::from_secs(60)))
        .build()
        .map_err(lock_err)?;
    let mode = if notified { "notified" } else { "polling" };
    let key = LockKey::new(format!("bench:{}:handoff:{mode}", subject.slug())).map_err(lock_err)?;
    let log = Arc::new(Mutex::new(HandoffLog::default()));
    let waiters = waiters.max(1);
    let rounds = handoffs.div_ceil(waiters as u64).max(1);
    let mut chain_acquires = 0u64;
    for _ in 0..rounds {
        let first = locker.lock(&key).await.map_err(lock_err)?;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..waiters {
            let (locker, key, log) = (locker.clone(), key.clone(), log.clone());
            tasks.spawn(async move {
                let guard = locker.lock(&key).await?;
                log.lock().granted(Instant::now());
                tokio::time::sleep(HOLD).await;
                log.lock().released_at = Some(Instant::now());
                guard.release().await.map(drop)
            });
        }
        tokio::time::sleep(QUEUED).await;
        let before = counted.acquires.load(Ordering::SeqCst);
        log.lock().released_at = Some(Instant::now());
        first.release().await.map_err(lock_err)?;
        while let Some(joined) = tasks.join_next().await {
            joined
                .map_err(|e| BenchError::Unexpected {
                    subject: subject.slug(),
                    detail: format!("a waiting task failed: {e}"),
                })?
                .map_err(lock_err)?;
        }
        chain_acquires += counted.acquires.load(Ordering::SeqCst) - before;
        log.lock().released_at = None;
    }

    let log = log.lock();
    let mut histogram = new_histogram()?;
    for gap in &log.gaps {
        let micros = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX).max(1);
        histogram.saturating_record(micros);
    }
    let measured = log.gaps.len() as u64;
    Ok(HandoffRow {
        subject,
        notified,
        waiters,
        handoffs: measured,
        p50_us: histogram.value_at_quantile(0.5) as f64,
        p99_us: histogram.value_at_quantile(0.99) as f64,
        acquires_per_handoff: chain_acquires as f64 / measured.max(1) as f64,
    })
}

/// When the key was last released, and the gaps measured so far.
#[derive(Default)]
struct HandoffLog {
    released_at: Option<Instant>,
    gaps: Vec<Duration>,
}

impl HandoffLog {
    fn granted(&mut self, at: Instant) {
        if let Some(released) = self.released_at.take() {
            self.gaps.push(at.saturating_duration_since(released));
        }
    }
}

/// Counts the acquire calls that reach the measured backend, and shows or hides its
/// release notifications.
#[derive(Debug)]
struct Counted {
    notified: bool,
    acquires: AtomicU64,
}

#[async_trait]
impl BackendLayer for Counted {
    fn capabilities(&self, next: &dyn LockBackend) -> Capabilities {
        let wakes = self.notified && next.capabilities().wakes_waiters;
        next.capabilities().wakes_waiters(wakes)
    }
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.acquires.fetch_add(1, Ordering::Relaxed);
        next.acquire(key, ttl).await
    }
    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.acquires
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        next.acquire_many(keys, ttl).await
    }
    fn watch_releases(&self, next: &dyn LockBackend, key: &LockKey) -> Option<ReleaseWatch> {
        if self.notified {
            next.watch_releases(key)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::memory::MemoryBackend;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn notified_waiters_take_over_sooner_and_ask_the_store_less_than_polling_ones() {
        let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let notified = handoff(SubjectId::Memory, backend.clone(), 16, 40, true)
            .await
            .unwrap();
        let polling = handoff(SubjectId::Memory, backend, 16, 40, false)
            .await
            .unwrap();
        // Rounds of 16: 40 asked, 48 measured.
        assert_eq!(notified.handoffs, 48);
        assert_eq!(polling.handoffs, 48);
        // One acquire per handoff by the one woken waiter (and the odd fallback poll);
        // polling waiters ask more, and wait for their backoff to end.
        assert!(notified.acquires_per_handoff < 2.0, "{notified:?}");
        assert!(
            notified.p50_us < polling.p50_us,
            "{notified:?} vs {polling:?}"
        );
    }
}
