//! [`LockLayer`]: each job under its lock; see the [module docs](super).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use distlock_core::{Claim, FencingToken, LockError, LockKey, Locker, MAX_PERMITS, RetryPolicy};
use tower_layer::Layer;
use tower_service::Service;

mod held;

use self::held::{Held, RunOf, end_claim, replaced_by};
pub use self::held::{queue_key, run_key};
use super::locked_service::{Locked, LockedService};
use super::misses::Misses;

/// The counter of lock misses, labelled `outcome`: `retried`, `requeued`, `skipped`,
/// `dead_lettered`, and `replaced` for a job dropped because a newer job of its key
/// replaced it ([`Until::ExecutingOrReplaced`]).
pub const JOB_LOCK_MISSES_TOTAL: &str = "distlock_job_lock_misses_total";
/// The counter of jobs stopped because their lease was lost.
pub const JOB_LOST_TOTAL: &str = "distlock_job_lost_total";

/// What a job finds when its key is held by another worker.
///
/// More policies may come: a `match` on it needs a wildcard arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnMiss {
    /// Wait for the key's release and try again, up to `attempts` tries in all within
    /// this call; then hand the job back as [`OnMiss::Requeue`] does. For low-latency
    /// flows.
    ///
    /// The job waits as [`Locker::lock`] does: where the store announces releases
    /// ([`Capabilities::wakes_waiters`](distlock_core::Capabilities::wakes_waiters)), the
    /// holder's release wakes it at once, and the jittered `delay` (uniform in
    /// `[delay / 2, delay]`) is only the fallback for a release that was not announced (a
    /// lease whose TTL ran out, a lost message); elsewhere it waits that delay.
    Retry {
        /// Tries in all, the first included.
        attempts: u32,
        /// The longest wait between two tries: the fallback where the store announces
        /// releases, the poll interval where it does not.
        delay: Duration,
    },
    /// Hand the job back to the queue at once ([`JobError::Busy`]). For batch systems.
    Requeue,
    /// Drop the job as done without running it ([`JobError::Skipped`]): the key's holder
    /// is doing the same work, so this delivery is a duplicate (sidekiq-unique-jobs'
    /// `on_conflict: :log`, BullMQ's deduplication). The call fails, as the layer has no
    /// response to make up for the job: the queue must take [`JobError::Skipped`] as
    /// done, not retry it (the apalis layer marks the task done). Takes precedence over
    /// [`LockLayer::dead_letter_after`]: a skipped job is never counted as a miss.
    Skip,
}

/// Why a locked job's call failed.
///
/// More reasons may come: a `match` on it needs a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum JobError<E> {
    /// The job ran and failed.
    Job(E),
    /// The key was held by another worker: hand the job back to the queue, to retry later.
    Busy {
        /// The job's lock key.
        key: LockKey,
    },
    /// The key was held on this delivery and on the deliveries before it since the first
    /// that found it held, `misses` in all: stop retrying. See
    /// [`LockLayer::dead_letter_after`] for how they are counted.
    DeadLetter {
        /// The job's lock key.
        key: LockKey,
        /// Deliveries that found the key held, counted as
        /// [`LockLayer::dead_letter_after`] says, this one included.
        misses: u32,
    },
    /// The key was held and the layer's [`OnMiss::Skip`] dropped the job as a duplicate,
    /// without running it: take it as done, not as a failure to retry.
    Skipped {
        /// The job's lock key.
        key: LockKey,
    },
    /// Under [`Until::ExecutingOrReplaced`], a newer job of the key replaced this one
    /// while it waited in the queue (its producer took the queue key with
    /// [`Locker::claim_replacing`]): the job was dropped without running. Take it as
    /// done, not as a failure to retry.
    Replaced {
        /// The job's queue key, which its claim was on.
        key: LockKey,
        /// The token of the newer claim on it.
        by: FencingToken,
    },
    /// The lease was lost while the job ran; the job was stopped before its next step.
    Lost {
        /// The job's lock key.
        key: LockKey,
    },
    /// The key could not be derived, or the store failed.
    Lock(LockError),
}

