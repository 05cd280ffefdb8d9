//! [`PgAdvisoryBackend`]: session-level advisory locks (`pg_try_advisory_lock`) on a
//! connection pinned to the lease until it is released.
//!
//! The pinned session (taking, checking and unpinning it) is in `session`; how a name
//! becomes an advisory-lock key in `keys`.

mod keys;
mod session;
mod statements;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    Release, Renewal,
};
use futures::future::join_all;
use sqlx::AssertSqlSafe;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use self::keys::{lock_id, split};
use self::session::{Releasing, session_moved};
use self::statements::Statements;
pub(crate) use self::statements::{UNLOCK, acquire_sql};
use crate::client::{PgClient, on_conn, token_from};
use crate::error::Operation;
use crate::key_row;
use crate::releases::ReleaseListener;
use crate::retention::{Sweeper, Table};
use crate::session_check::SessionCheck;
use crate::statement::{Statement, Value};

const NAME: &str = "postgres-advisory";

/// Why every acquire is refused once the pooling check found that client connections do
/// not keep their server sessions: the advisory backend's part of the refusal.
const SESSIONS_SHARED: &str = "and advisory locks need the session: connect directly or \
     through a session-mode pool (pool_mode = session)";

/// PostgreSQL advisory-lock backend: session-level advisory locks
/// (`pg_try_advisory_lock`) on a connection pinned to the lease until it is released.
///
/// # How it works
///
/// - **Key.** The first 8 bytes of SHA-256 of `distlock:<schema>:<name>`, read big-endian
///   as a signed 64-bit integer: the same on every platform and release. Two names whose
///   hashes collide contend for one lock: a collision costs waiting, never safety.
/// - **acquire** takes a connection from the pool and runs ONE statement on it that tries
///   the lock, and only if it got it bumps the name's counter in
///   `<schema>.distlock_advisory_tokens` to `greatest(counter + 1, server clock in µs)`
///   (so a counter that lost its last increments, or was purged, never issues a token
///   twice while the server's clock does not go back) and sets the session's time limits. The
///   connection then stays pinned to the lease (in its private handle) until release.
///   The statement first checks that the session holds no advisory lock, so that it holds
///   exactly this one afterwards. An acquire that fails or is cancelled after its
///   statement was sent closes the connection instead of giving it back to the pool.
/// - **Ownership ends with the session.** The session runs with
///   `idle_session_timeout = ttl`, so a holder that stops renewing (paused, partitioned,
///   vanished) loses its session, and so its lock, about one TTL after its last call;
///   TCP keepalives and `tcp_user_timeout` (also about one TTL) end sessions whose client
///   machine vanished mid-request. Needs PostgreSQL 14 or newer.
/// - **renew** checks that the pinned session is alive and is the server session that
///   took the lock (`pg_backend_pid()`), which also restarts the idle timer: a session
///   lock lasts as long as its session, and nothing else unlocks on a pinned session, so
///   `pg_locks` (whose reading takes every lock-manager partition lock) is left to
///   `fence`. A dropped connection is [`Renewal::Lost`].
/// - **release** runs `pg_advisory_unlock` (then `pg_advisory_unlock_all`, which finds
///   nothing left) on the pinned session, `RESET`s the time limits the acquire set (a
///   database's or role's own defaults come back), and gives the connection back to the
///   pool. A lease dropped without release closes its connection, which frees
///   the lock; a pinned connection never returns to the pool still holding a lock.
/// - **Waiters.** When some process waits for the key, the release statement says so,
///   and once it returned the backend's announcer notifies the backend's channel with the
///   name (`pg_notify`, many names in one transaction); the unlock itself never notifies
///   and writes nothing to the WAL. The notification wakes a waiter in
///   [`distlock_core::Locker::lock`] in every process that listens (one `LISTEN` session per backend, opened with the first waiter;
///   see [`LockBackend::watch_releases`]). A lock freed by its session ending is not
///   announced: waiters take it at their next backoff step. A waiter blocked in
///   `pg_advisory_lock` would instead pin a connection, and so a lock slot, per waiter.
///
/// # Capacity
///
/// Every held lock pins a connection: one backend holds at most
/// [`PgBuilder::pool_size`](crate::PgBuilder::pool_size) locks
/// ([`Capabilities::max_held`]); one more acquire fails at once with [`LockError::Unavailable`] saying so. The server's `max_connections` bounds
/// all backends together.
///
/// # The server can end a lock early
///
/// A server restart, a failover, `pg_terminate_backend`, an idle or TCP timeout, or a
/// network reset ends the session, and with it the lock, at once; another client can
/// then take the key (with a higher token) while this guard still says held. The client
/// learns of it at its next statement on that session, the watchdog's next renewal: the
/// driver reads an idle connection's socket only while a statement runs, so it sees the
/// death no sooner. The window is at most the renew interval (TTL / 3 by default; a
/// shorter [`distlock_core::LockerBuilder::renew_interval`] narrows it, each renewal being one
/// `SELECT pg_backend_pid()` on the pinned session). Guard writes downstream with the
/// fencing token, which refuses the old holder once the new one has written.
///
/// # Not behind a transaction-pooling proxy
///
/// Session locks need the session: behind PgBouncer in `transaction` (or `statement`)
/// pooling mode, consecutive statements run on different server sessions, so locks leak
/// to other clients and checks see the wrong session. Connect directly or through a
/// `session`-mode pool. The backend notices: before its first lock (or in
/// [`connect`](Self::connect)) it opens two connections of its own and checks that a
/// session setting one makes is neither seen by the other nor gone at its own next
/// statement, and refuses every acquire with [`LockError::Config`] naming the pooling
/// mode otherwise, before anything is locked or counted (`tests/pgbouncer.rs` runs this
/// through a real PgBouncer in both modes). Acquire also refuses a server session that
/// already holds a lock this backend took (the lock's statement marks its session with
/// the setting `distlock.holds`, which the unlock resets), and renew, fence and release compare the server
/// session's pid with the one that took the lock, failing with [`LockError::Config`]
/// that names the pooling mode (release then unlocks nothing in the wrong session).
///
/// # No adopt
///
/// [`LockBackend::adopt`] is [`LockError::Unsupported`]: an advisory lease *is* its pinned
/// session, and no other client can act on another session's lock. A lock held by a
/// vanished process frees itself when the server ends that session.
///
/// Call [`PgAdvisoryBackend::setup`] once per database (idempotent) for the token table.
/// A token row of a name nobody holds is deleted once its token is older than the
/// [token retention](crate::PgBuilder::token_retention) (24 h by default).
pub struct PgAdvisoryBackend {
    id: BackendId,
    client: PgClient,
    max_held: usize,
    /// Connections in use for locks: held ones and attempts in flight.
    slots: Arc<Semaphore>,
    /// Locks held right now, so a full backend fails at once instead of waiting.
    held: Arc<AtomicUsize>,
    sql: Statements,
    /// The pooling check, run before the first lock.
    sessions: SessionCheck,
    sweeper: Sweeper,
    pub(crate) releases: ReleaseListener,
}

