//! [`Locker`]: waiting, retrying and renewing on top of any [`LockBackend`].

pub(crate) mod claim;
pub(crate) mod election;
pub(crate) mod guard;
pub(crate) mod semaphore;
pub(crate) mod waiting;
pub(crate) mod watchdog;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::time::{Instant, timeout_at};
use tracing::debug;

use crate::backend::LockBackend;
use crate::backend::lease::Lease;
use crate::error::LockError;
use crate::key::LockKey;
use crate::layer::instrumented::Instrumented;
use crate::locker::guard::LockGuard;
use crate::locker::waiting::Waiting;
use crate::locker::watchdog::{LeaseState, Watchdog, check_schedule};
use crate::telemetry::{Kind, WAIT_SECONDS};

/// How [`Locker::lock`] waits between attempts: exponential backoff with jitter.
///
/// The n-th wait is drawn uniformly from `[d/2, d]` where `d = min(max, initial * 2^n)`,
/// so waiters spread out instead of retrying in step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first backoff.
    pub initial: Duration,
    /// The longest backoff.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(10),
            max: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// The jittered wait before attempt `attempt + 1`.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .initial
            .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX));
        let ceiling = exp.min(self.max).max(Duration::from_micros(1));
        let floor = ceiling / 2;
        rand::rng().random_range(floor..=ceiling)
    }
}

/// Builds a [`Locker`]; see [`Locker::builder`].
#[derive(Debug)]
#[must_use]
pub struct LockerBuilder {
    backend: Arc<dyn LockBackend>,
    ttl: Duration,
    retry: RetryPolicy,
    wait_timeout: Option<Duration>,
    renew_interval: Option<Duration>,
}

impl LockerBuilder {
    /// The lease TTL (default 30 s). Pick about twice the p99 job time.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The backoff between attempts in [`Locker::lock`].
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// How long [`Locker::lock`] waits before it fails with `Timeout` (default 30 s);
    /// `None` waits forever. A wait too long to be a deadline on this machine's clock
    /// (`Duration::MAX`) is refused by [`LockerBuilder::build`]: use `None` for that.
    pub fn wait_timeout(mut self, wait: Option<Duration>) -> Self {
        self.wait_timeout = wait;
        self
    }

    /// How long after a grant or renewal the watchdog renews (default TTL / 3). It must
    /// leave time to retry a failed renewal before the lease runs out.
    pub fn renew_interval(mut self, every: Duration) -> Self {
        self.renew_interval = Some(every);
        self
    }

    /// Checks the settings against the backend's capabilities and against each other.
    ///
    /// Fails with [`LockError::InvalidTtl`] for a TTL the store cannot honour or too
    /// short to renew a lease before it runs out, and with [`LockError::Config`] for a
    /// retry policy with `initial` zero or above `max`, a renew interval that is zero or
    /// leaves no time to retry a renewal, or a wait timeout too long to be a deadline.
    pub fn build(self) -> Result<Locker, LockError> {
        self.backend.capabilities().check_ttl(self.ttl)?;
        if self.retry.initial.is_zero() || self.retry.max < self.retry.initial {
            return Err(LockError::Config(
                "the retry policy needs 0 < initial <= max".into(),
            ));
        }
        if self.renew_interval.is_some_and(|every| every.is_zero()) {
            return Err(LockError::Config(
                "the renew interval must be above zero".into(),
            ));
        }
        check_schedule(self.ttl, self.renew_interval)?;
        wait_deadline(Instant::now(), self.wait_timeout)?;
        let backend: Arc<dyn LockBackend> = Arc::new(Instrumented::new(self.backend));
        Ok(Locker {
            inner: Arc::new(Inner {
                watchdog: Arc::new(Watchdog::new(backend, self.renew_interval)),
                ttl: self.ttl,
                retry: self.retry,
                wait_timeout: self.wait_timeout,
            }),
        })
    }
}

