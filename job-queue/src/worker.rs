//! One worker process: an apalis worker on the run's Redis queue that makes payouts,
//! as a plain apalis handler under [`distlock::apalis::ApalisLockLayer`] or (to show what
//! goes wrong) without it.
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
use apalis_core::error::BoxDynError;
use apalis_core::task::Task;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_redis::RedisStorage;
use distlock::apalis::{ApalisLockLayer, JobLease, job_error};
use distlock::tower::{JobError, OnMiss};
use distlock::{FencingToken, LockKey, Locker};
use nix::sys::signal::{Signal, raise};
use tower_layer::Layer;
use tower_service::Service;

use crate::heartbeat::Heartbeats;
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
    let lock = if args.locked {
        let locker = Locker::builder(distlock::connect(&args.redis).await?)
            .ttl(TTL)
            .build()?;
        let run = args.run.clone();
        let lock = ApalisLockLayer::new(locker, move |job: &Payout| {
            LockKey::new(format!("queue-payout:{run}:{}", job.id))
        })
        .on_miss(OnMiss::Requeue)
        .retry_after(Duration::from_secs(1))?
        .dead_letter_after(DEAD_LETTER_AFTER);
        Some(lock)
    } else {
        None
    };
    // A plain apalis handler: the lease, when the job runs under one, is an argument.
    let handler = {
        let pay = pay.clone();
        move |job: Payout, lease: Option<JobLease>| {
            pay.clone().pay(job, lease.map(|lease| lease.token()))
        }
    };
    loop {
        // Two jobs at a time per worker, so that every worker gets its share.
        let interval = storage.get_config().heartbeat_interval;
        let builder = WorkerBuilder::new(args.name.as_str())
            .backend(Heartbeats::new(storage.clone(), interval))
            .concurrency(2);
        let stopped = match &lock {
            Some(lock) => {
                let recorded = Recorded {
                    ledger: ledger.clone(),
                    worker: args.name.clone().into(),
                };
                builder
                    .layer(recorded)
                    .layer(lock.clone())
                    .build(handler.clone())
                    .run()
                    .await
            }
            None => builder.build(handler.clone()).run().await,
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

/// Records in the ledger what the lock layer made of each delivery it did not run to the
/// end: its key held (sent back to the queue), dead-lettered, its lease lost.
#[derive(Clone)]
struct Recorded {
    ledger: Ledger,
    worker: Arc<str>,
}

impl<S> Layer<S> for Recorded {
    type Service = Recording<S>;

    fn layer(&self, inner: S) -> Recording<S> {
        Recording {
            inner,
            recorded: self.clone(),
        }
    }
}

/// The service [`Recorded`] makes.
#[derive(Clone)]
struct Recording<S> {
    inner: S,
    recorded: Recorded,
}

impl<S> Service<Task<Payout>> for Recording<S>
where
    S: Service<Task<Payout>, Response = Outcome, Error = BoxDynError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxDynError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxDynError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxDynError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, task: Task<Payout>) -> Self::Future {
        let job = task.args.id;
        let Recorded { ledger, worker } = self.recorded.clone();
        let done = self.inner.call(task);
        Box::pin(async move {
            let e = match done.await {
                Ok(outcome) => return Ok(outcome),
                Err(e) => e,
            };
            let what = match job_error(&*e) {
                Some(JobError::Busy { .. }) => "lock_busy",
                Some(JobError::DeadLetter { .. }) => "dead_lettered",
                Some(JobError::Skipped { .. }) => "skipped",
                Some(JobError::Lost { .. }) => "lease_lost",
                _ => "failed",
            };
            ledger.event(job, &worker, what).await?;
            Err(e)
        })
    }
}
