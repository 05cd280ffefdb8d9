//! One scheduler instance: apalis-cron fires every second in every instance; the
//! [`LeaderLayer`] runs the tick only where this process leads the role.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::task::Task;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_cron::{CronScheduler, Tick};
use distlock::tower::{LeaderLayer, Locked};
use distlock::{Election, LockKey, Locker};
use tower_layer::Layer;
use tower_service::Service;

use super::ticks::Ticks;
use crate::BoxError;
use crate::worker::Failed;

/// The leadership's TTL: a stopped leader's role moves within it.
pub const TTL: Duration = Duration::from_secs(2);
/// Every second, in the `cron` crate's six-field syntax.
const EVERY_SECOND: &str = "* * * * * *";

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
    let ticks = Ticks::open(&args.postgres, &args.run).await?;
    let locker = Locker::builder(distlock::connect(&args.redis).await?)
        .ttl(TTL)
        .build()?;
    let election = Election::builder(locker, "cron-example")
        .key(LockKey::new(format!("cron-example:{}", args.run))?)
        .build()?;
    let leader = LeaderLayer::new(election)?;
    let schedule = cron::Schedule::from_str(EVERY_SECOND)?;
    let service = leader.layer(RunTick {
        ticks,
        instance: args.name.clone().into(),
    });
    WorkerBuilder::new(args.name.as_str())
        .backend(CronScheduler::new(schedule))
        .build(service)
        .run()
        .await?;
    Ok(())
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
