//! Each call is one round trip to the server once its statement is prepared on the
//! connection: no ping before the statement. Counted over a link with a known delay: a
//! round trip takes at least twice the one-way delay, so a call that took two would take
//! at least four.

mod common;

use std::time::Duration;

use std::sync::Arc;

use common::{Kind, builder_at, shared_server};
use distlock_core::{LockBackend, LockKey, Release};
use harness::postgres::{PASSWORD, USER};
use harness::proxy::FaultProxy;
use tokio::time::Instant;

const ONE_WAY: Duration = Duration::from_millis(150);
const TTL: Duration = Duration::from_secs(30);

/// The longest a one-round-trip call may take: one round trip and half of another, for a
/// busy machine.
const ONE_ROUND_TRIP: Duration = Duration::from_millis(150 * 3);

/// Waits until a connection given back to the pool is idle again: the pool pings every
/// connection given back (one round trip, after the call has returned) before another
/// call can take it.
async fn settle() {
    tokio::time::sleep(ONE_WAY * 4).await;
}

async fn one_round_trip_each(kind: Kind, name: &str) {
    let server = shared_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let url = format!("postgres://{USER}:{PASSWORD}@{}/postgres", proxy.addr());
    // Connected (every pooled connection open) before the delay starts. One lock slot,
    // so few connections to warm up.
    let backend: Arc<dyn LockBackend> = match kind {
        Kind::Lease => {
            let b = builder_at(&url).pool_size(1).build_lease_backend().unwrap();
            b.connect().await.unwrap();
            Arc::new(b)
        }
        Kind::Advisory => {
            let b = builder_at(&url)
                .pool_size(1)
                .build_advisory_backend()
                .unwrap();
            b.connect().await.unwrap();
            Arc::new(b)
        }
    };
    let k = LockKey::new(name).unwrap();
    // Each statement is prepared on a connection at its first use there (a round trip
    // of its own); cycles enough for every pooled connection to have prepared them.
    for _ in 0..6 {
        let lease = backend.acquire(&k, TTL).await.unwrap().expect("free");
        backend.renew(&lease).await.unwrap();
        backend.release(&lease).await.unwrap();
    }
    // The connections given back by those cycles are pinged on the link without delay;
    // then the delay starts and the acquire goes at once. The pool pings a connection
    // idle for over a second before a call uses it (a second round trip): a settle on
    // the delayed link here left them idle 600 ms before the acquire, and a loaded
    // machine the rest (the advisory acquire once took 616 ms, two round trips).
    tokio::time::sleep(ONE_WAY).await;
    proxy.delay(ONE_WAY);

    let started = Instant::now();
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free");
    let acquire = started.elapsed();
    settle().await;
    let started = Instant::now();
    assert!(matches!(
        backend.renew(&lease).await.unwrap(),
        distlock_core::Renewal::Renewed { .. }
    ));
    let renew = started.elapsed();
    settle().await;
    let started = Instant::now();
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
    let release = started.elapsed();
    proxy.heal();
    for (call, took) in [("acquire", acquire), ("renew", renew), ("release", release)] {
        assert!(
            took >= ONE_WAY * 2 && took < ONE_ROUND_TRIP,
            "{call} took {took:?}: not one round trip of {:?}",
            ONE_WAY * 2
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_acquire_renew_and_release_are_one_round_trip_each() {
    one_round_trip_each(Kind::Lease, "round-trips:lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_acquire_renew_and_release_are_one_round_trip_each() {
    one_round_trip_each(Kind::Advisory, "round-trips:advisory").await;
}

/// The lease table takes a permit behind held slots in one statement: one round trip
/// however many of the slots before the free one are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_acquire_any_is_one_round_trip_behind_held_slots() {
    let server = shared_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let url = format!("postgres://{USER}:{PASSWORD}@{}/postgres", proxy.addr());
    let backend = builder_at(&url).pool_size(1).build_lease_backend().unwrap();
    backend.connect().await.unwrap();
    let slots: Vec<LockKey> = (0..8)
        .map(|i| LockKey::new(format!("round-trips:any:permit:{i}")).unwrap())
        .collect();
    // Prepared on the pooled connection before the delay starts.
    for _ in 0..3 {
        let lease = backend
            .acquire_any(&slots, TTL)
            .await
            .unwrap()
            .expect("free");
        backend.release(&lease).await.unwrap();
    }
    let held: Vec<_> = backend
        .acquire_many(&slots[..7], TTL)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.expect("free"))
        .collect();
    proxy.delay(ONE_WAY);
    settle().await;
    let started = Instant::now();
    let lease = backend
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("slot 7 is free");
    let took = started.elapsed();
    settle().await;
    let started = Instant::now();
    assert!(backend.acquire_any(&slots, TTL).await.unwrap().is_none());
    let refused = started.elapsed();
    proxy.heal();
    assert_eq!(lease.key(), &slots[7]);
    for (call, took) in [
        ("a permit behind seven held slots", took),
        ("a full semaphore's refusal", refused),
    ] {
        assert!(
            took >= ONE_WAY * 2 && took < ONE_ROUND_TRIP,
            "{call} took {took:?}: not one round trip of {:?}",
            ONE_WAY * 2
        );
    }
    backend.release_many(&held).await.unwrap();
    backend.release(&lease).await.unwrap();
}
