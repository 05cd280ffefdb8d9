//! One worker process: an apalis worker on the run's Redis queue that makes payouts,
//! under [`distlock::tower::LockLayer`] or (to show what goes wrong) without it.
//!
//! The provider's client is synchronous, so a payout call runs on a blocking thread: once
//! started, no cancellation of the job reaches it. That is where the faults land: a
//! worker told to [`Fault::Pause`] stops its own process (SIGSTOP) just before its first
//! payout call goes out, and one told to [`Fault::Die`] waits after its first payout,
//! unacknowledged, to be killed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis::layers::WorkerBuilderExt;
use apalis_core::error::{AbortError, BoxDynError, RetryAfterError};
use apalis_core::task::Task;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_redis::RedisStorage;
use distlock::tower::{JobError, LockLayer, Locked, OnMiss};
use distlock::{FencingToken, LockKey, Locker};
use nix::sys::signal::{Signal, raise};
use tower_layer::Layer;
use tower_service::Service;

use crate::ledger::{Ledger, Outcome};
use crate::{BoxError, Payout, queue_config};

/// The event the paused call records, its outcome after a colon.
pub const PAUSED_CALL: &str = "paused_call";

/// What goes wrong in a worker process, once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Nothing.
    None,
    /// The process stops (SIGSTOP) just before its first payout call, until resumed.
    Pause,
    /// After its first payout the job waits, unacknowledged, for the process to be killed.
    Die,
}
/// The lock TTL: short, so a paused or killed worker's lease ends soon.
pub const TTL: Duration = Duration::from_secs(1);
/// Deliveries that find the key held before the job is dead-lettered.
pub const DEAD_LETTER_AFTER: u32 = 20;

/// Where a worker process works.
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    /// The queue's Redis (the locks' too).
    pub redis: String,
    /// The ledger's PostgreSQL.
    pub postgres: String,
    /// The run id: names the queue, the lock keys and the ledger rows.
    pub run: String,
    /// The worker's name, unique in the run.
    pub name: String,
    /// Whether jobs run under the lock layer.
    pub locked: bool,
    /// What goes wrong in this process.
    pub fault: Fault,
}

