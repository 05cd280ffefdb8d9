//! A throttle on apalis's Redis and PostgreSQL storages, in process: under
//! `until_expired` with `dead_letter_after(1)`, a report runs at most once per lock TTL; a
//! duplicate pushed within the TTL is dropped (killed by the storage, never run), a
//! report of another key is not stopped, and the same report pushed once the TTL has
//! passed runs again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::LockKey;
use distlock::apalis::{ApalisLockLayer, JobLease};
use job_queue::on_each_storage;
use job_queue::storage::{Server, Storage};
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

on_each_storage!(until_expired_runs_a_report_once_per_ttl_and_drops_the_duplicates_between);

async fn until_expired_runs_a_report_once_per_ttl_and_drops_the_duplicates_between(
    storage: Storage,
) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>("throttle").await.unwrap();
    let locker = server.locker(WINDOW).await.unwrap();
    let runs: Arc<Mutex<Vec<(u32, Instant)>>> = Arc::default();
    let seen = runs.clone();
    let handler = move |report: Report, _: JobLease| {
        seen.lock().unwrap().push((report.id, Instant::now()));
        async { Ok::<_, BoxDynError>(()) }
    };
    let lock = ApalisLockLayer::new(locker, |report: &Report| {
        LockKey::new(format!("report:{}", report.id))
    })
    .until_expired()
    .unwrap()
    .dead_letter_after(1);
    let running = queue.work("throttle", 2, lock, handler);
    let count = |id: u32| runs.lock().unwrap().iter().filter(|r| r.0 == id).count();

    queue.push(Report { id: 1 }).await.unwrap();
    until("report 1 ran", Duration::from_secs(10), async || {
        count(1) == 1
    })
    .await;
    // Within the window: the duplicate is dropped, another report runs.
    queue.push(Report { id: 1 }).await.unwrap();
    queue.push(Report { id: 2 }).await.unwrap();
    until(
        "the duplicate dropped",
        Duration::from_secs(10),
        async || queue.dead(&server).await.unwrap() == 1,
    )
    .await;
    until("report 2 ran", Duration::from_secs(10), async || {
        count(2) == 1
    })
    .await;
    assert_eq!(
        count(1),
        1,
        "{storage}: the duplicate ran within the window"
    );
    // After the window the same report runs again.
    let first = runs.lock().unwrap()[0].1;
    tokio::time::sleep_until(first + WINDOW + Duration::from_millis(200)).await;
    queue.push(Report { id: 1 }).await.unwrap();
    until("report 1 ran again", Duration::from_secs(10), async || {
        count(1) == 2
    })
    .await;
    running.abort();
}