impl<E: fmt::Display> fmt::Display for JobError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JobError::Job(e) => write!(f, "the job failed: {e}"),
            JobError::Busy { key } => write!(f, "{key} is held by another worker"),
            JobError::DeadLetter { key, misses } => write!(
                f,
                "{key} was held by another worker on {misses} deliveries in a row: dead-lettered"
            ),
            JobError::Skipped { key } => write!(
                f,
                "{key} is held by another worker: the job was dropped as a duplicate, not run"
            ),
            JobError::Replaced { key, by } => write!(
                f,
                "the claim on {key} was replaced by a newer job's (token {}): the job was \
                 dropped, not run",
                by.get()
            ),
            JobError::Lost { key } => {
                write!(f, "the lease on {key} was lost; the job was stopped")
            }
            JobError::Lock(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for JobError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            JobError::Job(e) => Some(e),
            JobError::Lock(e) => Some(e),
            _ => None,
        }
    }
}

type KeyOf<R> = Arc<dyn Fn(&R) -> Result<LockKey, LockError> + Send + Sync>;
type ClaimOf<R> = Arc<dyn Fn(&R) -> Option<Claim> + Send + Sync>;

/// How long the [`Claim`] a job's producer took when it enqueued the job keeps its key;
/// see [`LockLayer::claimed`].
///
/// More may come: a `match` on it needs a wildcard arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Until {
    /// Until the job starts (sidekiq-unique-jobs' `until_executing`): no duplicate is
    /// enqueued while the job waits in the queue; once it starts, the claim is released
    /// and the job runs under its own key, so a duplicate may be enqueued meanwhile. The
    /// claim should be on a key of its own, the job's queue key ([`queue_key`]:
    /// `queued:<job key>`).
    Executing,
    /// Until the job has run (`until_executed`): the claim is the job's lock, resumed by
    /// the worker and released when the job ends, so no duplicate is enqueued from the
    /// moment the producer claims the key until the job is done. The claim must be on
    /// the job's key. A run also holds `running:<job key>`, its run key, which keeps
    /// another delivery of the same job from running beside it, and stops if it loses
    /// either lease: keep job keys out of the `running:` names.
    ///
    /// The job is fenced by its run: [`Locked::key`] is the run key and
    /// [`Locked::token`] the run key's token, which rises with each run (every delivery
    /// of a job carries the same claim, and so the claim's token; a delivery that
    /// resumed the claim of a stopped run would carry that run's token). Every run of the
    /// job fences that key, whether its claim was resumed, had run out, or was not there.
    ///
    /// A run that ends without its release (stopped on a lost lease, its future dropped)
    /// leaves its run key and its claim to run out at their TTL instead of releasing
    /// them: the claim is one lease for every delivery, and may be the next delivery's by
    /// now.
    ///
    /// Keep these job keys out of the `queued:` names too:
    /// [`Locker::claim_replacing`] takes over a claim on such a name.
    Executed,
    /// Until the job starts, or until a newer job of its key replaces it
    /// (sidekiq-unique-jobs' `on_conflict: :replace`): the producer claims the job's queue
    /// key ([`queue_key`]: `queued:<job key>`) with [`Locker::claim_replacing`], which
    /// ends the claim of a job of the key still queued and takes the key under a higher
    /// token. The superseded job stays in the queue until it is delivered; its worker
    /// then finds a token above its claim's on the queue key (the store's
    /// [`inspect`](distlock_core::LockBackend::inspect): the newest token it knows of the
    /// key) and drops the job without running it ([`JobError::Replaced`], counted in
    /// [`JOB_LOCK_MISSES_TOTAL`] as `replaced`; the apalis layer marks the task done). A
    /// job whose claim is the newest, held or run out with no newer one after it, runs
    /// under its key as under [`Until::Executing`].
    ///
    /// Unlike [`Until::Executing`], the claim is not released when the job starts, but
    /// left to run out at its TTL: Redis forgets a free key's token, so a claim released
    /// by a newer job that started first (two workers, one batch) would let the job it
    /// superseded, delivered a moment later, run too; held, it shows its token to that
    /// delivery. A replacing producer takes the key over all the same, so the next job
    /// may be enqueued once this one has started; a plain [`Locker::claim`] finds the key
    /// claimed until the TTL runs out. For the same reason a superseded job is known as
    /// such on Redis only until the newer claim's TTL runs out: the TTL must cover a
    /// job's longest wait in the queue, as for any claim.
    ///
    /// A newer claim means a newer job, whenever it was taken: a job that ran, failed
    /// and comes back for a retry after a newer job of its key was enqueued is dropped
    /// too, and the newer one runs instead. A worker that looks between the two requests
    /// of a replacement (see [`Locker::claim_replacing`]) finds the claim ended with no
    /// newer one and runs the job, as if it had started a moment earlier; the newer job
    /// then runs as well.
    ///
    /// A claim on another key than the job's queue key is a [`LockError::Config`], and
    /// the store must be able to inspect keys (every backend that adopts leases can).
    /// Without this, a job whose claim was superseded runs as [`Until::Executing`]'s do:
    /// the check costs a request per job, and drops jobs that a producer using plain
    /// claims expects to run (one whose claim ran out in the queue before a duplicate
    /// was claimed and enqueued).
    ExecutingOrReplaced,
}
type DeliveriesOf<R> = Arc<dyn Fn(&R) -> u32 + Send + Sync>;

