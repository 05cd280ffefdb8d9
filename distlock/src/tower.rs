//! A [`tower`](https://docs.rs/tower) layer that runs each job under its lock, for job
//! queues built on tower services (apalis, and any worker that calls a `Service` per job).
//!
//! [`LockLayer`] wraps a service of [`Locked`] requests into a service of plain requests.
//! For each request it derives the lock key with the closure it was given, takes the lock
//! with [`Locker::try_lock`](crate::Locker::try_lock), and calls the inner service with the request, the lease's
//! fencing token and its [`LeaseStatus`](crate::LeaseStatus). The job runs under
//! [`LeaseStatus::while_held`](crate::LeaseStatus::while_held): once the lease is lost (renewal failed, or the local
//! validity deadline passed, even after a pause no timer noticed) the job's future is
//! dropped without another poll and the call fails with [`JobError::Lost`]. The lock is
//! released when the job ends.
//!
//! When the key is held by another worker, [`OnMiss`] decides, as the article's lock-miss
//! policies do: wait for the holder's release and try again ([`OnMiss::Retry`]: woken by
//! the release where the store announces releases, after a short jittered delay
//! otherwise), or hand the job back to the queue at once ([`OnMiss::Requeue`]: the call
//! fails with [`JobError::Busy`], which a queue treats as a failed attempt to retry
//! later), or drop it as a duplicate without running it ([`OnMiss::Skip`]: the call fails
//! with [`JobError::Skipped`], which a queue takes as done). With
//! [`LockLayer::dead_letter_after`] a job that has missed its lock on that many deliveries
//! in a row (deliveries on which it ran and failed for its own reasons do not count)
//! fails with [`JobError::DeadLetter`] instead, which says why, for the queue to stop
//! retrying. Each outcome of a miss is counted in `distlock_job_lock_misses_total` with the
//! label `outcome` (`retried`, `requeued`, `skipped`, `dead_lettered`; `replaced` for a job
//! a newer one of its key replaced in the queue, under
//! [`LockLayer::claimed`]`(.., `[`Until::ExecutingOrReplaced`]`)`), and each job stopped by a
//! lost lease in `distlock_job_lost_total`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::convert::Infallible;
//! use std::future::{Ready, ready};
//! use std::task::{Context, Poll};
//! use std::time::Duration;
//! use distlock::tower::{LockLayer, Locked, OnMiss};
//! use distlock::{FencingToken, LockKey, Locker};
//! use tower_layer::Layer;
//! use tower_service::Service;
//!
//! struct Payout {
//!     job_id: u64,
//! }
//!
//! /// The job: it gets the request and the lease's token, to attach to every write.
//! #[derive(Clone)]
//! struct PayOut;
//!
//! impl Service<Locked<Payout>> for PayOut {
//!     type Response = (u64, FencingToken);
//!     type Error = Infallible;
//!     type Future = Ready<Result<Self::Response, Infallible>>;
//!     fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
//!         Poll::Ready(Ok(()))
//!     }
//!     fn call(&mut self, job: Locked<Payout>) -> Self::Future {
//!         ready(Ok((job.request.job_id, job.token)))
//!     }
//! }
//!
//! let locker = Locker::builder(distlock::connect("memory://").await?)
//!     .ttl(Duration::from_secs(30))
//!     .build()?;
//! let layer = LockLayer::new(locker, |job: &Payout| LockKey::new(format!("payout:{}", job.job_id)))
//!     .on_miss(OnMiss::Retry { attempts: 3, delay: Duration::from_millis(50) })
//!     .dead_letter_after(5, |_job: &Payout| 1 /* the queue's delivery count */);
//! let mut worker = layer.layer(PayOut);
//! let (job_id, token) = worker.call(Payout { job_id: 42 }).await?;
//! assert_eq!(job_id, 42);
//! assert!(token.get() > 0);
//! # Ok(()) }
//! ```
//!
//! [`LeaderLayer`] is the other half, for scheduled jobs: it runs the inner service only
//! in the process that leads the job's role, so N instances of a cron worker fire each
//! tick once, with the leadership's token attached, and [`TickLayer`] on top of it runs
//! each tick once across instances whatever their clocks and however leadership moves.

mod job;
mod leader;
mod locked_service;
mod misses;
mod tick;

pub use job::{
    JOB_LOCK_MISSES_TOTAL, JOB_LOST_TOTAL, JobError, LockLayer, LockService, OnMiss, Until,
    queue_key, run_key,
};
pub use leader::{LeaderLayer, LeaderService, TICKS_SKIPPED_TOTAL};
pub use locked_service::{Locked, LockedService};
pub use tick::{
    DEFAULT_CATCH_UP, DEFAULT_RETENTION, TICKS_CAUGHT_UP_TOTAL, TICKS_CLAIMED_ELSEWHERE_TOTAL,
    TICKS_MISFIRED_TOTAL, TickLayer, TickLayerBuilder, TickService,
};
