//! Shared test support: one PostgreSQL server per test binary while any test uses it,
//! and the conformance factories for both backends.

#![allow(dead_code)] // Each test binary uses a different part of this module.

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::{
    ClockFaults, Factory, LinkFaults, ServerFaults, SessionFaults, WithFencedResource,
};
use distlock_core::{EnforcementMode, Lease, LockBackend, LockKey};
use harness::{ShiftedClock, postgres::PostgresServer, proxy::FaultProxy};
use lock_postgres::{PgBuilder, PgFencedResource, sqlx};

/// The server shared by the tests of one binary. Only a `Weak` is kept here: the server
/// is stopped (killed on drop) as soon as the last test holding it ends, so no process
/// outlives the test binary.
static SHARED: tokio::sync::Mutex<Weak<PostgresServer>> =
    tokio::sync::Mutex::const_new(Weak::new());

/// The shared server, started (and prepared) if no running test holds it.
pub async fn shared_server() -> Arc<PostgresServer> {
    let mut slot = SHARED.lock().await;
    if let Some(server) = slot.upgrade() {
        return server;
    }
    let server = Arc::new(start_server().await);
    *slot = Arc::downgrade(&server);
    server
}

/// A server of its own, for tests that kill, pause or restart it; the tables are set up.
pub async fn start_server() -> PostgresServer {
    start_server_with(PostgresServer::builder()).await
}

/// [`start_server`] from `builder`.
pub async fn start_server_with(
    options: harness::postgres::PostgresServerBuilder,
) -> PostgresServer {
    let server = harness::require(options.start().await);
    // The test role may create the backends' schema (a deployment grants this once).
    harness::require(
        server
            .psql("GRANT CREATE ON DATABASE postgres TO distlock")
            .await,
    );
    builder(&server)
        .build_lease_backend()
        .expect("valid settings")
        .setup()
        .await
        .expect("setup on a fresh server");
    server
}

/// How far the server's WAL has been written, in bytes: the difference over a stretch is
/// what the statements in between (and the server on its own) wrote.
pub async fn wal_insert_lsn(server: &PostgresServer) -> u64 {
    let bytes = server
        .psql("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
        .await
        .unwrap();
    bytes.parse().unwrap()
}

/// Settings for the test role on `server`, with short time limits.
pub fn builder(server: &PostgresServer) -> PgBuilder {
    builder_at(&server.url())
}

/// The same settings for a server reached at `url` (through a fault proxy, say).
pub fn builder_at(url: &str) -> PgBuilder {
    PgBuilder::new(url)
        .pool_size(4)
        .connect_timeout(Duration::from_secs(5))
        .request_timeout(Duration::from_secs(5))
}

/// The URL of the test role's database at `addr` (a fault proxy or a pooler in front of
/// the server, say).
pub fn url_at(addr: std::net::SocketAddr) -> String {
    let (user, password) = (harness::postgres::USER, harness::postgres::PASSWORD);
    format!("postgres://{user}:{password}@{addr}/postgres")
}

/// Takes every one of `keys` in one batch on `backend`; each must be free.
pub async fn acquire_all(backend: &dyn LockBackend, keys: &[LockKey], ttl: Duration) -> Vec<Lease> {
    let granted = backend.acquire_many(keys, ttl).await.unwrap();
    granted.into_iter().map(|l| l.expect("free")).collect()
}

/// Which backend a factory makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `PgLeaseBackend`.
    Lease,
    /// `PgAdvisoryBackend`.
    Advisory,
}

/// A conformance factory on one server, reached through a fault proxy of the factory's
/// own (so link faults hit only its case). Its clients are one backend instance, as the
/// memory factory's are, because some cases release a lease through another client than
/// the one that took it; the crate's own tests cover distinct instances.
pub struct PgFactory {
    server: Arc<PostgresServer>,
    proxy: Arc<FaultProxy>,
    kind: Kind,
    backend: Arc<dyn LockBackend>,
    /// Whether the server is this factory's own, so server faults hit no other test.
    private: bool,
    /// The wall clock a private server runs under.
    clock: Option<Arc<ShiftedClock>>,
}

