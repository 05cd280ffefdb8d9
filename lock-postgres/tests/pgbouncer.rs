//! Both backends through a real PgBouncer in front of a test server: the lease table and
//! the advisory backend work in session pooling mode (a release wakes a lease-table waiter
//! by notification); in transaction mode the advisory backend refuses to lock with an
//! error that names the mode, leaving no advisory lock and no token behind. The lease
//! table works in transaction mode with `pooling=transaction` (its waiters poll; a
//! process listening on a direct connection is still woken by its releases), and without
//! that setting refuses to work, naming it, before it writes anything. PgBouncer runs with
//! no `ignore_startup_parameters`, as it ships: the backends' connections get through, and
//! a login it refuses for good is a `Config` error naming the setting to change.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{acquire_all, start_server};
use distlock_core::{
    Fence, LockBackend, LockError, LockKey, Locker, Release, Renewal, RetryPolicy,
};
use harness::pgbouncer::{PgBouncerServer, PoolMode, SERVER_POOL_SIZE};
use harness::postgres::PostgresServer;
use lock_postgres::PgPooling;
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
    let backend = builder(bouncer)
        .pooling(match bouncer.pool_mode() {
            PoolMode::Session => PgPooling::Session,
            PoolMode::Transaction => PgPooling::Transaction,
        })
        .build_lease_backend()
        .unwrap();
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

/// How many rows the lease table in `schema` has.
async fn lease_rows(server: &PostgresServer, schema: &str) -> String {
    let count = format!("SELECT count(*) FROM {schema}.distlock_leases");
    harness::require(server.psql(&count).await)
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

/// The first acquire of `backend`, then [`TASKS`] at once, each fail with an error
/// `refused` recognises.
async fn every_acquire_is_refused(
    backend: Arc<impl LockBackend + 'static>,
    refused: impl Fn(&LockError) -> bool,
) {
    let err = backend.acquire(&key("first"), TTL).await.unwrap_err();
    assert!(refused(&err), "{err}");
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let backend = backend.clone();
        tasks.push(tokio::spawn(async move {
            backend.acquire(&key(&format!("many:{t}")), TTL).await
        }));
    }
    for task in tasks {
        let err = task.await.unwrap().unwrap_err();
        assert!(refused(&err), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_refuses_transaction_pooling_before_granting_anything() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let backend = Arc::new(advisory_backend(&bouncer).await);
    let names_the_mode =
        |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pool_mode = transaction"));
    // The very first acquire of a fresh backend, and then many at once.
    every_acquire_is_refused(backend, names_the_mode).await;
    assert_eq!(server_state(&server).await, "0 0");
}

/// A waiter in `Locker::lock` on `waiter` gets a key `holder` held and released, less
/// than `within` after the release (else the failure says `what` it was that long after).
async fn a_waiter_gets_the_released_key(
    holder: Arc<dyn LockBackend>,
    waiter: Arc<dyn LockBackend>,
    backoff: Duration,
    within: Duration,
    what: &str,
) {
    let backend = holder;
    let locker = Locker::builder(waiter)
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: backoff,
            max: backoff,
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
    let after = got - released;
    assert!(after < within, "{what} {after:?} after the release");
}

/// The waiter sleeps in a 5 s backoff: taking the key well within a second means the
/// release's notification reached its `LISTEN` session through the pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_waiters_are_woken_through_session_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Session).await;
    let backend = lease_backend(&bouncer).await;
    let (backoff, within) = (Duration::from_secs(5), Duration::from_secs(1));
    a_waiter_gets_the_released_key(backend.clone(), backend, backoff, within, "woken").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_works_through_transaction_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let started = Instant::now();
    the_lease_cycle_holds_under_load(lease_backend(&bouncer).await, "transaction", TASKS).await;
    // 5 rounds of 10 calls per task.
    let calls = TASKS * 5 * 10;
    println!(
        "{calls} calls from {TASKS} tasks over {SERVER_POOL_SIZE} server sessions in {:?}",
        started.elapsed()
    );
}

/// `setup` of a new schema, batches, `inspect` and `purge`, on names holding quotes,
/// backslashes, `$1` and non-ASCII text, which reach the server as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_batches_and_odd_names_work_through_transaction_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let backend = builder(&bouncer)
        .schema("via_pooler")
        .pooling(PgPooling::Transaction)
        .build_lease_backend()
        .unwrap();
    backend.setup().await.unwrap();
    backend.setup().await.unwrap();
    backend.connect().await.unwrap();
    let names = [
        "o'brien",
        "back\\slash",
        "$1 $2",
        "naïve ☃",
        "'); DROP TABLE x; --",
    ];
    let keys: Vec<LockKey> = names.iter().map(|n| key(n)).collect();
    let leases = acquire_all(&backend, &keys, TTL).await;
    assert!(
        backend
            .acquire_many(&keys, TTL)
            .await
            .unwrap()
            .iter()
            .all(Option::is_none),
        "held"
    );
    for (lease, name) in leases.iter().zip(names) {
        let info = backend.inspect(lease.key()).await.unwrap();
        assert_eq!(info.owner, Some(lease.owner()), "{name}");
        assert_eq!(info.token, Some(lease.token()), "{name}");
    }
    let stored = harness::require(
        server
            .psql("SELECT string_agg(name, '|' ORDER BY name) FROM via_pooler.distlock_leases")
            .await,
    );
    let mut sorted = names;
    sorted.sort_unstable();
    assert_eq!(stored, sorted.join("|"));
    let renewed = backend.renew_many(&leases).await.unwrap();
    assert!(
        renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })),
        "{renewed:?}"
    );
    assert_eq!(
        backend.release_many(&leases).await.unwrap(),
        vec![Release::Released; names.len()]
    );
    assert_eq!(
        backend.release_many(&leases).await.unwrap(),
        vec![Release::NotHeld; names.len()]
    );
    for k in &keys {
        backend.purge(k).await.unwrap();
        assert_eq!(backend.inspect(k).await.unwrap().token, None);
    }
    assert_eq!(lease_rows(&server, "via_pooler").await, "0");
}