/// Takes locks on a backend, waits for them, and keeps them alive with one renewal
/// task for all its guards. Cheap to clone; clones share the renewal task.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use std::{sync::Arc, time::Duration};
/// use distlock::{LockKey, Locker, memory::MemoryBackend};
///
/// let locker = Locker::builder(Arc::new(MemoryBackend::new()))
///     .ttl(Duration::from_secs(10))
///     .build()?;
/// let key = LockKey::new("payout:42")?;
/// let token = locker
///     .with_lock(&key, |guard| {
///         let token = guard.token();
///         async move { token } // write downstream with `token` here
///     })
///     .await?;
/// assert_eq!(token.get(), 1);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Locker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    watchdog: Arc<Watchdog>,
    ttl: Duration,
    retry: RetryPolicy,
    wait_timeout: Option<Duration>,
}

impl Locker {
    /// A locker with the default settings (TTL 30 s, wait 30 s, renew at TTL / 3).
    ///
    /// Fails if the backend cannot honour the default TTL; use [`Locker::builder`] then.
    pub fn new(backend: Arc<dyn LockBackend>) -> Result<Self, LockError> {
        Self::builder(backend).build()
    }

    /// A builder for a locker on `backend`.
    pub fn builder(backend: Arc<dyn LockBackend>) -> LockerBuilder {
        LockerBuilder {
            backend,
            ttl: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            wait_timeout: Some(Duration::from_secs(30)),
            renew_interval: None,
        }
    }

    /// The lease TTL.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The backoff between attempts.
    pub fn retry(&self) -> RetryPolicy {
        self.inner.retry
    }

    /// The backend, wrapped with tracing and metrics.
    pub fn backend(&self) -> &Arc<dyn LockBackend> {
        self.inner.watchdog.backend()
    }

    /// How many leases this locker's watchdog is renewing.
    pub fn held(&self) -> usize {
        self.inner.watchdog.held()
    }

    /// Takes the lock if it is free, without waiting. A name of the form
    /// `<name>:permit:<n>` is refused with [`LockError::InvalidKey`] before anything is
    /// sent: it is a permit slot of [semaphore](Locker::semaphore) `<name>`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::{LockKey, Locker};
    ///
    /// let locker = Locker::new(distlock::connect("memory://").await?)?;
    /// let key = LockKey::new("export:tenant-7")?;
    /// let held = locker.try_lock(&key).await?.expect("the key is free");
    /// // Held: another attempt gets None at once, and the job goes back to the queue.
    /// assert!(locker.try_lock(&key).await?.is_none());
    /// held.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Not cancel safe: if cancelled after the store granted the lease, the lease is
    /// not renewed and frees itself when its TTL runs out.
    pub async fn try_lock(&self, key: &LockKey) -> Result<Option<LockGuard>, LockError> {
        self.try_lock_as(key, Kind::Lock).await
    }

    /// [`Locker::try_lock`] of a lease held as `kind` (its metrics' label).
    pub(crate) async fn try_lock_as(
        &self,
        key: &LockKey,
        kind: Kind,
    ) -> Result<Option<LockGuard>, LockError> {
        refuse_permit_slot(key)?;
        let sent = Instant::now();
        let granted = self.backend().acquire(key, self.inner.ttl).await?;
        Ok(granted.map(|lease| self.guard(lease, sent, kind)))
    }

    /// A guard for `lease`, held as `kind`, granted to a request sent at `sent`, renewed
    /// by the watchdog from now on.
    pub(crate) fn guard(&self, lease: Lease, sent: Instant, kind: Kind) -> LockGuard {
        let watchdog = &self.inner.watchdog;
        let state = Arc::new(LeaseState::new(
            lease.valid_until(),
            watchdog.backend().name(),
            kind,
        ));
        let id = watchdog.register(lease.clone(), state.clone(), sent);
        LockGuard::new(lease, state, id, watchdog.clone())
    }

