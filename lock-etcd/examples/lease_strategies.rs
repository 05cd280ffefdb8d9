//! Measures the two ways to attach etcd locks to leases on a real etcd started by the
//! test harness, and prints acquire+release cycles per second for each:
//!
//! - **per-lock lease** (what `EtcdBackend` does): grant a lease, put-if-absent on it,
//!   then owner-checked delete and revoke;
//! - **shared lease** (etcd's session pattern): one lease granted up front and kept alive
//!   by a background loop; a cycle is put-if-absent on it plus owner-checked delete.
//!
//! The shared lease saves round trips but breaks bounded ownership per lock (see the
//! `backend` module docs), so it is measured here, not shipped.
//!
//! Run with `cargo run --release -p lock-etcd --example lease_strategies`.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockBackend, LockKey};
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use harness::etcd::EtcdServer;
use harness::require;
use lock_etcd::EtcdBackend;
use tokio::time::Instant;

const SEQUENTIAL_CYCLES: usize = 300;
const TASKS: usize = 32;
const CYCLES_PER_TASK: usize = 50;
const TTL: Duration = Duration::from_secs(10);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = require(EtcdServer::start().await);
    let backend = Arc::new(
        EtcdBackend::builder()
            .endpoint(server.endpoint())
            .build()
            .await
            .expect("connect"),
    );
    let client = Client::connect([server.endpoint()], None)
        .await
        .expect("connect");
    let shared = client
        .lease_client()
        .grant(TTL.as_secs() as i64, None)
        .await
        .expect("grant")
        .id();
    let (mut keeper, mut replies) = client
        .lease_client()
        .keep_alive(shared)
        .await
        .expect("keep alive");
    let keep_alive = tokio::spawn(async move {
        loop {
            tokio::time::sleep(TTL / 3).await;
            if keeper.keep_alive().await.is_err() || replies.message().await.is_err() {
                break;
            }
        }
    });

    for round in 0..2 {
        let b = backend.clone();
        let per_lock = run(SEQUENTIAL_CYCLES, 1, move |task, i| {
            let backend = b.clone();
            async move { per_lock_cycle(&backend, task, i).await }
        })
        .await;
        let c = client.clone();
        let shared_seq = run(SEQUENTIAL_CYCLES, 1, move |task, i| {
            let client = c.clone();
            async move { shared_cycle(&client, shared, task, i).await }
        })
        .await;
        let b = backend.clone();
        let per_lock_conc = run(CYCLES_PER_TASK, TASKS, move |task, i| {
            let backend = b.clone();
            async move { per_lock_cycle(&backend, task, i).await }
        })
        .await;
        let c = client.clone();
        let shared_conc = run(CYCLES_PER_TASK, TASKS, move |task, i| {
            let client = c.clone();
            async move { shared_cycle(&client, shared, task, i).await }
        })
        .await;
        println!("round {round}:");
        println!(
            "  per-lock lease: {per_lock:>7.0} cycles/s one at a time, {per_lock_conc:>7.0} cycles/s at {TASKS} tasks"
        );
        println!(
            "  shared lease:   {shared_seq:>7.0} cycles/s one at a time, {shared_conc:>7.0} cycles/s at {TASKS} tasks"
        );
    }
    keep_alive.abort();
}

/// Runs `cycles` cycles in each of `tasks` tasks and returns cycles per second.
async fn run<F, Fut>(cycles: usize, tasks: usize, cycle: F) -> f64
where
    F: Fn(usize, usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = ()> + Send,
{
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let cycle = cycle.clone();
            tokio::spawn(async move {
                for i in 0..cycles {
                    cycle(task, i).await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("task");
    }
    (cycles * tasks) as f64 / start.elapsed().as_secs_f64()
}

async fn per_lock_cycle(backend: &EtcdBackend, task: usize, i: usize) {
    let key = LockKey::new(format!("bench:per-lock:{task}:{i}:{}", round_tag())).expect("key");
    let lease = backend
        .acquire(&key, TTL)
        .await
        .expect("acquire")
        .expect("free");
    backend.release(&lease).await.expect("release");
}

async fn shared_cycle(client: &Client, lease: i64, task: usize, i: usize) {
    let key = format!("bench/shared/{task}/{i}/{}", round_tag());
    let owner = format!("{task}-{i}");
    let mut kv = client.kv_client();
    let acquire = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key.clone(),
            owner.clone(),
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(key.clone(), None)]);
    assert!(kv.txn(acquire).await.expect("acquire").succeeded());
    let release = Txn::new()
        .when([Compare::value(key.clone(), CompareOp::Equal, owner)])
        .and_then([TxnOp::delete(key, None)]);
    assert!(kv.txn(release).await.expect("release").succeeded());
}

/// A tag unique to each call, so every cycle uses a fresh key.
fn round_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
