//! [apalis](https://docs.rs/apalis) workers with each job under its lock: a layer that
//! goes between a `WorkerBuilder` and a plain apalis handler.
//!
//! ```no_run
//! # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use apalis_core::backend::memory::MemoryStorage;
//! use apalis_core::error::BoxDynError;
//! use apalis_core::worker::builder::WorkerBuilder;
//! use distlock::apalis::{ApalisLockLayer, JobLease};
//! use distlock::{LockKey, Locker};
//!
//! #[derive(Clone, Debug)]
//! struct Payout {
//!     id: u64,
//! }
//!
//! /// A plain apalis handler; the lease comes as an argument like apalis's own.
//! async fn pay(job: Payout, lease: JobLease) -> Result<(), BoxDynError> {
//!     println!("paying {} under token {}", job.id, lease.token());
//!     Ok(())
//! }
//!
//! let locker = Locker::builder(distlock::connect("redis://127.0.0.1:6379").await?)
//!     .ttl(Duration::from_secs(30))
//!     .build()?;
//! let lock = ApalisLockLayer::new(locker, |job: &Payout| LockKey::new(format!("payout:{}", job.id)))
//!     .dead_letter_after(20);
//! WorkerBuilder::new("payouts")
//!     .backend(MemoryStorage::<Payout>::new())
//!     .layer(lock)
//!     .build(pay)
//!     .run()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`ApalisLockLayer`] is [`LockLayer`] in apalis's terms: the key
//! comes from the job's arguments, and
//! the handler is an ordinary apalis handler that takes a [`JobLease`] argument for the
//! token and the lease's status (or none, if it does not need them). The layer's outcomes
//! become the errors apalis acts on:
//!
//! | the layer finds | apalis gets | apalis does |
//! |---|---|---|
//! | the job ran and failed | the handler's error, unchanged | what its own retry policy says |
//! | the key held by another worker | [`RetryAfterError`] after a jittered, growing delay; the task marked pending | retries the job later |
//! | the key held, under [`OnMiss::Skip`] | [`AbortError`]; the task marked done | does not run it (the storage records it done) |
//! | under [`Until::ExecutingOrReplaced`], the job's claim replaced by a newer job's ([`JobError::Replaced`]) | [`AbortError`]; the task marked done | does not run it (the storage records it done) |
//! | the key held on [`dead_letter_after`](ApalisLockLayer::dead_letter_after) deliveries in a row | [`AbortError`]; the task marked killed | stops retrying (killed) |
//! | the lease lost while the job ran (the job stopped before its next step) | the [`JobError`]; the task marked failed | a failed attempt, retried by its policy |
//! | the lock store unreachable, or its reply lost ([`LockError::is_retryable`]) | the [`JobError`]; the task marked failed | a failed attempt (the handler did not run, so the attempt count does not move: apalis-redis 1.0 schedules it again at once, apalis-postgres at its next fetch, until the store answers) |
//! | what no retry can mend: an invalid key, a claim on another key, a call the store does not support | [`AbortError`] with the [`JobError`]; the task marked killed | stops retrying (killed) |
//!
//! Each error the layer makes has a `JobError<Infallible>` saying why: [`job_error`] finds
//! it in an error apalis reports.
//!
//! apalis 1.0 counts an attempt, and sets a task's status, only where it calls the
//! handler, inside every layer; a delivery this layer sends back without running it
//! leaves both as they were. So the layer sets the status itself (storages acknowledge
//! a task by it: apalis-redis 1.0 puts a killed task in its dead set and schedules a
//! pending one again), and counts the misses toward
//! [`dead_letter_after`](ApalisLockLayer::dead_letter_after) itself. apalis-redis 1.0
//! schedules a task sent back by its own rule (now plus the attempts it has run, in
//! seconds) and does not read [`RetryAfterError`]'s delay; a storage that does gets the
//! jittered one.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::error::{AbortError, BoxDynError, RetryAfterError};
use apalis_core::task::Task;
use apalis_core::task::data::MissingDataError;
use apalis_core::task::from_request::FromRequest;
use apalis_core::task::status::Status;
use distlock_core::{
    Claim, FencingToken, LeaseStatus, LockError, LockKey, Locker, RetryPolicy, WriteFence,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::tower::{JobError, LockLayer, LockService, Locked, OnMiss, Until};

/// The default of [`ApalisLockLayer::retry_after`].
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The longest delay before a job whose key was held is tried again, whatever its
/// delivery count: 64 times [`ApalisLockLayer::retry_after`].
const RETRY_GROWTH_CAP: u32 = 64;

/// What the handler gets of the lease its job runs under: take it as an argument of an
/// apalis handler (`async fn pay(job: Payout, lease: JobLease)`).
#[derive(Clone, Debug)]
pub struct JobLease {
    fence: WriteFence,
    status: LeaseStatus,
}

impl JobLease {
    /// The key the lease holds, which its token fences (see
    /// [`Locked::key`](crate::tower::Locked::key)): under
    /// [`ApalisLockLayer::claimed`]`(.., `[`Until::Executed`]`)` the job's run key,
    /// `running:<job key>`, whose token is new for each run.
    pub fn key(&self) -> &LockKey {
        self.fence.key()
    }

    /// The lease's fencing token, ordered only against the other tokens of
    /// [`JobLease::key`]: fence writes with [`JobLease::fence`], which keeps the two
    /// together.
    pub fn token(&self) -> FencingToken {
        self.fence.token()
    }

    /// What to fence the job's writes with: [`JobLease::key`] and [`JobLease::token`]
    /// together, made from the lease, to hand to
    /// [`FencedResourceExt::write_under`](distlock_core::FencedResourceExt::write_under);
    /// a run that lost its lease to a later one is refused there.
    pub fn fence(&self) -> WriteFence {
        self.fence.clone()
    }

    /// The lease's status, to check [`LeaseStatus::is_held`] between the job's steps.
    pub fn status(&self) -> &LeaseStatus {
        &self.status
    }
}

impl<Args: Sync> FromRequest<Task<Args>> for JobLease {
    type Error = MissingDataError;

    /// The lease of a job run under [`ApalisLockLayer`]; [`MissingDataError`] for a job
    /// that runs without it (a worker built without the layer).
    async fn from_request(task: &Task<Args>) -> Result<Self, Self::Error> {
        task.ctx().data().get_checked::<JobLease>().cloned()
    }
}

/// The [`JobError`] that says why the layer failed a job, in an error apalis reports (the
/// error itself, or the source of its [`RetryAfterError`] or [`AbortError`]); `None` for
/// the handler's own errors.
pub fn job_error<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a JobError<Infallible>> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<JobError<Infallible>>() {
            return Some(found);
        }
        next = e.source();
    }
    None
}