/// [`LockLayer::dead_letter_after`]'s settings and what it has seen.
struct DeadLetter<R> {
    /// Misses that dead-letter a job.
    after: u32,
    /// The request's delivery count; `None` to count the misses this process sees.
    deliveries: Option<DeliveriesOf<R>>,
    /// Without a delivery count: how long after the last counted miss the next one
    /// counts.
    spacing: Duration,
    misses: Arc<Misses>,
}

impl<R> Clone for DeadLetter<R> {
    fn clone(&self) -> Self {
        Self {
            after: self.after,
            deliveries: self.deliveries.clone(),
            spacing: self.spacing,
            misses: self.misses.clone(),
        }
    }
}

/// Runs each job of the inner service under a lock on the key its request names; see the
/// [module docs](super).
pub struct LockLayer<R> {
    locker: Locker,
    key_of: KeyOf<R>,
    on_miss: OnMiss,
    dead_letter: Option<DeadLetter<R>>,
    /// Under [`LockLayer::permits`]: the key names a semaphore of that many permits.
    permits: Option<u32>,
    /// Under [`LockLayer::until_expired`]: a job that succeeded leaves its lease to expire.
    until_expired: bool,
    /// Under [`LockLayer::claimed`]: the request's claim and how long it holds.
    claimed: Option<(ClaimOf<R>, Until)>,
}

impl<R> Clone for LockLayer<R> {
    fn clone(&self) -> Self {
        Self {
            locker: self.locker.clone(),
            key_of: self.key_of.clone(),
            on_miss: self.on_miss,
            dead_letter: self.dead_letter.clone(),
            permits: self.permits,
            until_expired: self.until_expired,
            claimed: self.claimed.clone(),
        }
    }
}

impl<R> fmt::Debug for LockLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("locker", &self.locker)
            .field("on_miss", &self.on_miss)
            .field("permits", &self.permits)
            .field("until_expired", &self.until_expired)
            .field("claimed", &self.claimed.as_ref().map(|c| c.1))
            .field(
                "dead_letter_after",
                &self.dead_letter.as_ref().map(|d| d.after),
            )
            .finish_non_exhaustive()
    }
}

