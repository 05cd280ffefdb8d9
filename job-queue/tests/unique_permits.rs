//! Per-key concurrency on apalis's Redis and PostgreSQL storages, in process: under `permits(2)` at most
//! two exports of one tenant run at once, though the worker runs four jobs at a time; the
//! third is sent back and runs once a permit is free, and another tenant's export is not
//! held back by the first tenant's permits.

use std::collections::HashMap;
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
struct Export {
    tenant: u32,
    part: u32,
}

/// Per tenant: exports running now, the most at once, and exports done.
type Seen = Arc<Mutex<HashMap<u32, (u32, u32, u32)>>>;

on_each_storage!(permits_run_at_most_n_jobs_of_a_key_at_once_and_the_rest_later);

async fn permits_run_at_most_n_jobs_of_a_key_at_once_and_the_rest_later(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Export>("permits").await.unwrap();
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();
    let seen: Seen = Arc::default();
    let counted = seen.clone();
    let handler = move |export: Export, _: JobLease| {
        let counted = counted.clone();
        async move {
            {
                let mut seen = counted.lock().unwrap();
                let entry = seen.entry(export.tenant).or_default();
                entry.0 += 1;
                entry.1 = entry.1.max(entry.0);
            }
            // Long enough that the worker takes the tenant's other exports meanwhile.
            tokio::time::sleep(Duration::from_millis(600)).await;
            let mut seen = counted.lock().unwrap();
            let entry = seen.entry(export.tenant).or_default();
            entry.0 -= 1;
            entry.2 += 1;
            Ok::<_, BoxDynError>(())
        }
    };
    let lock = ApalisLockLayer::new(locker, |export: &Export| {
        LockKey::new(format!("exports:tenant-{}", export.tenant))
    })
    .permits(2)
    .unwrap();
    let running = queue.work("exports", 4, lock, handler);
    for part in 0..3 {
        queue.push(Export { tenant: 1, part }).await.unwrap();
    }
    queue.push(Export { tenant: 2, part: 0 }).await.unwrap();

    let started = Instant::now();
    loop {
        let done = {
            let seen = seen.lock().unwrap();
            (seen.get(&1).map(|e| e.2), seen.get(&2).map(|e| e.2))
        };
        if done == (Some(3), Some(1)) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{storage}: not every export ran in 30 s: {:?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.abort();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen[&1].1, 2,
        "{storage}: tenant 1's exports at once: {seen:?}"
    );
}