/// Runs the worker until its process is stopped. A worker the queue has given up on (a
/// paused process that missed its heartbeats) stops with an error; it is restarted, as
/// apalis's monitor would, while the calls it had started go on.
pub async fn run(args: WorkerArgs) -> Result<(), BoxError> {
    let ledger = Ledger::open(&args.postgres, &args.run).await?;
    let conn = apalis_redis::connect(args.redis.as_str()).await?;
    let storage = RedisStorage::<Payout>::new(conn).with_config(queue_config(&args.run));
    let pay = Pay {
        ledger: ledger.clone(),
        worker: args.name.clone().into(),
        fault: args.fault,
    };
    let layer = if args.locked {
        let locker = Locker::builder(distlock::connect(&args.redis).await?)
            .ttl(TTL)
            .build()?;
        let run = args.run.clone();
        let layer = LockLayer::new(locker, move |task: &Task<Payout>| {
            LockKey::new(format!("queue-payout:{run}:{}", task.args.id))
        })
        .on_miss(OnMiss::Requeue)
        .dead_letter_after(DEAD_LETTER_AFTER, |task: &Task<Payout>| {
            u32::try_from(task.ctx().attempt()).unwrap_or(u32::MAX)
        });
        Some(layer)
    } else {
        None
    };
    loop {
        // Two jobs at a time per worker, so that every worker gets its share.
        let builder = WorkerBuilder::new(args.name.as_str())
            .backend(storage.clone())
            .concurrency(2);
        let stopped = match &layer {
            Some(layer) => {
                let service = ToApalis {
                    inner: layer.layer(pay.clone()),
                    ledger: ledger.clone(),
                    worker: args.name.clone().into(),
                };
                builder.build(service).run().await
            }
            None => builder.build(pay.clone()).run().await,
        };
        match stopped {
            Ok(()) => return Ok(()),
            Err(e) => eprintln!("{}: the worker stopped ({e}); restarting", args.name),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The job: a payout, with the token of its lease when it runs under one.
#[derive(Clone)]
struct Pay {
    ledger: Ledger,
    worker: Arc<str>,
    fault: Fault,
}

impl Pay {
    async fn pay(self, job: Payout, token: Option<FencingToken>) -> Result<Outcome, Failed> {
        self.ledger.event(job.id, &self.worker, "delivered").await?;
        tokio::time::sleep(Duration::from_millis(job.work_ms)).await;
        let handle = tokio::runtime::Handle::current();
        let (ledger, worker, fault) = (self.ledger.clone(), self.worker.clone(), self.fault);
        let call = tokio::task::spawn_blocking(move || {
            handle.block_on(async {
                let paused =
                    fault == Fault::Pause && ledger.claim("pause", &worker, job.id).await?;
                if paused {
                    raise(Signal::SIGSTOP)?;
                }
                let outcome = ledger.pay(job.id, &worker, token).await?;
                ledger.event(job.id, &worker, outcome.as_str()).await?;
                if paused {
                    let what = format!("{PAUSED_CALL}:{}", outcome.as_str());
                    ledger.event(job.id, &worker, &what).await?;
                }
                Ok::<_, BoxError>(outcome)
            })
        });
        let outcome = call.await.map_err(|e| Failed(e.into()))??;
        if self.fault == Fault::Die
            && outcome == Outcome::Applied
            && self.ledger.claim("kill", &self.worker, job.id).await?
        {
            // Paid, not yet acknowledged: the run kills this process here.
            std::future::pending::<()>().await;
        }
        Ok(outcome)
    }
}

impl Service<Task<Payout>> for Pay {
    type Response = Outcome;
    type Error = Failed;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, Failed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, task: Task<Payout>) -> Self::Future {
        Box::pin(self.clone().pay(task.args, None))
    }
}

impl Service<Locked<Task<Payout>>> for Pay {
    type Response = Outcome;
    type Error = Failed;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, Failed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, locked: Locked<Task<Payout>>) -> Self::Future {
        Box::pin(self.clone().pay(locked.request.args, Some(locked.token)))
    }
}

/// A payout that failed (the ledger or the provider's client).
#[derive(Debug)]
pub struct Failed(BoxError);

impl From<BoxError> for Failed {
    fn from(e: BoxError) -> Self {
        Failed(e)
    }
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the payout failed: {}", self.0)
    }
}

impl std::error::Error for Failed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// The lock layer's outcomes in apalis's terms, each recorded in the ledger: a miss goes
/// back to the queue to be retried later, a job dead-lettered is not retried, a job
/// stopped by a lost lease is retried like any failure.
#[derive(Clone)]
struct ToApalis<S> {
    inner: S,
    ledger: Ledger,
    worker: Arc<str>,
}

impl<S> Service<Task<Payout>> for ToApalis<S>
where
    S: Service<Task<Payout>, Response = Outcome, Error = JobError<Failed>> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxDynError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxDynError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxDynError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<Payout>) -> Self::Future {
        let job = task.args.id;
        let (ledger, worker) = (self.ledger.clone(), self.worker.clone());
        let done = self.inner.call(task);
        Box::pin(async move {
            let e = match done.await {
                Ok(outcome) => return Ok(outcome),
                Err(e) => e,
            };
            let what = match &e {
                JobError::Busy { .. } => "lock_busy",
                JobError::DeadLetter { .. } => "dead_lettered",
                JobError::Lost { .. } => "lease_lost",
                _ => "failed",
            };
            ledger.event(job, &worker, what).await?;
            Err(match e {
                JobError::Busy { .. } => RetryAfterError::new(e, Duration::from_secs(1)).into(),
                JobError::DeadLetter { .. } => AbortError::new(e).into(),
                e => e.into(),
            })
        })
    }
}