    /// Waits for the lock, up to the wait timeout. Where the backend announces releases
    /// ([`crate::Capabilities::wakes_waiters`]) a release wakes one waiter of the key per
    /// process at once, and between announcements a waiter asks the store again only
    /// after the policy's longest backoff (the fallback for a release that was not
    /// announced: a TTL that ran out, a lost message). Elsewhere it polls with jittered
    /// exponential backoff.
    /// Transient store errors are retried within the same deadline, and the deadline
    /// holds even when a single call to the store hangs: that call is abandoned and
    /// `Timeout` returned (if the store granted it anyway, the lease frees itself when
    /// its TTL runs out).
    ///
    /// The time waited is recorded in `distlock_wait_seconds` with its outcome
    /// ([`telemetry::WAIT_SECONDS`](crate::telemetry::WAIT_SECONDS)), and every attempt
    /// that found the key held in `distlock_acquire_total{outcome="contended"}`.
    ///
    /// # Cancel safety
    /// As [`Locker::try_lock`]. A cancelled wait leaves no subscription behind: its
    /// release watch is dropped with it, and a wake it had received goes to another
    /// waiter of the key. It records no wait time.
    pub async fn lock(&self, key: &LockKey) -> Result<LockGuard, LockError> {
        let waiting = Waiting::new(self.backend().as_ref(), key, self.inner.retry);
        let wait = self.inner.wait_timeout;
        self.wait_for(key, Kind::Lock, wait, waiting, || self.try_lock(key))
            .await
    }

    /// The wait timeout of [`Locker::lock`] (`None`: no deadline).
    pub(crate) fn wait_timeout(&self) -> Option<Duration> {
        self.inner.wait_timeout
    }

    /// Waits until `attempt` grants what it asks for, up to `wait` (`None`: no deadline),
    /// waiting between attempts as `waiting` says; `name` is what a `Timeout` names.
    /// Records the time waited in `distlock_wait_seconds`, labelled `kind`. A `wait` too
    /// long to be a deadline is [`LockError::Config`].
    pub(crate) async fn wait_for<T, F, Fut>(
        &self,
        name: &LockKey,
        kind: Kind,
        wait: Option<Duration>,
        waiting: Waiting,
        attempt: F,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Option<T>, LockError>>,
    {
        let started = Instant::now();
        let result = self
            .retry_until(name, wait, waiting, attempt, started)
            .await;
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(LockError::Timeout { .. }) => "timed_out",
            Err(_) => "error",
        };
        metrics::histogram!(
            WAIT_SECONDS,
            "backend" => self.backend().name(),
            "kind" => kind.as_str(),
            "outcome" => outcome
        )
        .record((Instant::now() - started).as_secs_f64());
        result
    }