/// Runs each job of an apalis worker under a lock on the key its arguments name; see the
/// [module docs](self).
pub struct ApalisLockLayer<Args> {
    layer: LockLayer<Task<Args>>,
    retry_after: Duration,
    /// [`Self::dead_letter_after`]'s misses.
    dead_letter_after: Option<u32>,
}

impl<Args> Clone for ApalisLockLayer<Args> {
    fn clone(&self) -> Self {
        Self {
            layer: self.layer.clone(),
            retry_after: self.retry_after,
            dead_letter_after: self.dead_letter_after,
        }
    }
}

impl<Args> fmt::Debug for ApalisLockLayer<Args> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApalisLockLayer")
            .field("layer", &self.layer)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl<Args: 'static> ApalisLockLayer<Args> {
    /// Locks each job on `locker`, on the key `key_of` derives from its arguments (an
    /// invalid key fails the job with [`JobError::Lock`] before anything is sent). A job
    /// whose key is held goes back to the queue ([`OnMiss::Requeue`]) unless
    /// [`Self::on_miss`] says otherwise, to be tried again after [`Self::retry_after`].
    pub fn new(
        locker: Locker,
        key_of: impl Fn(&Args) -> Result<LockKey, LockError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            layer: LockLayer::new(locker, move |task: &Task<Args>| key_of(&task.args)),
            retry_after: DEFAULT_RETRY_AFTER,
            dead_letter_after: None,
        }
    }

    /// What a job does when its key is held by another worker; see [`OnMiss`].
    #[must_use]
    pub fn on_miss(mut self, on_miss: OnMiss) -> Self {
        self.layer = self.layer.on_miss(on_miss);
        self
    }

    /// Lets up to `permits` jobs of one key run at once; see [`LockLayer::permits`].
    pub fn permits(mut self, permits: u32) -> Result<Self, LockError> {
        self.layer = self.layer.permits(permits)?;
        Ok(self)
    }

    /// Unique from enqueue: the producer [claims](Locker::claim) the job's key before it
    /// pushes the job (and pushes nothing when the key is claimed), and puts the
    /// [`Claim`] into the job's arguments, where `claim_of` finds it; see
    /// [`LockLayer::claimed`] and [`Until`].
    #[must_use]
    pub fn claimed(
        mut self,
        claim_of: impl Fn(&Args) -> Option<Claim> + Send + Sync + 'static,
        until: Until,
    ) -> Self {
        self.layer = self
            .layer
            .claimed(move |task: &Task<Args>| claim_of(&task.args), until);
        self
    }

    /// Keeps a job's key taken after the job succeeds, until the lease's TTL runs out;
    /// see [`LockLayer::until_expired`]. With [`Self::dead_letter_after`]`(1)` a duplicate
    /// within the TTL is dropped (`AbortError`) instead of retried after it.
    pub fn until_expired(mut self) -> Result<Self, LockError> {
        self.layer = self.layer.until_expired()?;
        Ok(self)
    }

    /// Dead-letters a job whose key this process has found held on `misses` deliveries
    /// in a row (deliveries on which the job ran, whatever its outcome, start the count
    /// again): the job is marked killed and fails with [`AbortError`], and apalis does
    /// not deliver it again. The layer counts the misses itself: apalis counts an
    /// attempt only when its handler runs, so a delivery the layer sends back does not
    /// move the task's attempt counter.
    ///
    /// A miss counts only half of [`Self::retry_after`] or more after the last one
    /// counted (the shortest delay the layer asks for): apalis-redis 1.0 sends a job
    /// back at once, and twenty deliveries can pass in less than a lease's TTL while the
    /// key's holder is paused or dead, its lease about to lapse; counted, they would
    /// dead-letter a job that nobody runs. So `misses` misses take at least
    /// `(misses - 1) * retry_after / 2`; choose them so that this is longer than the
    /// locker's TTL, and a dead-lettered job's key was held by a live holder throughout.
    #[must_use]
    pub fn dead_letter_after(mut self, misses: u32) -> Self {
        self.dead_letter_after = Some(misses);
        self.layer = self
            .layer
            .dead_letter_after_misses(misses, self.retry_after / 2);
        self
    }

    /// The delay before a job whose key was held is tried again, at its first delivery;
    /// it doubles with each delivery up to 64 times this, and is drawn uniformly from the
    /// upper half of that (jitter, so that the workers that missed one key together do
    /// not come back together). Default [`DEFAULT_RETRY_AFTER`]. A zero delay is refused.
    pub fn retry_after(mut self, delay: Duration) -> Result<Self, LockError> {
        if delay.is_zero() {
            return Err(LockError::Config(
                "the retry delay of a job whose key was held must be greater than zero".into(),
            ));
        }
        self.retry_after = delay;
        if let Some(misses) = self.dead_letter_after {
            self.layer = self.layer.dead_letter_after_misses(misses, delay / 2);
        }
        Ok(self)
    }
}