impl PgFactory {
    /// A factory on the shared server.
    pub async fn shared(kind: Kind) -> Self {
        Self::on(shared_server().await, kind, None).await
    }

    async fn on(server: Arc<PostgresServer>, kind: Kind, clock: Option<Arc<ShiftedClock>>) -> Self {
        let proxy = harness::require(FaultProxy::start(server.addr()).await);
        Self {
            backend: backend_at(&url_at(proxy.addr()), kind).await,
            server,
            proxy: Arc::new(proxy),
            kind,
            private: clock.is_some(),
            clock,
        }
    }
}

impl PgFactory {
    /// A factory on a server of its own, whose process the cases may pause, kill and
    /// restart and whose wall clock they may step (the shared server cannot be: other
    /// tests use it).
    pub async fn private(kind: Kind) -> Self {
        let clock = Arc::new(harness::require(ShiftedClock::new()));
        let server = start_server_with(PostgresServer::builder().clock(&clock)).await;
        Self::on(Arc::new(server), kind, Some(clock)).await
    }

    /// The server this factory's clients talk to.
    pub fn server(&self) -> &Arc<PostgresServer> {
        &self.server
    }

    /// This factory, its fenced-counter workload writing through the guarded row in its
    /// server's `distlock` schema.
    pub fn with_fenced_resource(self) -> WithFencedResource<PgFactory> {
        let backend = builder(self.server())
            .build_lease_backend()
            .expect("valid settings");
        let fenced =
            PgFencedResource::new(backend.pool().clone(), "distlock", EnforcementMode::Enforce)
                .expect("a valid schema name");
        WithFencedResource::new(self, fenced)
    }
}

/// A backend of `kind` on `server` with its connections open, as a trait object.
pub async fn backend(server: &PostgresServer, kind: Kind) -> Arc<dyn LockBackend> {
    backend_at(&server.url(), kind).await
}

/// The same for a server reached at `url`.
pub async fn backend_at(url: &str, kind: Kind) -> Arc<dyn LockBackend> {
    let b = builder_at(url);
    match kind {
        Kind::Lease => {
            let backend = b.build_lease_backend().expect("valid settings");
            backend.connect().await.expect("connect");
            Arc::new(backend)
        }
        Kind::Advisory => {
            let backend = b.build_advisory_backend().expect("valid settings");
            backend.connect().await.expect("connect");
            Arc::new(backend)
        }
    }
}

#[async_trait]
impl Factory for PgFactory {
    fn name(&self) -> &str {
        match self.kind {
            Kind::Lease => "postgres-lease",
            Kind::Advisory => "postgres-advisory",
        }
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.backend.clone()
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(suite_faults::link(self.proxy.clone()))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        self.private
            .then(|| suite_faults::server(self.server.clone()))
    }

    fn sessions(&self) -> Option<Arc<dyn SessionFaults>> {
        self.private
            .then(|| suite_faults::sessions(self.server.clone()))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        let clock = self.clock.clone()?;
        let server = self.server.clone();
        let probe: suite_faults::ClockProbe = Box::new(move || {
            let server = server.clone();
            Box::pin(async move { server_time(&server).await })
        });
        Some(suite_faults::clock(clock, vec![probe]))
    }
}

