//! The conflict action "replace" on apalis's Redis and PostgreSQL storages, in process:
//! the producer claims each report's queue key with `Locker::claim_replacing`, so a newer
//! report of a key supersedes the one still queued; under
//! `claimed(.., Until::ExecutingOrReplaced)` the superseded report, once delivered, is
//! dropped as done (never run, retried nor killed) and the newer one runs, while a report
//! whose claim ran out in the queue with no newer claim after it still runs, and a
//! superseded report delivered after the newer one has run is dropped too.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::apalis::{ApalisLockLayer, JobLease};
use distlock::tower::{Until, queue_key};
use distlock::{Claim, LockError, LockKey, Locker};
use job_queue::on_each_storage;
use job_queue::storage::{Queue, Server, Storage};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A report to build, in its `version`-th form, carrying the claim its producer took.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Report {
    id: u32,
    version: u32,
    claim: Option<Claim>,
}

fn key(id: u32) -> Result<LockKey, LockError> {
    LockKey::new(format!("report:{id}"))
}

async fn until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < within, "{what}: not after {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a producer does first: claims the report's queue key for `ttl`, replacing the
/// claim of a report of the key still queued.
async fn claim(locker: &Locker, id: u32, version: u32, ttl: Duration) -> Report {
    let queued = queue_key(&key(id).unwrap()).unwrap();
    let claim = locker.claim_replacing(&queued, ttl).await.unwrap();
    assert!(claim.is_some(), "report {id} v{version}: no claim");
    Report { id, version, claim }
}

/// What a producer does: claims the report's queue key, then pushes the report under
/// its claim.
async fn enqueue(locker: &Locker, queue: &mut Queue<Report>, id: u32, version: u32, ttl: Duration) {
    let report = claim(locker, id, version, ttl).await;
    queue.push(report).await.unwrap();
}

/// The layer of the workers: each report under its key, the claim until it starts or is
/// replaced.
fn replaceable(locker: &Locker) -> ApalisLockLayer<Report> {
    ApalisLockLayer::new(locker.clone(), |report: &Report| key(report.id)).claimed(
        |report: &Report| report.claim.clone(),
        Until::ExecutingOrReplaced,
    )
}

/// A handler that records each run as (report, version) in `runs`.
fn recorder(
    runs: &Arc<Mutex<Vec<(u32, u32)>>>,
) -> impl Fn(Report, JobLease) -> std::future::Ready<Result<(), BoxDynError>>
+ Clone
+ Send
+ Sync
+ 'static {
    let seen = runs.clone();
    move |report: Report, _: JobLease| {
        seen.lock().unwrap().push((report.id, report.version));
        std::future::ready(Ok(()))
    }
}

on_each_storage!(replace_drops_the_superseded_report_as_done_and_runs_the_newer);

async fn replace_drops_the_superseded_report_as_done_and_runs_the_newer(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>("replace").await.unwrap();
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();

    // Report 1 is pushed, then a newer form of it: the second replaces the first.
    let ttl = Duration::from_secs(60);
    enqueue(&locker, &mut queue, 1, 1, ttl).await;
    enqueue(&locker, &mut queue, 1, 2, ttl).await;
    // Report 2's claim runs out while it waits, and nothing claims the key after it.
    let short = Duration::from_millis(500);
    enqueue(&locker, &mut queue, 2, 1, short).await;
    let queued = queue_key(&key(2).unwrap()).unwrap();
    until(
        "report 2's claim ran out",
        Duration::from_secs(10),
        async || {
            locker
                .backend()
                .inspect(&queued)
                .await
                .unwrap()
                .owner
                .is_none()
        },
    )
    .await;

    // The runs: (report, version).
    let runs: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let seen = runs.clone();
    let handler = move |report: Report, _: JobLease| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push((report.id, report.version));
            Ok::<_, BoxDynError>(())
        }
    };
    let lock = ApalisLockLayer::new(locker.clone(), |report: &Report| key(report.id)).claimed(
        |report: &Report| report.claim.clone(),
        Until::ExecutingOrReplaced,
    );
    let running = queue.work("replace", 4, lock, handler);
    until(
        "the three reports done",
        Duration::from_secs(20),
        async || queue.done(&server).await.unwrap() == 3,
    )
    .await;
    // Time for a retry or a second delivery, if any were coming (apalis-redis schedules a
    // task sent back a second or more later).
    tokio::time::sleep(Duration::from_secs(3)).await;
    running.abort();
    let mut ran = runs.lock().unwrap().clone();
    ran.sort_unstable();
    assert_eq!(
        ran,
        [(1, 2), (2, 1)],
        "{storage}: the newer report 1 and report 2 should each have run once"
    );
    assert_eq!(queue.done(&server).await.unwrap(), 3, "{storage}");
    assert_eq!(
        queue.dead(&server).await.unwrap(),
        0,
        "{storage}: a report was killed"
    );
}

on_each_storage!(a_superseded_report_delivered_after_the_newer_one_ran_is_dropped);

/// Two producers of one report race: the first claims, the second replaces its claim and
/// pushes first. One worker, one report at a time: the newer report runs (and has started,
/// its claim no longer needed) before the superseded one is delivered, which is dropped
/// all the same. Its claim is left to run out rather than released when it starts: Redis
/// keeps no token of a free key, and a released claim would leave nothing to tell the
/// superseded report by.
async fn a_superseded_report_delivered_after_the_newer_one_ran_is_dropped(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>("replace-late").await.unwrap();
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();
    let ttl = Duration::from_secs(60);
    let superseded = claim(&locker, 1, 1, ttl).await;
    let newer = claim(&locker, 1, 2, ttl).await;
    queue.push(newer).await.unwrap();
    queue.push(superseded).await.unwrap();

    let runs: Arc<Mutex<Vec<(u32, u32)>>> = Arc::default();
    let running = queue.work("replace-late", 1, replaceable(&locker), recorder(&runs));
    until("both reports done", Duration::from_secs(20), async || {
        queue.done(&server).await.unwrap() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    running.abort();
    let ran = runs.lock().unwrap().clone();
    assert_eq!(
        ran,
        [(1, 2)],
        "{storage}: only the newer report should have run"
    );
    assert_eq!(queue.done(&server).await.unwrap(), 2, "{storage}");
    assert_eq!(
        queue.dead(&server).await.unwrap(),
        0,
        "{storage}: a report was killed"
    );
}