impl PgAdvisoryBackend {
    pub(crate) fn from_client(client: PgClient, max_held: u32) -> Self {
        let max_held = usize::try_from(max_held).unwrap_or(usize::MAX);
        let s = &client.schema;
        let sql = Statements::new(s);
        let releases = ReleaseListener::new(
            "advisory",
            s,
            (*client.pool.connect_options()).clone(),
            client.connect_timeout,
            client.request_timeout,
            client.pooling,
        );
        Self {
            id: BackendId::next(),
            releases,
            max_held,
            slots: Arc::new(Semaphore::new(max_held)),
            held: Arc::new(AtomicUsize::new(0)),
            sql,
            sessions: SessionCheck::default(),
            sweeper: Sweeper::new(&client, NAME, Table::AdvisoryTokens),
            client,
        }
    }

    /// Opens all of the pool's connections now and checks that the tables exist: fails
    /// with [`LockError::Unavailable`] when the server cannot be reached and with
    /// [`LockError::Config`] on a refused login or a database without `setup()`.
    /// Optional: without it, connections open on first use.
    pub async fn connect(&self) -> Result<(), LockError> {
        // The check first: the pool's connections set session limits (see
        // `PgPooling::Session`), which must not be left on server sessions a pooler shares.
        self.check_pooling().await?;
        self.client.warm_up(NAME, "distlock_advisory_tokens").await
    }

