//! The lease table with the default `pooling=session`, on a direct connection and through
//! a default PgBouncer in `pool_mode = session`: the server, not only the client, bounds
//! the statements and transactions of the backend's pool by the request time limit.
//!
//! - Acquires that wait on a row another transaction keeps locked do not stay waiting on
//!   the server once their clients gave up: no backend is left waiting on the lock (to
//!   take the row, for nobody, once it is free).
//! - A transaction on the backend's pool (the application's, through
//!   `PgLeaseBackend::pool`) whose client stalls after it locked a row is ended by the
//!   server after the limit, and the row's key can be taken again.

mod common;

use std::time::Duration;

use common::{
    REQUEST_TIMEOUT, acquires_leave_no_backend_waiting, no_transaction_waits_on_the_stalled_client,
    observer, sessions, start_server, url_at,
};
use distlock_core::{LockBackend, LockKey};
use harness::pgbouncer::{PgBouncerServer, PoolMode};
use harness::proxy::FaultProxy;
use lock_postgres::PgLeaseBackend;
use lock_postgres::sqlx;
use tokio::time::Instant;

/// Sessions in a transaction that waits on its client after it locked rows of the lease
/// table.
const IDLE_ON_LEASES: &str =
    "state = 'idle in transaction' AND query LIKE '%distlock_leases%FOR UPDATE%'";

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// A lease backend with the default pooling at `url`, its pool opened.
async fn backend_at(url: &str, pool_size: u32) -> PgLeaseBackend {
    let backend = common::builder_at(url)
        .pool_size(pool_size)
        .request_timeout(REQUEST_TIMEOUT)
        .build_lease_backend()
        .unwrap();
    backend.connect().await.unwrap();
    backend
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_behind_a_locked_row_leave_no_backend_waiting_on_a_direct_server() {
    const ACQUIRES: usize = 8;
    let server = start_server().await;
    let backend = backend_at(&server.url(), ACQUIRES as u32).await;
    let k = key("locked:direct");
    acquires_leave_no_backend_waiting(&server, backend, ACQUIRES, &k).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_behind_a_locked_row_leave_no_backend_waiting_through_session_pooling() {
    const ACQUIRES: usize = 4;
    let server = start_server().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Session).await);
    let backend = backend_at(&bouncer.url(), ACQUIRES as u32).await;
    let k = key("locked:bouncer");
    acquires_leave_no_backend_waiting(&server, backend, ACQUIRES, &k).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_on_the_pool_whose_client_stalls_does_not_keep_its_row_locked() {
    let server = start_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let direct = backend_at(&server.url(), 2).await;
    let stalled = backend_at(&url_at(proxy.addr()), 1).await;
    let mut observer = observer(&server).await;
    let k = key("stalled:application");
    let ttl = Duration::from_millis(500);
    assert!(direct.acquire(&k, ttl).await.unwrap().is_some());

    // The application's transaction on the backend's pool locks the lease's row, then its
    // client stalls (the proxy holds whatever it sends next).
    let mut tx = stalled.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM distlock.distlock_leases WHERE name = $1 FOR UPDATE")
        .bind(k.as_str())
        .persistent(false)
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(sessions(&mut observer, IDLE_ON_LEASES).await, 1);
    proxy.blackhole();
    let stalled_at = Instant::now();

    no_transaction_waits_on_the_stalled_client(&mut observer, IDLE_ON_LEASES, stalled_at).await;
    // The lease ran out meanwhile: the key is taken again, without waiting on a lock.
    let again = direct.acquire(&k, ttl).await.unwrap();
    assert!(again.is_some(), "the expired key is free to take");
    drop(tx);
    drop(proxy);
}

/// A limit the URL gives the session (`options[statement_timeout]=…`) is the user's: the
/// pool sets the request time limit only for what the URL leaves unset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_the_url_sets_is_kept_and_the_others_are_bounded() {
    let server = start_server().await;
    let url = format!("{}?options[statement_timeout]=45s", server.url());
    let backend = backend_at(&url, 1).await;
    let mut conn = backend.pool().acquire().await.unwrap();
    let show = |name: &'static str| format!("SHOW {name}");
    let statement: (String,) = sqlx::query_as(sqlx::AssertSqlSafe(show("statement_timeout")))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let idle: (String,) = sqlx::query_as(sqlx::AssertSqlSafe(show(
        "idle_in_transaction_session_timeout",
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(
        statement.0, "45s",
        "the URL's statement_timeout was replaced"
    );
    assert_eq!(
        idle.0, "2s",
        "the limit the URL leaves unset is the request time limit"
    );
}
