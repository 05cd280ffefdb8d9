//! Leader election for a singleton role (a cron trigger, a queue sweeper) on top of
//! [`Locker`], with the same fencing as every lock: one [`Election`] per role and process,
//! [`Election::campaign`] waits until this process leads, and the [`Leadership`] it
//! returns carries the fencing token that every side effect of the leader must carry.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep};
use tracing::debug;

use crate::backend::lease::Release;
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};
use crate::locker::guard::{LeaseStatus, LockGuard};
use crate::locker::waiting::Waiting;
use crate::locker::{Locker, RetryPolicy};
use crate::telemetry::Kind;

/// The prefix of the lock key of every role: role `scheduler` is the key
/// `election:scheduler`.
pub const ELECTION_PREFIX: &str = "election:";

/// The lock key of `role`, as [`Election`] and `lockctl leader` use it.
///
/// Fails with [`LockError::InvalidKey`] for an empty role, or one that makes a key longer
/// than [`crate::MAX_KEY_BYTES`] or with a control character.
pub fn election_key(role: &str) -> Result<LockKey, LockError> {
    if role.is_empty() {
        return Err(LockError::InvalidKey {
            reason: "an election role must not be empty".into(),
        });
    }
    LockKey::new(format!("{ELECTION_PREFIX}{role}"))
}

/// Builds an [`Election`]; see [`Election::builder`].
#[derive(Debug)]
#[must_use]
pub struct ElectionBuilder {
    locker: Locker,
    role: String,
    key: Option<LockKey>,
    retry: Option<RetryPolicy>,
    poll_interval: Option<Duration>,
}

impl ElectionBuilder {
    /// The lock key to elect on, instead of the role's [`election_key`] (for example a key
    /// under a test run's own prefix). `lockctl leader` finds only roles on the default key.
    pub fn key(mut self, key: LockKey) -> Self {
        self.key = Some(key);
        self
    }

    /// The backoff between attempts in [`Election::campaign`]. The default starts at
    /// 10 ms and grows to a tenth of the locker's TTL (between 10 ms and 1 s): a standby
    /// takes over from a resigning leader within one step of it.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// How often [`Election::observe`] asks the store who leads (default a quarter of
    /// the locker's TTL, between 10 ms and 1 s).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = Some(every);
        self
    }

    /// Checks the role and the settings.
    ///
    /// Fails with [`LockError::InvalidKey`] for a role that makes no valid key (see
    /// [`election_key`]) and with [`LockError::Config`] for a retry policy with `initial`
    /// zero or above `max`, or a zero poll interval.
    pub fn build(self) -> Result<Election, LockError> {
        let default_key = election_key(&self.role)?;
        let key = self.key.unwrap_or(default_key);
        let ttl = self.locker.ttl();
        let retry = self.retry.unwrap_or_else(|| {
            let initial = Duration::from_millis(10);
            RetryPolicy {
                initial,
                max: (ttl / 10).clamp(initial, Duration::from_secs(1)),
            }
        });
        if retry.initial.is_zero() || retry.max < retry.initial {
            return Err(LockError::Config(
                "the election's retry policy needs 0 < initial <= max".into(),
            ));
        }
        let poll_interval = self
            .poll_interval
            .unwrap_or_else(|| (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)));
        if poll_interval.is_zero() {
            return Err(LockError::Config(
                "the election's poll interval must be above zero".into(),
            ));
        }
        Ok(Election {
            locker: self.locker,
            role: self.role.into(),
            key,
            retry,
            poll_interval,
        })
    }
}

/// The election for one role: campaign for it, or watch who holds it.
///
/// Cheap to clone. Each process (or task) that may lead creates its own from a
/// [`Locker`] on the shared store.
///
/// Leadership is a lease on the key `election:<role>`, held through a [`LockGuard`] and
/// renewed by the locker's watchdog; it works with every backend. A lease alone does not
/// make one acting leader: a leader paused past its TTL resumes believing it leads while
/// its successor acts. Its triggers are stopped downstream, by a [`crate::FencedResource`]
/// that admits only the newest token:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use std::{sync::Arc, time::Duration};
/// use distlock::{Election, EnforcementMode, FencedResource, Locker, MemoryFencedResource};
/// use distlock::memory::MemoryBackend;
///
/// let locker = Locker::builder(Arc::new(MemoryBackend::new()))
///     .ttl(Duration::from_secs(10))
///     .build()?;
/// let jobs = MemoryFencedResource::new(EnforcementMode::Enforce);
/// let election = Election::new(locker, "nightly-report")?;
///
/// let leadership = election.campaign().await?; // waits until this process leads
/// // Every trigger carries the leader's token; the queue refuses an older one.
/// let trigger = jobs.write("queue:reports", leadership.token(), b"run").await?;
/// assert!(trigger.is_admitted());
/// // Act while leading: once the lease is lost or past its local deadline, the loop is
/// // dropped before its next step, even right after a pause no timer has noticed yet.
/// let acting = leadership.status().while_held(async {
///     tokio::time::sleep(Duration::from_millis(10)).await; // trigger the next run here
/// });
/// if acting.await.is_ok() {
///     leadership.resign().await?;
/// }
/// # Ok(()) }
/// ```
///
/// # Hand-over
///
/// [`Leadership::resign`] releases the lease at once. Where the backend announces releases
/// ([`crate::Capabilities::wakes_waiters`]), a standby in `campaign` is woken by the
/// release and takes over at once; elsewhere at its next attempt, within one backoff step
/// of the election's [`RetryPolicy`]. Never after a TTL. A leader that crashes or pauses
/// is replaced once its lease runs out.
#[derive(Clone, Debug)]
pub struct Election {
    locker: Locker,
    role: Arc<str>,
    key: LockKey,
    retry: RetryPolicy,
    poll_interval: Duration,
}

