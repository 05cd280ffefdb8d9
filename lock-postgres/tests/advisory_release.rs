//! Advisory leases at their end: dropped outside a runtime, released with the caller
//! giving up midway, released over a link that stopped answering.

mod common;

use std::time::Duration;

use common::{Kind, backend, builder, builder_at, start_server};
use distlock_core::{LockBackend, LockKey, Release, Renewal};
use harness::postgres::{PASSWORD, USER};
use harness::proxy::FaultProxy;
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(60);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// A lease taken in `block_on` and dropped after it returned, outside any runtime: no
/// panic, and its session closes, so another client takes the key long before the TTL.
#[test]
fn an_advisory_lease_dropped_outside_a_runtime_frees_its_lock() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(start_server());
    // The pool is made in the runtime (it starts its upkeep task there).
    let holder = rt.block_on(async { builder(&server).build_advisory_backend().unwrap() });
    let k = key("dropped:outside");
    let lease = rt.block_on(holder.acquire(&k, TTL)).unwrap().expect("free");
    drop(lease);
    rt.block_on(async {
        let other = backend(&server, Kind::Advisory).await;
        let started = Instant::now();
        loop {
            if let Some(lease) = other.acquire(&k, TTL).await.unwrap() {
                other.release(&lease).await.unwrap();
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "still held");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// A release dropped after its statement was sent and before its reply came: a clone of
/// the lease must not renew as held once another client has the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_advisory_release_leaves_no_clone_that_renews() {
    const ONE_WAY: Duration = Duration::from_millis(200);
    let server = start_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let url = format!("postgres://{USER}:{PASSWORD}@{}/postgres", proxy.addr());
    let holder = builder_at(&url).build_advisory_backend().unwrap();
    let other = backend(&server, Kind::Advisory).await;
    let k = key("release:cancelled");
    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free");
    let clone = lease.clone();

    proxy.delay(ONE_WAY);
    // Sent at once; the reply is at least two one-way delays away.
    let cancelled = tokio::time::timeout(ONE_WAY * 3 / 2, holder.release(&lease)).await;
    assert!(
        cancelled.is_err(),
        "the release finished: nothing was cancelled"
    );
    proxy.heal();

    let started = Instant::now();
    let taken = loop {
        if let Some(taken) = other.acquire(&k, TTL).await.unwrap() {
            break taken;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let renewed = holder.renew(&clone).await.unwrap();
    assert_eq!(
        renewed,
        Renewal::Lost,
        "renewed while another client holds it"
    );
    other.release(&taken).await.unwrap();
}

/// A release whose reply never comes is an error, not `NotHeld` (which would say the
/// lease had been lost before: a possible overlap that did not happen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_advisory_release_is_an_error_not_not_held() {
    let server = start_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let url = format!("postgres://{USER}:{PASSWORD}@{}/postgres", proxy.addr());
    let holder = builder_at(&url)
        .request_timeout(Duration::from_secs(1))
        .build_advisory_backend()
        .unwrap();
    let k = key("release:failed");
    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free");
    proxy.blackhole();
    let released = holder.release(&lease).await;
    proxy.reset();
    proxy.heal();
    assert!(
        released.is_err(),
        "a release with no reply said {released:?}"
    );
    assert_ne!(released.ok(), Some(Release::NotHeld));
}
