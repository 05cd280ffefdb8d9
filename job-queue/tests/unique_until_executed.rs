//! Unique from enqueue on apalis's Redis and PostgreSQL storages, in process: the producer claims each
//! job's key before it pushes the job, so a duplicate pushed while the first waits or
//! runs is refused at the door, and the worker runs the job under the claim
//! (`Until::Executed`), releasing it when the job ends; a job of another key, and the same
//! job pushed again once the first is done, are not stopped.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::apalis::{ApalisLockLayer, JobLease};
use distlock::tower::{Until, run_key};
use distlock::{Claim, LockError, LockKey, Locker};
use job_queue::on_each_storage;
use job_queue::storage::{Queue, Server, Storage};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A report to build, carrying the claim its producer took.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Report {
    id: u32,
    claim: Option<Claim>,
}

fn key(id: u32) -> Result<LockKey, LockError> {
    LockKey::new(format!("report:{id}"))
}

/// What a producer does: claims the report's key for as long as it may wait and run,
/// and pushes it only when the claim was taken.
async fn enqueue(locker: &Locker, queue: &mut Queue<Report>, id: u32) -> bool {
    let claim = locker
        .claim(&key(id).unwrap(), Duration::from_secs(60))
        .await
        .unwrap();
    let Some(claim) = claim else {
        return false;
    };
    queue
        .push(Report {
            id,
            claim: Some(claim),
        })
        .await
        .unwrap();
    true
}

on_each_storage!(until_executed_refuses_duplicates_from_enqueue_to_the_end_of_the_run);

async fn until_executed_refuses_duplicates_from_enqueue_to_the_end_of_the_run(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>("unique").await.unwrap();
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();

    // Pushed before any worker runs: the duplicate waits nowhere, it is never pushed.
    assert!(enqueue(&locker, &mut queue, 1).await);
    assert!(
        !enqueue(&locker, &mut queue, 1).await,
        "a duplicate was pushed"
    );
    assert!(
        enqueue(&locker, &mut queue, 2).await,
        "another report was refused"
    );

    // Each run records its report, its token, whether a duplicate could be pushed while
    // it ran, and whether its claim held the job's key.
    type Run = (u32, u64, bool, bool);
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let (seen, probe) = (runs.clone(), locker.clone());
    let handler = move |report: Report, lease: JobLease| {
        let (seen, probe) = (seen.clone(), probe.clone());
        async move {
            // The producer's claim, resumed, is what holds the job's key: not the key
            // taken afresh, as by a run whose claim had lapsed.
            let held = probe.backend().inspect(&key(report.id)?).await?;
            let under_claim = held.token == report.claim.as_ref().map(Claim::token);
            let duplicate = probe
                .claim(&key(report.id)?, Duration::from_secs(60))
                .await?
                .is_some();
            // Fenced by its run: on the run key, under that key's token.
            assert_eq!(
                lease.key().as_str(),
                run_key(&key(report.id)?)?.as_str(),
                "fenced on another key than its run key"
            );
            seen.lock()
                .unwrap()
                .push((report.id, lease.token().0, duplicate, under_claim));
            Ok::<_, BoxDynError>(())
        }
    };
    let lock = ApalisLockLayer::new(locker.clone(), |report: &Report| key(report.id))
        .claimed(|report: &Report| report.claim.clone(), Until::Executed);
    let running = queue.work("unique", 2, lock, handler);

    let until_runs = |n: usize| {
        let runs = runs.clone();
        async move {
            let started = Instant::now();
            while runs.lock().unwrap().len() < n {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "{:?} after 30 s",
                    runs.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    until_runs(2).await;
    // Done: the key is free again, and the same report is pushed and run once more.
    let pushed_again = Instant::now();
    while !enqueue(&locker, &mut queue, 1).await {
        assert!(
            pushed_again.elapsed() < Duration::from_secs(10),
            "report 1's key was not released when its run ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until_runs(3).await;
    running.abort();
    let runs = runs.lock().unwrap().clone();
    let ids: Vec<u32> = runs.iter().map(|r| r.0).collect();
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 2, "{runs:?}");
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1, "{runs:?}");
    assert!(
        runs.iter().all(|r| !r.2),
        "a duplicate was claimed while a run held the key: {runs:?}"
    );
    assert!(
        runs.iter().all(|r| r.3),
        "a run held the job's key under another lease than its producer's claim: {runs:?}"
    );
}