/// With the default settings behind a transaction pooler the lease table refuses every
/// call with an error naming the setting to use, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_refuses_transaction_pooling_without_the_setting() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let names_the_setting =
        |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pooling=transaction"));
    // The very first acquire of a fresh backend, then many at once, then `connect`.
    let backend = Arc::new(builder(&bouncer).build_lease_backend().unwrap());
    every_acquire_is_refused(backend, names_the_setting).await;
    let fresh = builder(&bouncer).build_lease_backend().unwrap();
    let err = fresh.connect().await.unwrap_err();
    assert!(names_the_setting(&err), "{err}");
    assert_eq!(lease_rows(&server, "distlock").await, "0");
}

/// Through a transaction pooler the lease table wakes nobody (no session to `LISTEN`
/// on, and it says so); a waiter still gets the key, by its backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_waiters_poll_through_transaction_pooling() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let backend = lease_backend(&bouncer).await;
    assert!(!backend.capabilities().wakes_waiters);
    assert!(backend.watch_releases(&key("waited")).is_none());
    let (backoff, within) = (Duration::from_millis(300), Duration::from_secs(5));
    a_waiter_gets_the_released_key(backend.clone(), backend, backoff, within, "got it").await;
}

/// A release through the transaction pooler is still announced: a waiter of another
/// process, listening on a direct connection to the same schema, is woken at once. Each
/// round after a burst of calls from many clients, so the announcer's connection lands
/// on other server sessions than the one it used before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_through_transaction_pooling_wake_a_directly_connected_waiter() {
    let server = start_server().await;
    let bouncer = bouncer(&server, PoolMode::Transaction).await;
    let holder = lease_backend(&bouncer).await;
    let direct = common::builder(&server).build_lease_backend().unwrap();
    direct.connect().await.unwrap();
    let direct: Arc<dyn LockBackend> = Arc::new(direct);
    for round in 0..3 {
        the_lease_cycle_holds_under_load(holder.clone(), &format!("burst{round}"), TASKS).await;
        let (backoff, within) = (Duration::from_secs(5), Duration::from_secs(1));
        let what = format!("round {round}: woken");
        a_waiter_gets_the_released_key(holder.clone(), direct.clone(), backoff, within, &what)
            .await;
    }
}

/// What PgBouncer refuses at login for good (a startup parameter it does not track, a
/// database it does not list, a wrong password) is a `Config` error naming the setting,
/// from `build`, from a first call and from `setup`, in both pooling modes; never the
/// label of an operation that did not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_pgbouncer_refuses_is_a_config_error_naming_the_setting() {
    let server = start_server().await;
    for mode in [PoolMode::Session, PoolMode::Transaction] {
        let bouncer = bouncer(&server, mode).await;
        let url = bouncer.url();
        let pooling = match mode {
            PoolMode::Session => PgPooling::Session,
            PoolMode::Transaction => PgPooling::Transaction,
        };
        let cases = [
            (
                format!("{url}?options[statement_timeout]=5s"),
                ["startup parameter `options`", "ignore_startup_parameters"],
            ),
            (
                url.replace("/postgres", "/no_such_db"),
                ["PgBouncer refused the login", "[databases]"],
            ),
            (
                url.replace(harness::postgres::PASSWORD, "wrong-password"),
                ["PgBouncer refused the login", "password"],
            ),
        ];
        for (url, says) in cases {
            let settings = common::builder_at(&url).pooling(pooling);
            let from_build = settings.clone().build().await.map(drop).unwrap_err();
            let backend = settings.build_lease_backend().unwrap();
            let from_acquire = backend.acquire(&key("refused"), TTL).await.unwrap_err();
            let from_setup = backend.setup().await.unwrap_err();
            for err in [from_build, from_acquire, from_setup] {
                assert!(
                    matches!(&err, LockError::Config(m) if says.iter().all(|s| m.contains(s))),
                    "{mode:?} {says:?}: {err}"
                );
                assert!(!err.to_string().contains("inspect:"), "{err}");
                assert!(!err.to_string().contains("wrong-password"), "{err}");
            }
        }
    }
}
