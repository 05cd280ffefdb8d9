//! `distlock::apalis` on apalis's Redis and PostgreSQL storages, in process: a job whose
//! lease is lost while it runs is stopped, and apalis runs it again, as a failed attempt.
//! The layer stops the job by dropping it inside apalis's lifecycle layer, which had
//! marked the task running; the layer must mark it failed, or the storage acknowledges
//! a running task (apalis-redis: into its dead set; apalis-postgres: never fetched again)
//! and the job is never done.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::apalis::{ApalisLockLayer, JobLease};
use distlock::backend::Layered;
use distlock::memory::Faults;
use distlock::{LockKey, Locker};
use job_queue::storage::{Server, Storage};
use job_queue::{Payout, on_each_storage};
use tokio::time::Instant;

on_each_storage!(a_job_whose_lease_is_lost_while_it_runs_is_run_again);

/// Counts when it is dropped: the job's run was stopped.
struct Stopped(Arc<AtomicU32>);

impl Drop for Stopped {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

async fn a_job_whose_lease_is_lost_while_it_runs_is_run_again(storage: Storage) {
    const TTL: Duration = Duration::from_secs(1);
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Payout>("lost-lease").await.unwrap();
    // The worker's locks go through a fault layer: while it is partitioned, renewals fail
    // and the lease runs out.
    let faults = Arc::new(Faults::default());
    let store = distlock::connect(&server.url()).await.unwrap();
    let locker = Locker::builder(Arc::new(Layered::new(store, faults.clone())))
        .ttl(TTL)
        .build()
        .unwrap();
    let key = |job: &Payout| LockKey::new(format!("payout:{}", job.id));
    queue.push(Payout { id: 1, work_ms: 0 }).await.unwrap();

    let (runs, stopped, finished) = (
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let handler = {
        let (runs, stopped, finished, faults) = (
            runs.clone(),
            stopped.clone(),
            finished.clone(),
            faults.clone(),
        );
        move |_: Payout, _: JobLease| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let (stopped, finished, faults) = (stopped.clone(), finished.clone(), faults.clone());
            async move {
                let _stopped = Stopped(stopped);
                if run == 1 {
                    // The store stops answering this worker: its lease is lost, and the
                    // layer stops the job long before this sleep ends.
                    faults.partition();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                finished.fetch_add(1, Ordering::SeqCst);
                Ok::<_, BoxDynError>(())
            }
        }
    };
    let lock = ApalisLockLayer::new(locker, key);
    let worker = queue.work("lost-lease", 2, lock, handler);

    // Hang guards, not speed bounds: the lease is lost within its TTL of the partition,
    // and a failed attempt is fetched again within seconds (apalis-redis schedules it
    // its attempt count in seconds later; apalis-postgres at its next fetch).
    let started = Instant::now();
    while stopped.load(Ordering::SeqCst) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{storage}: the job was not stopped after its lease was lost"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "{storage}: the first run went on"
    );
    faults.heal();
    let stopped_at = Instant::now();
    loop {
        let (done, dead) = (
            queue.done(&server).await.unwrap(),
            queue.dead(&server).await.unwrap(),
        );
        assert_eq!(
            dead, 0,
            "{storage}: the job was killed after its lease was lost"
        );
        if done == 1 {
            break;
        }
        if stopped_at.elapsed() >= Duration::from_secs(30) {
            let state = (queue.state(&server).await)
                .unwrap_or_else(|e| format!("(the queue's state unreadable: {e})"));
            panic!(
                "{storage}: the job stopped for its lost lease was not run again in {:?} \
                 ({} runs, {} ended, {} finished)\n{state}",
                stopped_at.elapsed(),
                runs.load(Ordering::SeqCst),
                stopped.load(Ordering::SeqCst),
                finished.load(Ordering::SeqCst)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.abort();
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{storage}: run once more");
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "{storage}: finished once"
    );
}