    /// Fails with [`LockError::Config`] naming the pooling mode when client connections
    /// do not keep their server sessions (a transaction-pooling proxy). Runs the check
    /// once; a check that could not run is an error and is tried again next time.
    async fn check_pooling(&self) -> Result<(), LockError> {
        self.sessions
            .require_own_sessions(&self.client, NAME, SESSIONS_SHARED)
            .await
    }

    /// Creates the schema and tables if they do not exist. Idempotent; run it once at
    /// deployment or start-up, never implicitly per call.
    pub async fn setup(&self) -> Result<(), LockError> {
        self.client.setup(NAME).await
    }

    /// The advisory-lock key of `key` in this backend's schema.
    pub fn lock_id(&self, key: &LockKey) -> i64 {
        lock_id(&self.client.schema, key)
    }

    /// Fails with [`LockError::ForeignLease`] if any lease of a batch is not this
    /// backend's, before anything is sent.
    fn check_all(&self, leases: &[Lease]) -> Result<(), LockError> {
        leases
            .iter()
            .try_for_each(|lease| lease.check_backend(self.id, NAME))
    }

    async fn current_token(&self, key: &LockKey) -> Result<Option<FencingToken>, LockError> {
        let mut conn = self.client.conn(NAME).await?;
        let token: Option<i64> = on_conn!(
            self.client,
            NAME,
            Operation::Fence,
            conn,
            sqlx::query_scalar(AssertSqlSafe(self.sql.token.clone()))
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
        )?;
        Ok(token.map(token_from))
    }
}

/// A batch's results from one call per item: an item that failed in a way worth trying
/// again ([`LockError::is_retryable`]: no answer, a lost reply) becomes `unreachable` and
/// the others keep their outcome, as a cluster's batch reports a node that did not answer;
/// when every item failed, the batch fails with the first error, as a single call would.
/// Any other error (a [`LockError::Config`] naming a setting to change, say) fails the
/// batch with it, as it fails the single call: it is no store out of reach, and trying
/// again changes nothing.
fn per_item<T>(results: Vec<Result<T, LockError>>, unreachable: T) -> Result<Vec<T>, LockError>
where
    T: Copy,
{
    if results.iter().all(Result::is_err) {
        if let Some(Err(first)) = results.into_iter().next() {
            return Err(first);
        }
        return Ok(Vec::new());
    }
    results
        .into_iter()
        .map(|r| match r {
            Err(e) if e.is_retryable() => Ok(unreachable),
            other => other,
        })
        .collect()
}

