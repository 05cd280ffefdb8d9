//! Both backends through a real PgBouncer in front of a test server: the lease table and
//! the advisory backend work in session pooling mode (a release wakes a lease-table waiter
//! by notification); in transaction mode the advisory backend refuses to lock with an
//! error that names the mode, leaving no advisory lock and no token behind.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::start_server;
use distlock_core::{
    Fence, LockBackend, LockError, LockKey, Locker, Release, Renewal, RetryPolicy,
};
use harness::pgbouncer::{PgBouncerServer, PoolMode, SERVER_POOL_SIZE};
use harness::postgres::PostgresServer;
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(30);
/// More clients than the pooler has server sessions, so transaction pooling shares them.
const TASKS: usize = 4 * SERVER_POOL_SIZE as usize;

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

async fn bouncer(server: &PostgresServer, mode: PoolMode) -> PgBouncerServer {
    harness::require(PgBouncerServer::start(server, mode).await)
}

/// Settings for the test role through `bouncer`, with a pool as large as [`TASKS`].
fn builder(bouncer: &PgBouncerServer) -> lock_postgres::PgBuilder {
    common::builder_at(&bouncer.url()).pool_size(TASKS as u32)
}

/// Acquire, renew, fence, release from `tasks` tasks at once, each on its own keys, then
/// a second grant of every key: tokens rise, a released lease is stale and not held.
async fn the_lease_cycle_holds_under_load(
    backend: Arc<dyn LockBackend>,
    prefix: &str,
    tasks_at_once: usize,
) {
    let mut tasks = Vec::new();
    for t in 0..tasks_at_once {
        let backend = backend.clone();
        let prefix = prefix.to_owned();
        tasks.push(tokio::spawn(async move {
            for round in 0..5 {
                let k = key(&format!("{prefix}:{t}:{round}"));
                let first = backend.acquire(&k, TTL).await.unwrap().expect("free");
                assert!(backend.acquire(&k, TTL).await.unwrap().is_none(), "held");
                assert!(matches!(
                    backend.renew(&first).await.unwrap(),
                    Renewal::Renewed { .. }
                ));
                assert_eq!(backend.fence(&first).await.unwrap(), Fence::Current);
                assert_eq!(backend.release(&first).await.unwrap(), Release::Released);
                assert_eq!(backend.release(&first).await.unwrap(), Release::NotHeld);
                assert_eq!(backend.renew(&first).await.unwrap(), Renewal::Lost);
                let second = backend.acquire(&k, TTL).await.unwrap().expect("released");
                assert!(second.token() > first.token());
                assert!(matches!(
                    backend.fence(&first).await.unwrap(),
                    Fence::Stale { current } if current >= second.token()
                ));
                assert_eq!(backend.release(&second).await.unwrap(), Release::Released);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

async fn lease_backend(bouncer: &PgBouncerServer) -> Arc<dyn LockBackend> {
    let backend = builder(bouncer).build_lease_backend().unwrap();
    backend.connect().await.unwrap();
    Arc::new(backend)
}

async fn advisory_backend(bouncer: &PgBouncerServer) -> lock_postgres::PgAdvisoryBackend {
    builder(bouncer).build_advisory_backend().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_works_through_session_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Session).await;
    the_lease_cycle_holds_under_load(lease_backend(&bouncer).await, "session", TASKS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_works_through_session_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Session).await;
    let backend = advisory_backend(&bouncer).await;
    backend.connect().await.unwrap();
    // Each task holds one lock (one pinned connection) while it tries for it again.
    the_lease_cycle_holds_under_load(Arc::new(backend), "session", TASKS / 2).await;
}

/// Advisory locks held on the server, and token rows written.
async fn server_state(server: &PostgresServer) -> String {
    harness::require(
        server
            .psql(
                "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory') || ' ' || \
                        (SELECT count(*) FROM distlock.distlock_advisory_tokens)",
            )
            .await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_refuses_transaction_pooling_before_granting_anything() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let backend = Arc::new(advisory_backend(&bouncer).await);
    let names_the_mode =
        |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pool_mode = transaction"));
    // The very first acquire of a fresh backend, and then many at once.
    let err = backend.acquire(&key("first"), TTL).await.unwrap_err();
    assert!(names_the_mode(&err), "{err}");
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let backend = backend.clone();
        tasks.push(tokio::spawn(async move {
            backend.acquire(&key(&format!("many:{t}")), TTL).await
        }));
    }
    for task in tasks {
        let err = task.await.unwrap().unwrap_err();
        assert!(names_the_mode(&err), "{err}");
    }
    assert_eq!(server_state(&server).await, "0 0");
}

/// A waiter in `Locker::lock` gets a key the holder released; how long after.
async fn a_waiter_gets_the_released_key(bouncer: &PgBouncerServer) -> Duration {
    let backend = lease_backend(bouncer).await;
    let locker = Locker::builder(backend.clone())
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: Duration::from_secs(5),
            max: Duration::from_secs(5),
        })
        .wait_timeout(Some(Duration::from_secs(30)))
        .build()
        .unwrap();
    let k = key("waited");
    let held = backend.acquire(&k, TTL).await.unwrap().expect("free");
    let waiter = tokio::spawn(async move {
        let guard = locker.lock(&k).await.unwrap();
        (Instant::now(), guard)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released = Instant::now();
    assert_eq!(backend.release(&held).await.unwrap(), Release::Released);
    let (got, guard) = waiter.await.unwrap();
    assert!(guard.token() > held.token());
    guard.release().await.unwrap();
    got - released
}

/// The waiter sleeps in a 5 s backoff: taking the key well within a second means the
/// release's notification reached its `LISTEN` session through the pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_waiters_are_woken_through_session_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Session).await;
    let after = a_waiter_gets_the_released_key(&bouncer).await;
    assert!(
        after < Duration::from_secs(1),
        "woken {after:?} after the release"
    );
}