impl<S, Args> Layer<S> for ApalisLockLayer<Args> {
    type Service = ApalisLock<S, Args>;

    fn layer(&self, inner: S) -> Self::Service {
        ApalisLock {
            inner: self.layer.layer(WithLease { inner }),
            outcomes: Outcomes {
                retry_after: self.retry_after,
            },
        }
    }
}

/// The service [`ApalisLockLayer`] makes.
pub struct ApalisLock<S, Args> {
    inner: LockService<WithLease<S>, Task<Args>>,
    outcomes: Outcomes,
}

impl<S: Clone, Args> Clone for ApalisLock<S, Args> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            outcomes: self.outcomes,
        }
    }
}

impl<S: fmt::Debug, Args> fmt::Debug for ApalisLock<S, Args> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApalisLock")
            .field("inner", &self.inner)
            .field("retry_after", &self.outcomes.retry_after)
            .finish()
    }
}

impl<S, Args> Service<Task<Args>> for ApalisLock<S, Args>
where
    S: Service<Task<Args>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Into<BoxDynError> + Send,
    Args: Send + Sync + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxDynError>> + Send>>;

    /// Ready when the handler's service is ready, as [`LockService`]'s readiness says.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxDynError>> {
        let outcomes = self.outcomes;
        self.inner
            .poll_ready(cx)
            .map_err(|e| outcomes.into_apalis(e, 0))
    }

    /// # Cancel safety
    /// As [`LockService`]'s: dropping the future stops the job and releases its lock.
    fn call(&mut self, task: Task<Args>) -> Self::Future {
        // The task's context is shared with apalis's own layers: its storage acknowledges
        // a task by the status set there, whatever the error says.
        let ctx = task.ctx().clone();
        let outcomes = self.outcomes;
        let run = self.inner.call(task);
        Box::pin(async move {
            run.await.map_err(|e| {
                match &e {
                    JobError::Busy { .. } => ctx.raw_status().store(Status::Pending),
                    JobError::DeadLetter { .. } => ctx.raw_status().store(Status::Killed),
                    JobError::Skipped { .. } | JobError::Replaced { .. } => {
                        ctx.raw_status().store(Status::Done);
                    }
                    // What no retry can mend (an invalid key, a claim on another key,
                    // a call the store does not support): killed, to the dead letters.
                    JobError::Lock(e) if !e.is_retryable() => {
                        ctx.raw_status().store(Status::Killed);
                    }
                    // A failed attempt, to be retried. A job stopped for a lost lease was
                    // dropped inside apalis's lifecycle layer, which had marked it running
                    // and never saw it end: acknowledged as running, apalis-redis puts it
                    // in its dead set and apalis-postgres never fetches it again.
                    JobError::Lost { .. } | JobError::Lock(_) => {
                        ctx.raw_status().store(Status::Failed);
                    }
                    // The handler's own error: the lifecycle layer has set the status.
                    JobError::Job(_) => {}
                }
                let delivery = u32::try_from(ctx.attempt()).unwrap_or(u32::MAX);
                outcomes.into_apalis(e, delivery)
            })
        })
    }
}