impl fmt::Debug for PgAdvisoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgAdvisoryBackend")
            .field("url", &self.client.url)
            .field("schema", &self.client.schema)
            .field("max_held", &self.max_held)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockBackend for PgAdvisoryBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// TTL granularity 1 ms; ownership bound to the session, which the server ends one
    /// TTL after the holder's last call; at most `pool_size` locks held at once.
    fn capabilities(&self) -> Capabilities {
        self.client
            .capabilities()
            .session_bound(true)
            .max_held(Some(self.max_held))
            .inspect(true)
            .wakes_waiters(true)
    }

    /// # Cancel safety
    /// A cancelled acquire closes the connection it was running on, so a lock it may
    /// have taken is freed as soon as the server sees the session end; it never goes back
    /// to the pool with the lock held.
    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        self.sweeper.poke(&self.client);
        self.acquire_sent(key, ttl, Instant::now()).await
    }

    /// One acquire after another, each on its own pinned session; every validity counts
    /// from the batch's start. On an error the leases already taken are released.
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        self.sweeper.poke(&self.client);
        let sent = Instant::now();
        // A lease that cannot be given back after an error frees with its session.
        distlock_core::acquire_each(self, keys, |key| self.acquire_sent(key, ttl, sent)).await
    }

    /// Every lease's check at once, each on its own session, so a session that stops
    /// answering costs the batch one request timeout, not one per such session, and delays
    /// none of the others; every new validity counts from the batch's start. Every lease
    /// is checked to be this backend's before any session is asked. An item whose session
    /// cannot be asked or loses its reply is [`Renewal::Unreachable`] (the watchdog retries
    /// it); when every item fails, the call fails with the first error, and any other
    /// error of an item ([`LockError::Config`], say) fails the call with it.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        self.check_all(leases)?;
        let sent = Instant::now();
        let out = join_all(leases.iter().map(|lease| self.renew_sent(lease, sent))).await;
        per_item(out, Renewal::Unreachable)
    }

    /// Every lease's release at once, each on its own session (see
    /// [`Self::renew_many`]). Every lease is checked to be this backend's before any is
    /// released. An item whose session cannot be asked or loses its reply is
    /// [`Release::Unreachable`]; when every item fails, the call fails with the first
    /// error, and any other error of an item ([`LockError::Config`], say) fails the call
    /// with it.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        self.check_all(leases)?;
        let out = join_all(leases.iter().map(|lease| self.release(lease))).await;
        per_item(out, Release::Unreachable)
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.renew_sent(lease, Instant::now()).await
    }

    /// # Cancel safety
    /// A release cancelled after its statement may have been sent closes the lease's
    /// connection (which frees the lock if the statement did not run) and unpins it: a
    /// clone of the lease then renews as [`Renewal::Lost`], never as held. Its key's
    /// waiters, if any, are not announced: they find the key free at their next backoff
    /// step.
    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        let Some(session) = self.session(lease)? else {
            return Ok(Release::NotHeld);
        };
        let mut slot = session.pinned.lock().await;
        let Some(pinned) = slot.take() else {
            return Ok(Release::NotHeld);
        };
        let mut releasing = Releasing::new(pinned);
        let (class, obj) = self.releases.waiter_id(lease.key());
        let result = self
            .client
            .timed(
                NAME,
                Operation::Release,
                sqlx::query_as::<_, (bool, bool)>(UNLOCK)
                    .bind(session.key)
                    .bind(session.pid)
                    .bind(class)
                    .bind(obj)
                    .fetch_optional(&mut **releasing.conn()),
            )
            .await;
        match result {
            // Unlocked and reset: the connection goes back to the pool.
            Ok(Some((true, waited))) => {
                releasing.give_back();
                if waited {
                    self.releases.announce(lease.key().as_str());
                }
                Ok(Release::Released)
            }
            // Not held: dropping `releasing` closes the session, freeing whatever it held.
            Ok(Some((false, _))) => Ok(Release::NotHeld),
            Ok(None) => {
                // Another server session answered, and nothing was done in it; the
                // connection stays pinned, as in `holds`.
                *slot = releasing.keep();
                Err(session_moved(session.pid, None))
            }
            // The server had ended the session, and with it the lock, before the unlock.
            Err(failed) if failed.session_ended => Ok(Release::NotHeld),
            // Whether the unlock ran is not known from here (a lost reply, a failed
            // connection): an error, not `NotHeld`, which would report a possible overlap.
            // Closing the session frees the lock now if it did not run.
            Err(failed) => Err(failed.error),
        }
    }

    /// Watches `key` through the backend's one `LISTEN` session, which starts with the
    /// first watched key. A release announces itself; a lock freed by its session ending
    /// does not (its waiters take it at their next backoff step). `None` outside a tokio
    /// runtime.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.releases.watch(key)
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.releases.watch_permits(slots)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.releases.watched_keys()
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        if let Some(session) = self.session(lease)? {
            if self.holds(session, Operation::Fence).await? {
                return Ok(Fence::Current);
            }
        }
        let current = self
            .current_token(lease.key())
            .await?
            .unwrap_or(lease.token());
        Ok(Fence::Stale { current })
    }

    /// Deletes the key's token row. Tokens still never go back: the next grant's token is
    /// at least the server's clock in microseconds, past every token issued before. A
    /// session that still holds the advisory lock keeps it (the lock lives in the
    /// session, not in a table); purge only keys nobody holds.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        key_row::purge(&self.client, NAME, &self.sql.purge, key).await
    }

    /// The newest token; while a session holds the lock, its owner id and the time left
    /// until the server ends the session if it stays idle.
    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let (classid, objid) = split(self.lock_id(key));
        let query = Statement::new(&self.sql.inspect)
            .bind(Value::Text(key.as_str()))
            .bind(Value::Int8(classid))
            .bind(Value::Int8(objid));
        key_row::inspect(&self.client, NAME, query).await
    }
}