impl<R> LockLayer<R> {
    /// Locks each request's job on `locker`, on the key `key_of` derives from the request
    /// (an invalid key fails the call with [`JobError::Lock`] before anything is sent).
    /// A miss hands the job back ([`OnMiss::Requeue`]) unless [`LockLayer::on_miss`] says
    /// otherwise.
    pub fn new(
        locker: Locker,
        key_of: impl Fn(&R) -> Result<LockKey, LockError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            locker,
            key_of: Arc::new(key_of),
            on_miss: OnMiss::Requeue,
            dead_letter: None,
            permits: None,
            until_expired: false,
            claimed: None,
        }
    }

    /// Unique from enqueue: a job's producer takes the job's [`Claim`] with
    /// [`Locker::claim`] before it enqueues the job (and does not enqueue it when the key
    /// is claimed already), and puts the claim into the job; `claim_of` reads it back
    /// here. The worker resumes it ([`Locker::resume`]) and holds it as `until` says:
    /// until the job starts ([`Until::Executing`]), until it starts or a newer job
    /// replaces it ([`Until::ExecutingOrReplaced`]), or until it has run
    /// ([`Until::Executed`]). A job without a claim, or whose claim ran out before a
    /// worker took the job, runs under its key as without this option. Not on a backend
    /// that cannot [`adopt`](distlock_core::LockBackend::adopt) leases (PostgreSQL
    /// advisory locks: the call fails with [`JobError::Lock`]).
    ///
    /// Until executed, every run also holds the lock `running:<key>` (so the job's key
    /// may be at most 504 bytes), taken before the claim is resumed: every delivery of a
    /// job carries the same claim, and a delivery made while an earlier one still runs (a
    /// queue that took a paused worker for dead) finds it held and is a miss, instead of
    /// running beside the earlier one. Its token is the job's fencing token, on that key
    /// (see [`Until::Executed`]): two runs of a job never share one.
    #[must_use]
    pub fn claimed(
        mut self,
        claim_of: impl Fn(&R) -> Option<Claim> + Send + Sync + 'static,
        until: Until,
    ) -> Self {
        self.claimed = Some((Arc::new(claim_of), until));
        self
    }

    /// Keeps a job's key taken after the job succeeds, until its lease's TTL (the
    /// locker's) runs out from the last renewal, instead of releasing it: at most one run
    /// of a key per TTL, what sidekiq-unique-jobs calls `until_expired` and BullMQ a
    /// throttle (deduplication with a TTL). A delivery within that time is a miss,
    /// handled as [`OnMiss`] and [`LockLayer::dead_letter_after`] say: requeued, it runs
    /// once the TTL has passed; to drop it instead, dead-letter it on its first miss
    /// (`dead_letter_after(1, ..)`). A job that failed, or lost its lease, releases its
    /// key as usual, so that its retry can run. Not with [`LockLayer::permits`] (a
    /// [`LockError::Config`]).
    pub fn until_expired(mut self) -> Result<Self, LockError> {
        if self.permits.is_some() {
            return Err(LockError::Config(
                "until_expired keeps a lock, not a permit: not with permits".into(),
            ));
        }
        self.until_expired = true;
        Ok(self)
    }

    /// Lets up to `permits` jobs of one key run at once instead of one (per-key
    /// concurrency, as a queue's "concurrency per group" setting): the key names a
    /// [`Semaphore`](distlock_core::Semaphore) of that many permits, and each job takes one
    /// of them, renewed while it runs and given back when it ends, as a lock would be. A
    /// job that finds every permit taken is a miss, handled as [`OnMiss`] and
    /// [`LockLayer::dead_letter_after`] say; [`OnMiss::Retry`] waits its delay between
    /// tries (a permit's release is not announced on the semaphore's name). The job's
    /// token fences writes on its permit's slot ([`Locked::key`]). Every process must name
    /// the same number for a key: see [`Locker::semaphore`].
    ///
    /// A number outside 1 to [`MAX_PERMITS`] is a [`LockError::Config`].
    pub fn permits(mut self, permits: u32) -> Result<Self, LockError> {
        if self.until_expired {
            return Err(LockError::Config(
                "until_expired keeps a lock, not a permit: not with permits".into(),
            ));
        }
        if permits == 0 || permits > MAX_PERMITS {
            return Err(LockError::Config(format!(
                "a job's key takes 1 to {MAX_PERMITS} permits, not {permits}"
            )));
        }
        self.permits = Some(permits);
        Ok(self)
    }

    /// What a job does when its key is held by another worker.
    #[must_use]
    pub fn on_miss(mut self, on_miss: OnMiss) -> Self {
        self.on_miss = on_miss;
        self
    }

    /// Dead-letters a job whose key has been found held on `misses` deliveries in a row
    /// ([`JobError::DeadLetter`]); `deliveries` reads from the request how many times the
    /// queue has delivered it, this delivery included (apalis: the attempt count).
    ///
    /// Only deliveries that found the key held count, not those on which the job ran and
    /// failed for its own reasons: the misses are the deliveries from the first one that
    /// found the key held, since this process last took the key for the job, to this one,
    /// both included, by the delivery counts. Taking the key (the job runs, whatever its
    /// outcome) starts the count again, and so does a delivery count lower than that of
    /// the first miss (the job enqueued again). The layer and the services made from it
    /// keep this record in memory, one entry per key missed since it was last taken (at
    /// most 65,536; past that one is forgotten and its count starts again). Where several
    /// processes take jobs of one queue, each counts from the first miss it saw itself,
    /// and a delivery that went to another process between two of its misses is counted as
    /// a miss.
    #[must_use]
    pub fn dead_letter_after(
        mut self,
        misses: u32,
        deliveries: impl Fn(&R) -> u32 + Send + Sync + 'static,
    ) -> Self {
        self.dead_letter = Some(DeadLetter {
            after: misses,
            deliveries: Some(Arc::new(deliveries)),
            spacing: Duration::ZERO,
            misses: Arc::default(),
        });
        self
    }

    /// Dead-letters a job whose key this process has found held on `misses` deliveries
    /// in a row, counting the misses itself: for a queue whose delivery count does not
    /// move when the layer sends a job back without running it (apalis counts an attempt
    /// only when its handler runs). A miss counts only `spacing` or more after the last
    /// one counted, so that a queue that sends the job back sooner than asked does not
    /// dead-letter it in less time than the retries were meant to take.
    #[cfg(feature = "apalis")]
    pub(crate) fn dead_letter_after_misses(mut self, misses: u32, spacing: Duration) -> Self {
        self.dead_letter = Some(DeadLetter {
            after: misses,
            deliveries: None,
            spacing,
            misses: Arc::default(),
        });
        self
    }
}