impl Election {
    /// The election for `role` with the default settings; see [`ElectionBuilder::build`]
    /// for the errors.
    pub fn new(locker: Locker, role: &str) -> Result<Self, LockError> {
        Self::builder(locker, role).build()
    }

    /// A builder for the election for `role` on `locker`.
    pub fn builder(locker: Locker, role: &str) -> ElectionBuilder {
        ElectionBuilder {
            locker,
            role: role.to_owned(),
            key: None,
            retry: None,
            poll_interval: None,
        }
    }

    /// The role.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// The lock key it elects on (`election:<role>` unless [`ElectionBuilder::key`] chose
    /// another).
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Waits until this process leads the role, trying to take its lease whenever the
    /// leader's release is announced (where the backend announces releases; the election's
    /// [`RetryPolicy`]'s longest backoff is the fallback) or else with its jittered backoff. Transient store errors are retried; any
    /// other error is returned. It does not time out: wrap it in `tokio::time::timeout`
    /// to give up.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future ends the campaign and leaves nothing held. The
    /// attempts run in a spawned task; an attempt in flight when the future is dropped
    /// finishes there, and a lease it won is released at once.
    pub async fn campaign(&self) -> Result<Leadership, LockError> {
        let (elected, outcome) = oneshot::channel();
        tokio::spawn(campaign_until_elected(
            self.locker.clone(),
            self.key.clone(),
            self.retry,
            elected,
        ));
        let guard = outcome.await.map_err(|_| {
            LockError::Config("the campaign task ended early: its runtime is shutting down".into())
        })??;
        debug!(role = %self.role, token = %guard.token(), "elected");
        Ok(Leadership {
            guard,
            role: self.role.clone(),
            since: Instant::now(),
        })
    }

    /// Who leads the role, as the store's [`crate::LockBackend::inspect`] reports it:
    /// `Some(Leader)` or `None` when nobody does.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn leader(&self) -> Result<Option<Leader>, LockError> {
        let backend = self.locker.backend();
        let info = backend.inspect(&self.key).await?;
        let Some(owner) = info.owner else {
            return Ok(None);
        };
        let token = info.token.ok_or_else(|| {
            LockError::backend(backend.name(), "inspect reported a holder without a token")
        })?;
        Ok(Some(Leader {
            owner,
            token,
            since: Instant::now(),
            remaining: info.remaining,
        }))
    }

    /// A stream of who leads: an item when the leader changes (a new owner or token, or
    /// nobody), the first one at once.
    ///
    /// It asks the store with [`Election::leader`] every poll interval (see
    /// [`ElectionBuilder::poll_interval`]; by default a quarter of the TTL, between 10 ms
    /// and 1 s), so a change is seen up to one interval late, and a leader that came and
    /// went between two polls is never seen. [`Leader::since`] is when this stream first
    /// saw that leader, not when it was elected. A transient store error is yielded and
    /// polling goes on; any other error (a backend without `inspect` says
    /// [`LockError::Unsupported`]) is yielded and ends the stream.
    pub fn observe(&self) -> impl Stream<Item = Result<Option<Leader>, LockError>> + Send + use<> {
        let election = self.clone();
        let first = Observer::Polling {
            last: None,
            wait: false,
        };
        futures::stream::unfold(first, move |state| {
            let election = election.clone();
            async move { election.next_observation(state).await }
        })
    }

    /// One step of [`Election::observe`]: polls until the leader differs from the last
    /// one yielded, or an error.
    async fn next_observation(
        &self,
        state: Observer,
    ) -> Option<(Result<Option<Leader>, LockError>, Observer)> {
        let Observer::Polling { last, wait } = state else {
            return None;
        };
        if wait {
            sleep(self.poll_interval).await;
        }
        loop {
            match self.leader().await {
                Ok(now) => {
                    if !last.as_ref().is_some_and(|last| same_leader(last, &now)) {
                        let next = Observer::Polling {
                            last: Some(now.clone()),
                            wait: true,
                        };
                        return Some((Ok(now), next));
                    }
                }
                // Polling goes on, still comparing with the last leader yielded.
                Err(error) if error.is_retryable() => {
                    return Some((Err(error), Observer::Polling { last, wait: true }));
                }
                Err(error) => return Some((Err(error), Observer::Ended)),
            }
            sleep(self.poll_interval).await;
        }
    }
}