#[cfg(test)]
mod tests {
    use super::session::Session;
    use super::*;

    /// An advisory backend, set up, on a PostgreSQL server of its own (kept alive by the
    /// returned handle).
    pub(super) async fn on_a_private_server()
    -> (harness::postgres::PostgresServer, PgAdvisoryBackend) {
        on_a_private_server_with(|b| b).await
    }

    /// [`on_a_private_server`] with the builder's settings changed by `settings`.
    async fn on_a_private_server_with(
        settings: impl FnOnce(crate::PgBuilder) -> crate::PgBuilder,
    ) -> (harness::postgres::PostgresServer, PgAdvisoryBackend) {
        let server = harness::require(harness::postgres::PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        let backend = settings(crate::PgBuilder::new(server.url()))
            .build_advisory_backend()
            .unwrap();
        backend.setup().await.unwrap();
        (server, backend)
    }

    /// Stops a server process (`SIGSTOP`) until dropped, as a host that stops answering
    /// would; `SIGCONT` on drop, so a failing test leaves no stopped process behind.
    struct Stopped(i32);

    impl Stopped {
        fn new(pid: i32) -> Self {
            signal(pid, "-STOP");
            Self(pid)
        }
    }

    impl Drop for Stopped {
        fn drop(&mut self) {
            signal(self.0, "-CONT");
        }
    }

    fn signal(pid: i32, which: &str) {
        let status = std::process::Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {which} {pid}");
    }

    /// Sessions that stop answering cost a renewal batch one request timeout in all, not
    /// one each, and the healthy session behind them renews within it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renew_many_asks_every_session_at_once() {
        const TIMEOUT: Duration = Duration::from_secs(1);
        let (_server, backend) = on_a_private_server_with(|b| b.request_timeout(TIMEOUT)).await;
        let ttl = Duration::from_secs(30);
        let mut leases = Vec::new();
        for name in ["stalled:a", "stalled:b", "stalled:c", "healthy"] {
            let key = LockKey::new(name).unwrap();
            leases.push(backend.acquire(&key, ttl).await.unwrap().expect("free"));
        }
        let stopped: Vec<_> = leases[..3]
            .iter()
            .map(|l| Stopped::new(l.handle::<Session>().unwrap().pid))
            .collect();

        let started = Instant::now();
        let renewals = backend.renew_many(&leases).await.unwrap();
        let took = started.elapsed();
        drop(stopped);

        // A session that did not answer within the timeout is given up (its connection
        // is closed, which ends its locks); the healthy one is renewed.
        assert_eq!(renewals[..3], [Renewal::Lost; 3], "{renewals:?}");
        assert!(
            matches!(renewals[3], Renewal::Renewed { .. }),
            "{renewals:?}"
        );
        // One after another, the three stalled sessions would take three timeouts.
        assert!(
            took < TIMEOUT * 2,
            "the batch took {took:?} for request timeouts of {TIMEOUT:?}"
        );
    }

