//! distlock inside a real job queue: payout workers on [apalis] with its Redis storage,
//! each job under [`distlock::tower::LockLayer`], its payout made by a provider (a
//! PostgreSQL ledger) that checks the lease's fencing token and an idempotency key.
//!
//! [`scenario::run`] pushes the payouts, starts worker processes, and makes what goes
//! wrong in production happen once each: a worker paused past its lease just before its
//! payout call (its jobs redelivered to others, then the paused call goes out), a worker
//! killed after a payout but before the queue heard of it (the job redelivered), and
//! payouts enqueued twice (two schedulers fire the same job). It then counts the
//! payouts from the ledger. The `job-queue` binary runs it with and without the layer.
//!
//! [apalis]: https://docs.rs/apalis

use std::error::Error;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod cron;
pub mod heartbeat;
pub mod ledger;
pub mod queue_state;
pub mod scenario;
pub mod storage;
pub mod strategy_worker;
pub mod worker;

/// Any error of the example, boxed: every error ends the run.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// A payout job: which payout, and how long the work before its call takes.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Payout {
    /// The payout, `1..=jobs`.
    pub id: i64,
    /// Milliseconds of work before the payout call.
    pub work_ms: u64,
}

/// The apalis queue of run `run`: heartbeats every second, and a worker that missed two
/// is taken for dead, its jobs redelivered to the others.
pub fn queue_config(run: &str) -> apalis_redis::Config {
    apalis_redis::Config::default()
        .queue(format!("payouts-{run}"))
        .heartbeat_interval(Duration::from_secs(1))
        .missed_heartbeats(2)
        .batch_size(2)
}

/// A process of run `run`: `exe subcommand --redis … --postgres … --run … --name …`, its
/// stdin closed, killed when its handle is dropped.
fn child(
    exe: &Path,
    subcommand: &str,
    (redis, postgres, run): (&str, &str, &str),
    name: &str,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(exe);
    command
        .arg(subcommand)
        .args([
            "--redis",
            redis,
            "--postgres",
            postgres,
            "--run",
            run,
            "--name",
            name,
        ])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

/// The schema of distlock's tables (fencing tokens, idempotency keys).
const SCHEMA: &str = "distlock";

/// A pool of `size` connections to the PostgreSQL at `url`, with a fenced resource in
/// enforce mode over it; distlock's tables (fencing tokens, idempotency keys) created if
/// they do not exist.
async fn open_fenced(
    url: &str,
    size: u32,
) -> Result<(sqlx::PgPool, distlock::postgres::PgFencedResource), BoxError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect(url)
        .await?;
    let fenced = distlock::postgres::PgFencedResource::new(
        pool.clone(),
        SCHEMA,
        distlock::EnforcementMode::Enforce,
    )?;
    fenced.setup().await?;
    Ok((pool, fenced))
}
