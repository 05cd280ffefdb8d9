//! A throttle on apalis's Redis storage, in process: under `until_expired` with
//! `dead_letter_after(1)`, a report runs at most once per lock TTL; a duplicate pushed
//! within the TTL is dropped (the storage's dead set, never run), a report of another key
//! is not stopped, and the same report pushed once the TTL has passed runs again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::backend::TaskSink;
use apalis_core::error::BoxDynError;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_redis::RedisStorage;
use distlock::apalis::ApalisLockLayer;
use distlock::{LockKey, Locker};
use harness::redis::{RedisServer, RespValue};
use harness::require;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Report {
    id: u32,
}

/// The window: the lock TTL.
const WINDOW: Duration = Duration::from_secs(2);

async fn until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < within, "{what}: not after {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn until_expired_runs_a_report_once_per_ttl_and_drops_the_duplicates_between() {
    let redis = require(RedisServer::start().await);
    let config = job_queue::queue_config("throttle");
    let dead_set = config.dead_jobs_set();
    let conn = apalis_redis::connect(redis.url().as_str()).await.unwrap();
    let mut storage = RedisStorage::<Report>::new(conn).with_config(config);
    let locker = Locker::builder(distlock::connect(&redis.url()).await.unwrap())
        .ttl(WINDOW)
        .build()
        .unwrap();
    let runs: Arc<Mutex<Vec<(u32, Instant)>>> = Arc::default();
    let seen = runs.clone();
    let handler = move |report: Report| {
        seen.lock().unwrap().push((report.id, Instant::now()));
        async { Ok::<_, BoxDynError>(()) }
    };
    let lock = ApalisLockLayer::new(locker, |report: &Report| {
        LockKey::new(format!("report:{}", report.id))
    })
    .until_expired()
    .unwrap()
    .dead_letter_after(1);
    let worker = WorkerBuilder::new("throttle")
        .backend(storage.clone())
        .layer(lock)
        .build(handler);
    let running = tokio::spawn(worker.run());
    let count = |id: u32| runs.lock().unwrap().iter().filter(|r| r.0 == id).count();

    storage.push(Report { id: 1 }).await.unwrap();
    until("report 1 ran", Duration::from_secs(10), async || {
        count(1) == 1
    })
    .await;
    // Within the window: the duplicate is dropped, another report runs.
    storage.push(Report { id: 1 }).await.unwrap();
    storage.push(Report { id: 2 }).await.unwrap();
    let dead = || {
        let redis = &redis;
        let dead_set = dead_set.clone();
        async move { require(redis.command(&["SCARD", &dead_set]).await) }
    };
    until(
        "the duplicate dropped",
        Duration::from_secs(10),
        async || dead().await == RespValue::Integer(1),
    )
    .await;
    until("report 2 ran", Duration::from_secs(10), async || {
        count(2) == 1
    })
    .await;
    assert_eq!(count(1), 1, "the duplicate ran within the window");
    // After the window the same report runs again.
    let first = runs.lock().unwrap()[0].1;
    tokio::time::sleep_until(first + WINDOW + Duration::from_millis(200)).await;
    storage.push(Report { id: 1 }).await.unwrap();
    until("report 1 ran again", Duration::from_secs(10), async || {
        count(1) == 2
    })
    .await;
    running.abort();
}
