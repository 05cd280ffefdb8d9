//! One scheduler instance: apalis-cron fires every second in every instance; the
//! [`TickLayer`] on the [`LeaderLayer`] runs the tick only where this process leads the
//! role, and only if no instance claimed it already, whatever the instances' clocks.
//!
//! The instance's clock can be set behind by [`CLOCK_OFFSET_ENV`] milliseconds: its
//! scheduler then hands each tick, with its nominal fire time, that much later to the
//! layers, which is what a clock behind changes for a cron scheduler (its own time is not
//! otherwise read in the run). On SIGTERM it lets the tick in flight end, gives the role
//! up ([`LeaderLayer::resign`]) and exits, as an instance of a rolling deploy does.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use apalis_core::task::Task;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_cron::{CronScheduler, Tick};
use distlock::tower::{LeaderLayer, Locked, TickLayer};
use distlock::{Election, LockKey, Locker};
use tokio::signal::unix::{SignalKind, signal};
use tower_layer::Layer;
use tower_service::Service;

use super::ticks::Ticks;
use crate::BoxError;
use crate::worker::Failed;

/// The leadership's TTL: a stopped leader's role moves within it.
pub const TTL: Duration = Duration::from_secs(2);
/// Every second, in the `cron` crate's six-field syntax.
const EVERY_SECOND: &str = "* * * * * *";
/// The environment variable with the milliseconds this instance's clock is behind (0 when
/// unset).
pub const CLOCK_OFFSET_ENV: &str = "JOB_QUEUE_CRON_CLOCK_BEHIND_MS";
/// What an instance prints on its standard output once it campaigns and its scheduler runs.
pub const READY: &str = "cron instance ready";

/// Where an instance runs.
#[derive(Clone, Debug)]
pub struct InstanceArgs {
    /// The Redis the election runs on.
    pub redis: String,
    /// The PostgreSQL of the tick table.
    pub postgres: String,
    /// The run id: names the role and the rows.
    pub run: String,
    /// The instance's name, unique in the run.
    pub name: String,
}

/// Runs the instance until its process is stopped.
pub async fn run(args: InstanceArgs) -> Result<(), BoxError> {
    let behind = match std::env::var(CLOCK_OFFSET_ENV) {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::ZERO,
    };
    let mut terminate = signal(SignalKind::terminate())?;
    let ticks = Ticks::open(&args.postgres, &args.run).await?;
    let locker = Locker::builder(distlock::connect(&args.redis).await?)
        .ttl(TTL)
        .build()?;
    let election = Election::builder(locker.clone(), "cron-example")
        .key(LockKey::new(format!("cron-example:{}", args.run))?)
        .build()?;
    let leader = LeaderLayer::new(election)?;
    let once = TickLayer::builder(&leader, locker, "every-second", |task: &Task<Tick>| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(task.args.get_timestamp())
    })
    .build()?;
    let schedule = cron::Schedule::from_str(EVERY_SECOND)?;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let service = Behind {
        by: behind,
        stopping,
        inner: once.layer(RunTick {
            ticks,
            instance: args.name.clone().into(),
        }),
    };
    let worker = WorkerBuilder::new(args.name.as_str())
        .backend(CronScheduler::new(schedule))
        .build(service);
    println!("{READY}");
    // On SIGTERM the worker stops taking ticks and lets the one in flight end (one this
    // instance's clock has not reached yet is dropped); then the role is given up, and a
    // standby leads at once.
    worker
        .run_until(async move {
            terminate.recv().await;
            stop.send_replace(true);
            Ok::<(), std::io::Error>(())
        })
        .await?;
    leader.resign().await;
    Ok(())
}

/// Hands each tick to `inner` `by` late: an instance whose clock is behind by that much.
/// A tick still waiting when the instance stops has not fired by this clock: it answers
/// `None` without `inner`.
#[derive(Clone)]
struct Behind<S> {
    by: Duration,
    stopping: tokio::sync::watch::Receiver<bool>,
    inner: S,
}

impl<S, R> Service<R> for Behind<S>
where
    S: Service<R> + Clone + Send + 'static,
    S::Future: Send,
    R: Send + 'static,
{
    type Response = Option<S::Response>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let by = self.by;
        let mut stopping = self.stopping.clone();
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            if !by.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(by) => {}
                    _ = stopping.wait_for(|stopping| *stopping) => return Ok(None),
                }
            }
            // Asked again after the wait: the layers decide at the moment this clock fires.
            std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
            inner.call(request).await.map(Some)
        })
    }
}

/// The scheduled job: write the tick, fenced by the leadership's token.
#[derive(Clone)]
struct RunTick {
    ticks: Ticks,
    instance: Arc<str>,
}

impl Service<Locked<Task<Tick>>> for RunTick {
    type Response = bool;
    type Error = Failed;
    type Future = Pin<Box<dyn Future<Output = Result<bool, Failed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, locked: Locked<Task<Tick>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tick = i64::try_from(locked.request.args.get_timestamp())
                .map_err(|e| Failed::from(BoxError::from(e)))?;
            Ok(this.ticks.write(tick, &this.instance, locked.token).await?)
        })
    }
}