impl<S, R> Layer<S> for LockLayer<R> {
    type Service = LockService<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`LockLayer`] makes.
pub struct LockService<S, R> {
    inner: S,
    layer: LockLayer<R>,
}

impl<S: Clone, R> Clone for LockService<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, R> fmt::Debug for LockService<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, R> Service<R> for LockService<S, R>
where
    S: LockedService<R>,
    R: Send + 'static,
{
    type Response = S::Response;
    type Error = JobError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, Self::Error>> + Send>>;

    /// Ready when the inner service is ready (its error is [`JobError::Job`]): a job is
    /// taken, and its lock with it, only when the inner service can run it at once, so no
    /// job holds a lock while it waits for capacity (a concurrency or rate limit, a
    /// `Buffer`) and a queue that asks for readiness before it fetches, as apalis does,
    /// leaves the jobs it cannot run yet to other workers. The readiness is held while the
    /// lock is taken, [`OnMiss::Retry`]'s waits included.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(JobError::Job)
    }

    /// # Cancel safety
    /// Dropping the future stops the job and releases its lock (in the background, as a
    /// dropped [`distlock_core::LockGuard`] does; until executed, its run key and claim
    /// are left to run out instead, see [`Until::Executed`]). Dropped while it waits for
    /// the key ([`OnMiss::Retry`]), it leaves no release watch behind, and the readiness
    /// it held goes back to the inner service.
    fn call(&mut self, request: R) -> Self::Future {
        // The clone that was made ready is the one called (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(run(self.layer.clone(), inner, request))
    }
}

