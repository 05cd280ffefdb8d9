//! The conflict action "skip" on apalis's Redis and PostgreSQL storages, in process: under
//! `OnMiss::Skip`, a duplicate of a report delivered while the report runs is dropped as
//! done (the storage records it done, it is never run, nor retried once the first run
//! has ended), while a report of another key delivered meanwhile runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::LockKey;
use distlock::apalis::{ApalisLockLayer, JobLease};
use distlock::tower::OnMiss;
use job_queue::on_each_storage;
use job_queue::storage::{Server, Storage};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::time::Instant;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Report {
    id: u32,
}

async fn until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < within, "{what}: not after {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

on_each_storage!(skip_drops_a_duplicate_as_done_and_runs_another_key);

async fn skip_drops_a_duplicate_as_done_and_runs_another_key(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>("skip").await.unwrap();
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();
    // Runs started per report; report 1's runs wait for the gate.
    let started: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    let gate = Arc::new(Semaphore::new(0));
    let (seen, waiting) = (started.clone(), gate.clone());
    let handler = move |report: Report, _: JobLease| {
        let (seen, waiting) = (seen.clone(), waiting.clone());
        async move {
            *seen.lock().unwrap().entry(report.id).or_default() += 1;
            if report.id == 1 {
                let _pass = waiting.acquire().await?;
            }
            Ok::<_, BoxDynError>(())
        }
    };
    let lock = ApalisLockLayer::new(locker, |report: &Report| {
        LockKey::new(format!("report:{}", report.id))
    })
    .on_miss(OnMiss::Skip);
    let running = queue.work("skip", 4, lock, handler);
    let runs = |id: u32| started.lock().unwrap().get(&id).copied().unwrap_or(0);

    queue.push(Report { id: 1 }).await.unwrap();
    until("report 1 started", Duration::from_secs(10), async || {
        runs(1) == 1
    })
    .await;
    // While report 1 runs: its duplicate is dropped as done, report 2 runs and is done.
    queue.push(Report { id: 1 }).await.unwrap();
    queue.push(Report { id: 2 }).await.unwrap();
    until(
        "the duplicate dropped as done, report 2 done",
        Duration::from_secs(20),
        async || queue.done(&server).await.unwrap() == 2,
    )
    .await;
    assert_eq!(runs(2), 1, "{storage}: report 2 did not run once");
    // Report 1's run ends: nothing of it is left to run again.
    gate.add_permits(10);
    until("report 1 done", Duration::from_secs(10), async || {
        queue.done(&server).await.unwrap() == 3
    })
    .await;
    running.abort();
    assert_eq!(runs(1), 1, "{storage}: the duplicate of report 1 ran");
    assert_eq!(
        queue.dead(&server).await.unwrap(),
        0,
        "{storage}: a report was killed"
    );
}
