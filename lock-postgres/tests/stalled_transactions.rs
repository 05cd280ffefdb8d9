//! The lease table through a default PgBouncer in `pool_mode = transaction`
//! (`pooling=transaction`), where each statement runs in a transaction of its own
//! (`BEGIN`, parse, bind and execute, `COMMIT`): the server, not the client, bounds those
//! transactions, and a renew judges expiry when its statement runs.
//!
//! - A client that stalls after its statement ran, before its `COMMIT` (a fault proxy
//!   holds its bytes), does not keep the row locked: the server ends its session after the
//!   request time limit, and the key can be taken again.
//! - Acquires that wait on a row another transaction keeps locked do not stay waiting on
//!   the server once their clients gave up: no backend is left waiting on the lock.
//! - A renew whose statement runs after the lease expired (a slow link, several round
//!   trips after its `BEGIN`) is `Lost`, not a lease brought back.

mod common;

use std::time::Duration;

use common::{
    REQUEST_TIMEOUT, acquires_leave_no_backend_waiting, no_transaction_waits_on_the_stalled_client,
    start_server, url_at,
};
use distlock_core::{LockBackend, LockKey, Renewal};
use harness::pgbouncer::{PgBouncerServer, PoolMode};
use harness::proxy::FaultProxy;
use lock_postgres::{PgLeaseBackend, PgPooling};
use tokio::time::Instant;

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// A lease backend with `pooling=transaction` at `url`, its pool opened.
async fn backend_at(url: &str, pool_size: u32, request_timeout: Duration) -> PgLeaseBackend {
    let backend = common::builder_at(url)
        .pool_size(pool_size)
        .request_timeout(request_timeout)
        .pooling(PgPooling::Transaction)
        .build_lease_backend()
        .unwrap();
    backend.connect().await.unwrap();
    backend
}

/// Sessions in a transaction that waits on its client after it changed a row of the lease
/// table (it has a transaction id only once it wrote).
const IDLE_ON_LEASES: &str = "state = 'idle in transaction' AND backend_xid IS NOT NULL \
     AND query LIKE '%distlock_leases%'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalled_before_its_commit_does_not_keep_the_row_locked() {
    let server = start_server().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Transaction).await);
    let proxy = harness::require(FaultProxy::start(bouncer.addr()).await);
    let direct = backend_at(&bouncer.url(), 2, REQUEST_TIMEOUT).await;
    let stalled = backend_at(&url_at(proxy.addr()), 1, REQUEST_TIMEOUT).await;
    let mut observer = common::observer(&server).await;
    let k = key("stalled:renew");
    // Long enough that the lease is still held when the renew's UPDATE runs.
    let ttl = Duration::from_secs(3);

    let lease = direct.acquire(&k, ttl).await.unwrap().expect("free");
    let adopted = stalled
        .adopt(&k, lease.owner(), lease.token(), ttl)
        .unwrap();
    // Each round trip through the proxy now takes twice this: the renew's transaction
    // waits that long on the client after its UPDATE ran, long enough to see it and stall
    // the client before its COMMIT leaves the proxy.
    proxy.delay(Duration::from_millis(300));
    let renew = tokio::spawn(async move { stalled.renew(&adopted).await });
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    while common::sessions(&mut observer, IDLE_ON_LEASES).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the renew's transaction was never seen waiting on its client"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.blackhole();
    let stalled_at = Instant::now();
    // The client gives up on its own time limit; its bytes stay held in the proxy.
    assert!(renew.await.unwrap().is_err(), "no reply can have come");

    // The server ends the stalled transaction once it waited on its client for the
    // request time limit: its row lock goes with it.
    no_transaction_waits_on_the_stalled_client(&mut observer, IDLE_ON_LEASES, stalled_at).await;
    // Once the lease ran out, the key is taken again, without waiting on a lock.
    tokio::time::sleep_until(stalled_at + ttl).await;
    let again = direct.acquire(&k, ttl).await.unwrap();
    assert!(again.is_some(), "the expired key is free to take");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_behind_a_stalled_transaction_leave_no_backend_waiting() {
    const ACQUIRES: usize = 8;
    let server = start_server().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Transaction).await);
    let backend = backend_at(&bouncer.url(), ACQUIRES as u32, REQUEST_TIMEOUT).await;
    let k = key("stalled:row");
    acquires_leave_no_backend_waiting(&server, backend, ACQUIRES, &k).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_whose_statement_runs_after_expiry_is_lost() {
    let server = start_server().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Transaction).await);
    let proxy = harness::require(FaultProxy::start(bouncer.addr()).await);
    let direct = backend_at(&bouncer.url(), 1, REQUEST_TIMEOUT).await;
    // Room for the slow round trips below.
    let slow = backend_at(&url_at(proxy.addr()), 1, Duration::from_secs(20)).await;
    let k = key("slow:renew");
    // One way through the proxy takes this long. The renew's UPDATE reaches the server
    // after five one-way trips (BEGIN and its reply, the parse and its reply, then bind
    // and execute): at least 2.5 s after it was sent; its BEGIN after one, 0.5 s.
    let one_way = Duration::from_millis(500);
    let ttl = Duration::from_millis(1200);
    let lease = direct.acquire(&k, ttl).await.unwrap().expect("free");
    // The same acquisition, renewed for much longer than it had.
    let adopted = slow
        .adopt(&k, lease.owner(), lease.token(), Duration::from_secs(30))
        .unwrap();
    proxy.delay(one_way);
    let renewed = slow.renew(&adopted).await.unwrap();
    assert_eq!(
        renewed,
        Renewal::Lost,
        "the lease expired {ttl:?} after its grant, before the renew's UPDATE ran \
         (at least {:?} after it was sent)",
        one_way * 5
    );
    assert_eq!(direct.inspect(&k).await.unwrap().owner, None);
    drop(proxy);
}