/// Takes the lock as the layer's policy says, then runs the job under it.
async fn run<S, R>(
    layer: LockLayer<R>,
    mut inner: S,
    request: R,
) -> Result<S::Response, JobError<S::Error>>
where
    S: Service<Locked<R>>,
{
    let key = (layer.key_of)(&request).map_err(JobError::Lock)?;
    let (attempts, delay) = match layer.on_miss {
        OnMiss::Retry { attempts, delay } => (attempts.max(1), delay),
        OnMiss::Requeue | OnMiss::Skip => (1, Duration::ZERO),
    };
    // Until executed, each try takes the run key, then the claim or the job's key.
    let mut run_of = None;
    match &layer.claimed {
        Some((claim_of, Until::Executing)) => {
            if let Some(claim) = claim_of(&request) {
                end_claim(&layer.locker, &claim).await?;
            }
        }
        Some((claim_of, Until::ExecutingOrReplaced)) => {
            if let Some(claim) = claim_of(&request) {
                let replaced = replaced_by(&layer.locker, &key, &claim).await;
                if let Some(by) = replaced.map_err(JobError::Lock)? {
                    metrics::counter!(JOB_LOCK_MISSES_TOTAL, "outcome" => "replaced").increment(1);
                    return Err(JobError::Replaced {
                        key: claim.key().clone(),
                        by,
                    });
                }
            }
        }
        Some((claim_of, Until::Executed)) => {
            run_of = Some(RunOf::new(&key, claim_of(&request)).map_err(JobError::Lock)?);
        }
        None => {}
    }
    // Watching before the first try, so that a release between a refused try and the wait
    // after it still wakes this job, as in `Locker::lock`: the key the holder releases
    // last, its run key until executed (a try woken by the job's key would find the run
    // key still held). A permit's release is announced on its slot, not on the
    // semaphore's name.
    let mut releases = if attempts > 1 && layer.permits.is_none() {
        let watched = run_of.as_ref().map_or(&key, RunOf::key);
        layer.locker.backend().watch_releases(watched)
    } else {
        None
    };
    let mut tried = 0;
    let held = loop {
        let taken = Held::try_take(&layer, &key, run_of.as_ref()).await;
        if let Some(held) = taken.map_err(JobError::Lock)? {
            break held;
        }
        tried += 1;
        if tried < attempts {
            metrics::counter!(JOB_LOCK_MISSES_TOTAL, "outcome" => "retried").increment(1);
            let fallback = RetryPolicy {
                initial: delay,
                max: delay,
            }
            .backoff(0);
            match releases.as_mut() {
                Some(watch) => {
                    // Woken or timed out, the next try asks the store.
                    let _ = tokio::time::timeout(fallback, watch.released()).await;
                }
                None => tokio::time::sleep(fallback).await,
            }
            continue;
        }
        if layer.on_miss == OnMiss::Skip {
            metrics::counter!(JOB_LOCK_MISSES_TOTAL, "outcome" => "skipped").increment(1);
            return Err(JobError::Skipped { key });
        }
        if let Some(dead_letter) = &layer.dead_letter {
            let misses = match &dead_letter.deliveries {
                Some(deliveries) => dead_letter.misses.missed(&key, deliveries(&request)),
                None => dead_letter.misses.counted(&key, dead_letter.spacing),
            };
            if misses >= dead_letter.after {
                dead_letter.misses.forget(&key);
                metrics::counter!(JOB_LOCK_MISSES_TOTAL, "outcome" => "dead_lettered").increment(1);
                return Err(JobError::DeadLetter { key, misses });
            }
        }
        metrics::counter!(JOB_LOCK_MISSES_TOTAL, "outcome" => "requeued").increment(1);
        return Err(JobError::Busy { key });
    };
    drop(releases);
    if let Some(dead_letter) = &layer.dead_letter {
        dead_letter.misses.forget(&key);
    }
    let status = held.fence().status();
    let locked = Locked::job(request, held.fence());
    // Until executed the run stops when either lease ends: its run key, whose token
    // fences it, or the job's key (its claim), which keeps duplicates from being enqueued.
    let job_status = held.job_status();
    // `inner` is the clone `poll_ready` made ready: it runs the job at once.
    let job = inner.call(locked);
    let outcome = match job_status {
        Some(job_status) => status
            .while_held(job_status.while_held(job))
            .await
            .and_then(|inner| inner),
        None => status.while_held(job).await,
    };
    match outcome {
        Ok(done) => {
            // The job is over either way; a release that fails leaves the lease to end
            // with its TTL, which takes nothing from the job's result.
            match held {
                held if layer.until_expired && done.is_ok() => held.leave_to_expire().await,
                held => {
                    let _ = held.release().await;
                }
            }
            done.map_err(JobError::Job)
        }
        Err(_) => {
            metrics::counter!(JOB_LOST_TOTAL).increment(1);
            drop(held);
            Err(JobError::Lost { key })
        }
    }
}