    /// [`Locker::wait_for`]'s loop, begun at `started`.
    async fn retry_until<T, F, Fut>(
        &self,
        name: &LockKey,
        wait: Option<Duration>,
        mut waiting: Waiting,
        mut attempt: F,
        started: Instant,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Option<T>, LockError>>,
    {
        let deadline = wait_deadline(started, wait)?;
        let timed_out = || LockError::Timeout {
            key: name.clone(),
            waited: Instant::now() - started,
        };
        loop {
            let tried = match deadline {
                Some(deadline) => timeout_at(deadline, attempt())
                    .await
                    .map_err(|_| timed_out())?,
                None => attempt().await,
            };
            let held_by_another = match tried {
                Ok(Some(guard)) => return Ok(guard),
                Ok(None) => true,
                Err(e) if e.is_retryable() => {
                    debug!(key = %name, error = %e, "acquire failed, retrying");
                    false
                }
                Err(e) => return Err(e),
            };
            let now = Instant::now();
            let mut wait = waiting.after_attempt(held_by_another);
            if let Some(deadline) = deadline {
                if now >= deadline {
                    return Err(timed_out());
                }
                wait = wait.min(deadline - now);
            }
            waiting.wait(wait).await;
        }
    }

    /// Waits for the lock, runs the job, and releases the lock.
    ///
    /// `job` receives the guard to read its token and status (clone
    /// [`LockGuard::status`] into the future to check `is_held` inside it). The job runs
    /// under [`LeaseStatus::while_held`](crate::LeaseStatus::while_held): once the lease is
    /// lost, or past its local validity deadline by this process's monotonic clock, the
    /// job's future is dropped without being polled again and `Err(LockError::Lost)` is
    /// returned.
    ///
    /// At the boundary: every wake-up checks the lease **before** it polls the job, so a
    /// job paused past its TTL (a stopped process, blocked runtime threads) never takes
    /// another step when it resumes, even before any timer or the watchdog has run. A job
    /// that completes at a poll made while the lease was still valid returns its value:
    /// that last step began under the lease and is done, and running it again would only
    /// repeat it. `Ok` therefore does not prove the lease was held to the end of the last
    /// step; the job's writes are guarded by the fencing token, not by this result.
    ///
    /// Neither outcome waits on an unreachable store: after a loss the release runs in the
    /// background, and after success it waits at most until the lease's `valid_until`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::{LockKey, Locker};
    ///
    /// let locker = Locker::new(distlock::connect("memory://").await?)?;
    /// let key = LockKey::new("payout:42")?;
    /// let paid = locker
    ///     .with_lock(&key, |guard| {
    ///         let token = guard.token();
    ///         async move {
    ///             // ... pay, with `token` on the write ...
    ///             token
    ///         }
    ///     })
    ///     .await?;
    /// // The lock was released when the job ended: the next run takes it at once.
    /// assert!(locker.try_lock(&key).await?.is_some_and(|next| next.token() > paid));
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Cancelling drops the job and the guard (release on drop, best effort).
    pub async fn with_lock<F, Fut, T>(&self, key: &LockKey, job: F) -> Result<T, LockError>
    where
        F: FnOnce(&LockGuard) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.lock(key).await?;
        let work = job(&guard);
        run_while_held(guard, work).await
    }
}

/// Runs `work` under `guard`'s lease, then releases it: [`Locker::with_lock`]'s body.
pub(crate) async fn run_while_held<T>(
    guard: LockGuard,
    work: impl Future<Output = T>,
) -> Result<T, LockError> {
    let value = match guard.status().while_held(work).await {
        Ok(value) => value,
        Err(lost) => {
            // The store may be unreachable: release in the background (on drop)
            // instead of making the caller wait for it.
            drop(guard);
            return Err(lost);
        }
    };
    // Waiting past the lease's validity gains nothing: it frees itself by then.
    let deadline = guard.valid_until();
    let key = guard.key().clone();
    match timeout_at(deadline, guard.release()).await {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => {
            debug!(%key, %error, "release after the job failed; the lease runs out on its own");
        }
        Err(_) => {
            debug!(%key, "release after the job timed out; the lease runs out on its own")
        }
    }
    Ok(value)
}

/// The instant a wait of `wait` from `start` ends; `None` for no deadline. A wait too long
/// for the clock to represent is a configuration error, not a panic.
fn wait_deadline(start: Instant, wait: Option<Duration>) -> Result<Option<Instant>, LockError> {
    wait.map(|wait| {
        start.checked_add(wait).ok_or_else(|| {
            LockError::Config(format!(
                "the wait timeout {wait:?} is too long to be a deadline; use `wait_timeout(None)` \
                 to wait without one"
            ))
        })
    })
    .transpose()
}

/// Refuses a lock named like a semaphore's permit slot (`<name>:permit:<n>`): it would
/// silently take a permit of semaphore `<name>` from every process that names it.
pub(crate) fn refuse_permit_slot(key: &LockKey) -> Result<(), LockError> {
    if key.permit_slot().is_some() {
        return Err(LockError::InvalidKey {
            reason: format!(
                "{key} is named like a permit slot of a semaphore (<name>:permit:<n>), and a \
                 lock of that name would take one of its permits: choose another name"
            ),
        });
    }
    Ok(())
}
