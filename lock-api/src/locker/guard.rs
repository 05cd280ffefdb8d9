//! [`LockGuard`]: a held lease, renewed by its `Locker`'s watchdog until released.

use std::fmt;
use std::sync::Arc;
use std::task::Poll;

use tokio::time::Instant;
use tracing::debug;

use crate::backend::lease::{Lease, Release};
use crate::error::LockError;
use crate::fencing::WriteFence;
use crate::key::{FencingToken, LockKey};
use crate::locker::watchdog::{LeaseState, Watchdog};

/// A held lock. Its lease is renewed in the background until [`LockGuard::release`].
///
/// Check [`LockGuard::is_held`] before each side effect, attach [`LockGuard::token`] to
/// every write, and select on [`LockGuard::lost`] to stop work when the lease is lost.
///
/// Dropping a guard without `release().await` stops renewal and releases the lease in a
/// background task: best effort and late. Release explicitly when you can.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use std::time::Duration;
/// use distlock::{LockKey, Locker, Release};
///
/// let locker = Locker::builder(distlock::connect("memory://").await?)
///     .ttl(Duration::from_secs(10))
///     .build()?;
/// let guard = locker.lock(&LockKey::new("report:daily")?).await?;
/// let token = guard.token(); // attach to every write the job makes
///
/// // Run the work while the lease is held: a lost lease stops it before its next step.
/// let rows = guard.status().while_held(async { 42 }).await?;
/// assert_eq!(rows, 42);
/// assert!(guard.is_held());
///
/// // Released by its owner: the store says it was still held.
/// assert_eq!(guard.release().await?, Release::Released);
/// # let _ = token;
/// # Ok(()) }
/// ```
#[must_use = "a lock is released as soon as its guard is dropped"]
pub struct LockGuard {
    lease: Lease,
    status: LeaseStatus,
    id: u64,
    watchdog: Arc<Watchdog>,
    released: bool,
}

impl LockGuard {
    pub(crate) fn new(
        lease: Lease,
        state: Arc<LeaseState>,
        id: u64,
        watchdog: Arc<Watchdog>,
    ) -> Self {
        let status = LeaseStatus {
            token: lease.token(),
            state,
        };
        Self {
            lease,
            status,
            id,
            watchdog,
            released: false,
        }
    }

    /// The fencing token of this acquisition: attach it to every write.
    pub fn token(&self) -> FencingToken {
        self.lease.token()
    }

    /// The lock's name.
    pub fn key(&self) -> &LockKey {
        self.lease.key()
    }

    /// The lease as granted by the backend.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// True until the lease is lost or its local validity deadline passes. It never reports
    /// held after `valid_until`, whatever the network does.
    pub fn is_held(&self) -> bool {
        self.status.is_held()
    }

    /// The current local validity deadline (moved forward by each renewal).
    pub fn valid_until(&self) -> Instant {
        self.status.valid_until()
    }

    /// Resolves when the lease is lost: renewal reported `Lost`, or `valid_until` passed
    /// without a successful renewal. It agrees with [`LockGuard::is_held`] at every
    /// instant: each poll checks the clock, so it is ready at the first poll after the
    /// deadline even when no timer has fired yet (after a pause). To stop a job before
    /// its next step, run it under [`LeaseStatus::while_held`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future has no effect on the lease.
    pub async fn lost(&self) {
        self.status.lost().await;
    }

    /// A cheap, cloneable view of this lease's status, to hand to the job's tasks.
    pub fn status(&self) -> LeaseStatus {
        self.status.clone()
    }

    /// Stops renewal and releases the lease. `Release::NotHeld` means it had already been
    /// lost: the work done under it may have overlapped with another holder's.
    ///
    /// # Cancel safety
    /// Renewal stops at once; if the future is dropped before the store answers, the
    /// lease frees itself when its TTL runs out.
    pub async fn release(mut self) -> Result<Release, LockError> {
        self.released = true;
        self.watchdog.unregister(self.id);
        self.status.state.mark_released();
        self.watchdog.backend().release(&self.lease).await
    }

    /// Stops renewal and leaves the lease held in the store until its TTL runs out (from
    /// its last grant or renewal), instead of releasing it: for a key that must stay
    /// taken for a while after its job, such as one run per key per TTL. The lease counts
    /// as released here from now on ([`LockGuard::is_held`] is false): nothing of this
    /// process renews, releases or uses it again, and the store frees the key on its own.
    pub fn leave_to_expire(mut self) {
        self.released = true;
        self.watchdog.unregister(self.id);
        self.status.state.mark_released();
    }
}

impl WriteFence {
    /// The fence of a lock's guard: its key and its token.
    pub fn of(guard: &LockGuard) -> Self {
        Self::granted(guard.key().clone(), guard.token())
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.watchdog.unregister(self.id);
        self.status.state.mark_released();
        let backend = self.watchdog.backend().clone();
        let lease = self.lease.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = backend.release(&lease).await {
                    debug!(key = %lease.key(), %error, "release on drop failed; the lease runs out on its own");
                }
            });
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", self.key())
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish_non_exhaustive()
    }
}

/// A cloneable view of one lease's status: its token, whether it is held, and a
/// future that resolves when it ends. Holding one does not keep the lease alive.
#[derive(Clone, Debug)]
pub struct LeaseStatus {
    token: FencingToken,
    state: Arc<LeaseState>,
}

impl LeaseStatus {
    /// The lease's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// True until the lease is lost, released, or past its local validity deadline.
    pub fn is_held(&self) -> bool {
        self.state.is_held()
    }

    /// The current local validity deadline.
    pub fn valid_until(&self) -> Instant {
        self.state.valid_until()
    }

    /// Resolves when the lease is no longer held (lost, released, or expired locally):
    /// ready at every poll at which [`LeaseStatus::is_held`] would say false.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn lost(&self) {
        self.state.wait_ended().await;
    }

    /// Runs `work` while the lease is held: `Ok` with its output, or
    /// `Err(LockError::Lost)` once the lease is lost, released, or past its local
    /// validity deadline, after which `work` is dropped without being polled again.
    ///
    /// Every wake-up checks the lease, by the local monotonic clock, **before** it polls
    /// `work`: a job that was paused (a stopped process, a runtime whose threads were
    /// blocked) past its deadline does not take another step when it resumes, even if the
    /// timer that marks the lease lost has not fired yet. An output that `work` produced
    /// at a poll made while the lease was held is kept: that step began under a valid
    /// lease and is done; `Ok` does not prove the lease outlived the step, which is what
    /// the fencing token is for.
    ///
    /// This is how [`crate::Locker::with_lock`] runs its job; use it for a leader's loop
    /// (`leadership.status().while_held(..)`) or any task that acts under the lease.
    ///
    /// The future holds a clone of this status, not a borrow, so
    /// `guard.status().while_held(..)` can be awaited or spawned as it is.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops `work` and has no effect on the lease.
    pub fn while_held<F: Future>(
        &self,
        work: F,
    ) -> impl Future<Output = Result<F::Output, LockError>> + use<F> {
        let status = self.clone();
        async move {
            let lost = status.lost();
            tokio::pin!(lost, work);
            std::future::poll_fn(|cx| {
                if lost.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(LockError::Lost));
                }
                work.as_mut().poll(cx).map(Ok)
            })
            .await
        }
    }
}
