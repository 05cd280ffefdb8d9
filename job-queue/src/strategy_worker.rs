//! One worker process for the unique-job strategies under process faults: reports on
//! either apalis storage, each run under the producer's claim until executed
//! ([`Until::Executed`]), the locks on the storage's own server.
//!
//! The process says what its runs do on stdout, a line each, for the test that pauses
//! and kills it: `started <id> <token>` when a run begins; `probed <id> refused|claimed`
//! once it has tried, as a producer would, to claim the report's key for a duplicate;
//! `finished <id> <token>` when it has done its work; and `dropped <id> <token>` when a run
//! is stopped before its end (the layer dropped it on a lost lease, or the worker stopped).

use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::apalis::{ApalisLockLayer, JobLease};
use distlock::tower::Until;
use distlock::{Claim, LockError, LockKey, Locker};
use serde::{Deserialize, Serialize};

use crate::BoxError;
use crate::storage::{Queue, Storage};

/// The queue's name.
pub const QUEUE: &str = "reports";
/// The default lock TTL: short, so a paused worker's lease ends soon.
pub const TTL: Duration = Duration::from_secs(1);

/// A report to build, with the claim its producer took.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The report; its key is [`key`] of it.
    pub id: u32,
    /// The producer's claim on the report's key.
    pub claim: Option<Claim>,
    /// How long building it takes.
    pub work_ms: u64,
}

/// The lock key of report `id`.
pub fn key(id: u32) -> Result<LockKey, LockError> {
    LockKey::new(format!("report:{id}"))
}

/// Runs a worker named `name` on the queue of `storage` at `url`, with leases of `ttl`,
/// until the process is stopped. A worker the queue has given up on (a paused process that missed its
/// heartbeats) stops with an error; it is started again, as apalis's monitor would.
pub async fn run(storage: Storage, url: &str, name: &str, ttl: Duration) -> Result<(), BoxError> {
    let queue = Queue::<Report>::open(storage, url, QUEUE).await?;
    let locker = Locker::builder(distlock::connect(url).await?)
        .ttl(ttl)
        .build()?;
    let lock = ApalisLockLayer::new(locker.clone(), |report: &Report| key(report.id))
        .claimed(|report: &Report| report.claim.clone(), Until::Executed);
    let build = move |report: Report, lease: JobLease| build(locker.clone(), report, lease);
    loop {
        let _ = queue.work(name, 2, lock.clone(), build.clone()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The handler: builds the report, saying so on stdout.
async fn build(producer: Locker, report: Report, lease: JobLease) -> Result<(), BoxDynError> {
    let mut run = Run {
        id: report.id,
        token: lease.token().get(),
        finished: false,
    };
    println!("started {} {}", run.id, run.token);
    let duplicate = producer
        .claim(&key(report.id)?, Duration::from_secs(60))
        .await?;
    match duplicate {
        None => println!("probed {} refused", run.id),
        Some(claim) => {
            println!("probed {} claimed", run.id);
            if let Some(guard) = producer.resume(&claim).await? {
                guard.release().await?;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(report.work_ms)).await;
    println!("finished {} {}", run.id, run.token);
    run.finished = true;
    Ok(())
}

/// A run in progress; says `dropped` if it ends before its work is done.
struct Run {
    id: u32,
    token: u64,
    finished: bool,
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.finished {
            println!("dropped {} {}", self.id, self.token);
        }
    }
}
