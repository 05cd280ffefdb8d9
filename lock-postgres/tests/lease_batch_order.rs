//! Lease-table batches lock their rows in one order, whatever order the caller lists the
//! leases in: two batches over the same rows, listed in opposite orders, never deadlock.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{acquire_all, builder, shared_server};
use distlock_core::{Lease, LockBackend, LockKey, Renewal};

const TTL: Duration = Duration::from_secs(60);
const KEYS: usize = 300;
const ROUNDS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_batches_in_opposite_orders_never_deadlock() {
    let server = shared_server().await;
    let backend = Arc::new(builder(&server).build_lease_backend().unwrap());
    let keys: Vec<LockKey> = (0..KEYS)
        .map(|i| LockKey::new(format!("order:{i:04}")).unwrap())
        .collect();
    let leases = acquire_all(&*backend, &keys, TTL).await;
    let reversed: Vec<Lease> = leases.iter().rev().cloned().collect();
    for round in 0..ROUNDS {
        let (a, b) = tokio::join!(backend.renew_many(&leases), backend.renew_many(&reversed));
        for renewed in [a, b] {
            let renewed = renewed.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
        }
    }
    // Releases: whichever batch reaches a row first releases it, the other then finds
    // it released; every row is locked by both.
    let (a, b) = tokio::join!(
        backend.release_many(&leases),
        backend.release_many(&reversed)
    );
    let a = a.expect("no deadlock");
    let b = b.expect("no deadlock");
    let released = a
        .iter()
        .chain(&b)
        .filter(|r| **r == distlock_core::Release::Released)
        .count();
    assert_eq!(released, KEYS);
}