    /// One item of a batch whose session is another than the one that took the lock (as
    /// behind a pooling proxy) fails the renewal and the release batches with the single
    /// call's `Config` error naming the pooling mode, not `Unreachable` (which says "try
    /// again", and would have the watchdog retry a setting that stays wrong).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_config_error_of_one_item_fails_the_batch() {
        let (_server, backend) = on_a_private_server().await;
        let ttl = Duration::from_secs(30);
        let [a, b, c] = ["batch:a", "batch:b", "batch:c"].map(|k| LockKey::new(k).unwrap());
        let a = backend.acquire(&a, ttl).await.unwrap().expect("free");
        let b = backend.acquire(&b, ttl).await.unwrap().expect("free");
        let c = backend.acquire(&c, ttl).await.unwrap().expect("free");
        let (sb, sc) = (
            b.handle::<Session>().unwrap(),
            c.handle::<Session>().unwrap(),
        );
        std::mem::swap(&mut *sb.pinned.lock().await, &mut *sc.pinned.lock().await);

        let names_the_mode = |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pool_mode = transaction"));
        let err = backend
            .renew_many(&[b.clone(), a.clone()])
            .await
            .unwrap_err();
        assert!(names_the_mode(&err), "{err:?}");
        let err = backend
            .release_many(&[a.clone(), b.clone()])
            .await
            .unwrap_err();
        assert!(names_the_mode(&err), "{err:?}");

        std::mem::swap(&mut *sb.pinned.lock().await, &mut *sc.pinned.lock().await);
        assert_eq!(
            backend.release_many(&[b, c]).await.unwrap(),
            [Release::Released; 2]
        );
        // The failed release batch still released the item whose session answered.
        assert_eq!(backend.renew(&a).await.unwrap(), Renewal::Lost);
    }

    /// A batch item that fails in a way worth trying again (no connection, a lost reply)
    /// is `Unreachable` and the others keep their outcome; any other error fails the batch.
    #[test]
    fn a_retryable_item_error_is_unreachable_and_others_keep_theirs() {
        let renewed = Renewal::Renewed {
            valid_until: Instant::now(),
        };
        let out = per_item(
            vec![
                Err(LockError::unavailable(NAME, "connection reset")),
                Ok(renewed),
            ],
            Renewal::Unreachable,
        )
        .unwrap();
        assert_eq!(out, [Renewal::Unreachable, renewed]);
        let err = per_item(
            vec![Ok(renewed), Err(LockError::Config("wrong".into()))],
            Renewal::Unreachable,
        )
        .unwrap_err();
        assert!(matches!(err, LockError::Config(_)));
    }

    /// A session that holds a lock and goes back to the pool anyway (as behind a pooling
    /// proxy that hands one server session to several clients) is never used to grant
    /// its key again: advisory locks are reentrant, so a try on that session would
    /// succeed while the first lease is held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pooled_session_that_holds_a_lock_grants_nothing() {
        let (_server, backend) = on_a_private_server_with(|b| b.pool_size(1)).await;
        let ttl = Duration::from_secs(30);
        let key = LockKey::new("leaked").unwrap();
        let first = backend.acquire(&key, ttl).await.unwrap().expect("free");
        let session = first.handle::<Session>().unwrap();
        // Its connection goes back to the pool with the lock held.
        let pinned = session.pinned.lock().await.take().expect("pinned");
        drop(pinned);
        // Both of the pool's connections taken; the leaked one given back, so the next
        // attempt runs on it.
        let mut conns = Vec::new();
        for _ in 0..2 {
            let mut conn = backend.client.pool.acquire().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            conns.push((pid, conn));
        }
        conns.retain(|(pid, _)| *pid != session.pid);
        assert_eq!(conns.len(), 1, "the pool holds the leaked session");
        match backend.acquire(&key, ttl).await {
            Ok(Some(again)) => panic!(
                "granted again ({}) while {} holds it",
                again.token(),
                first.token()
            ),
            Err(LockError::Unavailable { message, .. }) => {
                assert!(message.contains("distlock.holds"), "{message}");
            }
            other => panic!("the leaked session was not refused: {other:?}"),
        }
        drop(conns);
        // Closing it ended its lock: the key is free again.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let again = loop {
            if let Some(l) = backend.acquire(&key, ttl).await.unwrap() {
                break l;
            }
            assert!(tokio::time::Instant::now() < deadline, "never freed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(again.token() > first.token());
    }
}