/// How the layer's outcomes become apalis errors (the table of the module docs).
#[derive(Clone, Copy, Debug)]
struct Outcomes {
    retry_after: Duration,
}

impl Outcomes {
    fn into_apalis<E: Into<BoxDynError>>(self, e: JobError<E>, delivery: u32) -> BoxDynError {
        let why = match e {
            JobError::Job(e) => return e.into(),
            JobError::Busy { key } => {
                let delay = RetryPolicy {
                    initial: self.retry_after,
                    max: self.retry_after.saturating_mul(RETRY_GROWTH_CAP),
                }
                .backoff(delivery.saturating_sub(1));
                return Box::new(RetryAfterError::new(
                    JobError::<Infallible>::Busy { key },
                    delay,
                ));
            }
            JobError::DeadLetter { key, misses } => {
                return Box::new(AbortError::new(JobError::<Infallible>::DeadLetter {
                    key,
                    misses,
                }));
            }
            JobError::Skipped { key } => {
                return Box::new(AbortError::new(JobError::<Infallible>::Skipped { key }));
            }
            JobError::Replaced { key, by } => {
                return Box::new(AbortError::new(JobError::<Infallible>::Replaced {
                    key,
                    by,
                }));
            }
            JobError::Lost { key } => JobError::<Infallible>::Lost { key },
            JobError::Lock(e) if !e.is_retryable() => {
                return Box::new(AbortError::new(JobError::<Infallible>::Lock(e)));
            }
            JobError::Lock(e) => JobError::Lock(e),
        };
        Box::new(why)
    }
}

/// The handler's service behind the lock: the lease goes into the task's data, where a
/// [`JobLease`] argument finds it.
#[derive(Clone, Debug)]
pub struct WithLease<S> {
    inner: S,
}

impl<S, Args> Service<Locked<Task<Args>>> for WithLease<S>
where
    S: Service<Task<Args>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, locked: Locked<Task<Args>>) -> S::Future {
        let fence = locked
            .fence()
            .expect("the job layer gives every job the fence of its lease");
        let Locked {
            mut request,
            status,
            ..
        } = locked;
        request.inject_data(JobLease { fence, status });
        self.inner.call(request)
    }
}