/// The server's wall clock, from `clock_timestamp()`.
pub async fn server_time(server: &PostgresServer) -> std::time::SystemTime {
    let micros = harness::require(
        server
            .psql("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
            .await,
    );
    let micros: u64 = micros.trim().parse().expect("a clock in µs");
    std::time::UNIX_EPOCH + Duration::from_micros(micros)
}

/// A connection straight to `server`, to look at its sessions.
pub async fn observer(server: &PostgresServer) -> sqlx::PgConnection {
    use sqlx::Connection;
    sqlx::PgConnection::connect(&server.url()).await.unwrap()
}

/// How many sessions of the server match `condition` (on `pg_stat_activity`), the
/// observer's own session left out.
pub async fn sessions(observer: &mut sqlx::PgConnection, condition: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity \
          WHERE pid <> pg_backend_pid() AND ({condition})"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .persistent(false)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// Polls until no session matches `condition`, at most until `deadline`; the number last
/// seen (0 when none is left).
pub async fn until_no_session(
    observer: &mut sqlx::PgConnection,
    condition: &str,
    deadline: tokio::time::Instant,
) -> i64 {
    loop {
        let seen = sessions(observer, condition).await;
        if seen == 0 || tokio::time::Instant::now() >= deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The request time limit of the backends of the stalled-session tests, and so the
/// server's limit on their statements and transactions.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long past the server's limit a stalled transaction or a waiting statement may
/// still be seen before a test calls it left behind (scheduling on a loaded machine).
pub const MARGIN: Duration = Duration::from_secs(5);

/// Asserts that no session matching `idle_on_leases` (a transaction waiting on its client
/// after it locked rows of the lease table) is left [`REQUEST_TIMEOUT`] + [`MARGIN`]
/// after its client stalled at `stalled_at`: the server ended it, and its row locks went
/// with it.
pub async fn no_transaction_waits_on_the_stalled_client(
    observer: &mut sqlx::PgConnection,
    idle_on_leases: &str,
    stalled_at: tokio::time::Instant,
) {
    let within = REQUEST_TIMEOUT + MARGIN;
    let left = until_no_session(observer, idle_on_leases, stalled_at + within).await;
    assert_eq!(
        left,
        0,
        "a transaction still waits on its stalled client, holding the lease's row, {:?} \
         after the client stalled",
        stalled_at.elapsed()
    );
}

/// Sessions whose statement waits for a lock (a row of the lease table).
pub const WAITING_ON_A_LOCK: &str = "wait_event_type = 'Lock' AND query LIKE '%distlock_leases%'";

/// Takes `k` on `backend`, lets another client's transaction lock its row and the lease
/// run out, then has `acquires` acquires wait on the row until their clients give up
/// (each fails: the row stays locked). Asserts that no backend of `server` still waits on
/// the row's lock [`REQUEST_TIMEOUT`] (the backend's, and so the server's, limit) +
/// [`MARGIN`] after they gave up.
pub async fn acquires_leave_no_backend_waiting(
    server: &PostgresServer,
    backend: lock_postgres::PgLeaseBackend,
    acquires: usize,
    k: &LockKey,
) {
    let within = REQUEST_TIMEOUT + MARGIN;
    use sqlx::Connection;
    let mut observer = observer(server).await;
    let ttl = Duration::from_millis(200);
    assert!(backend.acquire(k, ttl).await.unwrap().is_some());

    // Another client's transaction keeps the row locked and waits (an application's
    // transaction that stalled, or a client of an older version).
    let mut holder = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; SELECT 1 FROM distlock.distlock_leases WHERE name = '{}' FOR UPDATE",
        k.as_str()
    )))
    .execute(&mut holder)
    .await
    .unwrap();
    tokio::time::sleep(ttl).await;

    // The lease ran out, so each acquire tries to take the row over and waits for the
    // lock until its client gives up.
    let backend = Arc::new(backend);
    let mut tasks = Vec::new();
    for _ in 0..acquires {
        let (backend, k) = (backend.clone(), k.clone());
        tasks.push(tokio::spawn(async move { backend.acquire(&k, ttl).await }));
    }
    for task in tasks {
        assert!(task.await.unwrap().is_err(), "the row stays locked");
    }
    let gave_up = tokio::time::Instant::now();
    // The server cancels each waiting statement at the request time limit: none waits
    // on for a client that is gone.
    let left = until_no_session(&mut observer, WAITING_ON_A_LOCK, gave_up + within).await;
    holder.close().await.unwrap();
    assert_eq!(
        left,
        0,
        "backends still wait on the row's lock {:?} after their clients gave up",
        gave_up.elapsed()
    );
}