/// Whether two observations name the same term (or both nobody).
fn same_leader(a: &Option<Leader>, b: &Option<Leader>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.owner == b.owner && a.token == b.token,
        (None, None) => true,
        _ => false,
    }
}

/// Where [`Election::observe`] is.
enum Observer {
    /// Polling; `last` is the leader last yielded (`None` before the first item), and
    /// `wait` says to wait one interval before the next poll.
    Polling {
        last: Option<Option<Leader>>,
        wait: bool,
    },
    /// A permanent error was yielded.
    Ended,
}

/// Tries to take `key` until it is granted or `elected`'s receiver is gone, then sends the
/// guard. Between attempts it waits as [`Locker::lock`] does: for a leader's release to be
/// announced where the backend announces releases (the election's longest backoff is then
/// only the fallback), else with `retry`'s backoff.
async fn campaign_until_elected(
    locker: Locker,
    key: LockKey,
    retry: RetryPolicy,
    mut elected: oneshot::Sender<Result<LockGuard, LockError>>,
) {
    let mut waiting = Waiting::new(locker.backend().as_ref(), &key, retry);
    while !elected.is_closed() {
        let held_by_another = match locker.try_lock_as(&key, Kind::Leader).await {
            // If the campaigner is gone, the guard comes back and is dropped: released.
            Ok(Some(guard)) => {
                let _ = elected.send(Ok(guard));
                return;
            }
            Ok(None) => true,
            Err(error) if error.is_retryable() => {
                debug!(%key, %error, "campaign attempt failed, retrying");
                false
            }
            Err(error) => {
                let _ = elected.send(Err(error));
                return;
            }
        };
        let wait = waiting.after_attempt(held_by_another);
        tokio::select! {
            () = elected.closed() => return,
            () = waiting.wait(wait) => {}
        }
    }
}

/// This process leads the role. Its lease is renewed by the locker's watchdog until
/// [`Leadership::resign`] or a loss.
///
/// Attach [`Leadership::token`] to every side effect (through a
/// [`crate::FencedResource`]), and run the leader's loop under
/// [`LeaseStatus::while_held`] (`leadership.status().while_held(..)`), which stops it
/// before its next step once the lease is lost: another process may already lead with a
/// higher token. A hand-written `select!` on [`Leadership::lost`] must poll `lost()`
/// first (`biased`), or a loop woken after a pause may trigger once more.
///
/// Dropping it without `resign().await` releases the lease in a background task: best
/// effort and late. Resign explicitly on shutdown, so a standby takes over at once.
#[must_use = "leadership ends as soon as it is dropped"]
pub struct Leadership {
    guard: LockGuard,
    role: Arc<str>,
    since: Instant,
}

impl Leadership {
    /// The fencing token of this term: strictly greater than every earlier leader's.
    pub fn token(&self) -> FencingToken {
        self.guard.token()
    }

    /// The owner id of this term, as [`Election::observe`] and `lockctl leader` show it.
    pub fn owner(&self) -> OwnerId {
        self.guard.lease().owner()
    }

    /// The role.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// When this process was elected.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// True until the lease is lost or its local validity deadline passes: check it before
    /// each trigger (fencing downstream still decides).
    pub fn is_leader(&self) -> bool {
        self.guard.is_held()
    }

    /// The lease under the leadership.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// A cloneable view of the lease's status (token, `is_held`, `lost()`), to hand to the
    /// tasks that act for the leader.
    pub fn status(&self) -> LeaseStatus {
        self.guard.status()
    }

    /// Resolves when the lease is lost: renewal said `Lost`, or its local validity
    /// deadline passed without a renewal. Leadership has ended then. It is ready at every
    /// poll at which [`Leadership::is_leader`] would say false.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future has no effect on the lease.
    pub async fn lost(&self) {
        self.guard.lost().await;
    }

    /// Steps down: stops renewal and releases the lease at once, so a standby takes over
    /// at its next attempt. `Release::NotHeld` means leadership had already been lost.
    ///
    /// # Cancel safety
    /// Leadership ends at once; if the future is dropped before the store answers, the
    /// lease frees itself when its TTL runs out.
    pub async fn resign(self) -> Result<Release, LockError> {
        debug!(role = %self.role, token = %self.token(), "resigning");
        self.guard.release().await
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("role", &self.role)
            .field("token", &self.token())
            .field("leader", &self.is_leader())
            .finish_non_exhaustive()
    }
}

/// Who leads a role, as the store reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's owner id (fresh for every term).
    pub owner: OwnerId,
    /// The newest fencing token issued for the role: the leader's.
    pub token: FencingToken,
    /// When this leader was first seen by the caller (not when it was elected).
    pub since: Instant,
    /// How long the leader's lease still runs, as the store sees it.
    pub remaining: Option<Duration>,
}
