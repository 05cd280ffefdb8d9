//! [`PgAdvisoryBackend`]: session-level advisory locks (`pg_try_advisory_lock`) on a
//! connection pinned to the lease until it is released.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use lock_api::wake::ReleaseWatch;
use lock_api::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal, valid_until,
};
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Postgres};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::client::{PgClient, on_conn, owner_uuid, token_from, ttl_ms, with_clock};
use crate::error::Operation;
use crate::key_row;
use crate::releases::{ReleaseListener, channel};
use crate::schema::Schema;

const NAME: &str = "postgres-advisory";

/// How many keepalive probes go unanswered before the server drops a session.
const KEEPALIVE_PROBES: i64 = 3;

/// The statements, with the schema name filled in once.
struct Statements {
    acquire: Arc<str>,
    token: Arc<str>,
    inspect: Arc<str>,
    purge: Arc<str>,
}

/// Checks that this session holds the advisory lock `(classid, objid)` of a bigint key.
/// Also returns the server session's pid, which must be the one that took the lock.
/// Reads `pg_locks`, which takes every lock-manager partition lock: `fence` only.
const HOLDS: &str = "SELECT pg_backend_pid() AS pid, EXISTS (SELECT 1 FROM pg_locks \
     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
       AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1)";

/// The renewal's check: the server session that took the lock still answers. A
/// session-level advisory lock lasts until it is unlocked or its session ends, and on a
/// pinned session nothing but `release` (which unpins it) unlocks, so the live session
/// with the pid that took the lock is the proof. `pg_locks`, whose cost grows with every
/// lock on the server, is not read once per held lock per renewal.
const ALIVE: &str = "SELECT pg_backend_pid() AS pid, true";

/// Unlocks, drops any other advisory lock the session may hold (none, by the acquire's
/// check), and resets the session's time limits (`set_config` with a NULL value is
/// `RESET`), so they are again whatever the server, database or role says and the
/// connection can serve the pool again. The CTE runs the unlock of this key first, and
/// only in the server session that took the lock (pid `$2`): in any other session the
/// statement does nothing and returns no row.
/// When the key was unlocked, it notifies the backend's release channel (`$3`) with the
/// name (`$4`), which goes out as the statement ends.
const UNLOCK: &str = "WITH u AS (SELECT pg_advisory_unlock($1) AS released \
                WHERE pg_backend_pid() = $2), \
     n AS (SELECT pg_notify($3, $4) FROM u WHERE u.released) \
     SELECT u.released, (SELECT count(*) FROM n), pg_advisory_unlock_all(), \
     set_config('idle_session_timeout', NULL, false), \
     set_config('tcp_user_timeout', NULL, false), \
     set_config('tcp_keepalives_idle', NULL, false), \
     set_config('tcp_keepalives_interval', NULL, false), \
     set_config('tcp_keepalives_count', NULL, false) \
     FROM u";

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
/// - **Waiters.** The release statement also notifies the backend's channel with the
///   name (`pg_notify`), which wakes a waiter in [`lock_api::Locker::lock`] in every
///   process that listens (one `LISTEN` session per backend, opened with the first waiter;
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
/// shorter [`lock_api::LockerBuilder::renew_interval`] narrows it, each renewal being one
/// `SELECT pg_backend_pid()` on the pinned session). Guard writes downstream with the
/// fencing token, which refuses the old holder once the new one has written.
///
/// # Not behind a transaction-pooling proxy
///
/// Session locks need the session: behind PgBouncer in `transaction` (or `statement`)
/// pooling mode, consecutive statements run on different server sessions, so locks leak
/// to other clients and checks see the wrong session. Connect directly or through a
/// `session`-mode pool. The backend notices: acquire refuses a server session that
/// already holds advisory locks, and renew, fence and release compare the server
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
pub struct PgAdvisoryBackend {
    id: BackendId,
    client: PgClient,
    max_held: usize,
    /// Connections in use for locks: held ones and attempts in flight.
    slots: Arc<Semaphore>,
    /// Locks held right now, so a full backend fails at once instead of waiting.
    held: Arc<AtomicUsize>,
    sql: Statements,
    pub(crate) releases: ReleaseListener,
}

/// The private handle of an advisory lease: the pinned session, while it is pinned.
struct Session {
    key: i64,
    /// The server session (`pg_backend_pid()`) that took the lock.
    pid: i32,
    owner: OwnerId,
    token: FencingToken,
    pinned: Mutex<Option<Pinned>>,
}

/// A connection pinned to a held lock, with the capacity it takes up; both are given
/// back when it is taken out of its [`Session`] (release, or loss found).
struct Pinned {
    conn: PoolConnection<Postgres>,
    _slot: OwnedSemaphorePermit,
    _held: Held,
}

/// A connection while an acquire runs on it, closed on drop unless the acquire finished.
/// Once its statement is sent, an acquire may take the lock even when the caller's future
/// is then dropped or the reply is lost, and a session lock outlives the statement: such
/// a connection must never go back to the pool, where it would keep holding the lock.
struct Attempt<'a> {
    conn: &'a mut PoolConnection<Postgres>,
    finished: bool,
}

impl Attempt<'_> {
    /// The statement completed and its result is in hand: the connection is either about
    /// to be pinned to the new lease or, lock not taken, clean for the pool.
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

/// Counts one held lock while it lives.
struct Held(Arc<AtomicUsize>);

impl Held {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Still pinned: the lease was dropped without release. Closing the session frees
        // the lock; returning it to the pool would leak the lock to the next user.
        if let Some(pinned) = self.pinned.get_mut().as_mut() {
            pinned.conn.close_on_drop();
        }
    }
}

impl PgAdvisoryBackend {
    /// Settings for the server at `url`; see [`crate::PgBuilder`].
    pub fn builder(url: impl Into<String>) -> crate::PgBuilder {
        crate::PgBuilder::new(url)
    }

    pub(crate) fn from_client(client: PgClient, max_held: u32) -> Self {
        let max_held = usize::try_from(max_held).unwrap_or(usize::MAX);
        let s = &client.schema;
        let sql = Statements {
            // The CTEs hold volatile calls, so each is evaluated exactly once, in the
            // order they read each other: first the advisory locks this session already
            // holds (a pooled session must hold none, so that it holds exactly one after
            // the acquire and one unlock frees the key), then the try; the session
            // settings and the token bump only happen when the lock was taken.
            acquire: s.sql(&with_clock(
                "WITH pre AS (SELECT count(*) AS held FROM pg_locks \
                               WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
                 l AS (SELECT pre.held, \
                              CASE WHEN pre.held = 0 THEN pg_try_advisory_lock($1) \
                                   ELSE false END AS ok \
                         FROM pre), \
                 cfg AS (SELECT set_config('idle_session_timeout', $3, false), \
                                set_config('tcp_user_timeout', $3, false), \
                                set_config('tcp_keepalives_idle', $4, false), \
                                set_config('tcp_keepalives_interval', $4, false), \
                                set_config('tcp_keepalives_count', $5, false) \
                           FROM l WHERE l.ok), \
                 bumped AS (INSERT INTO {s}.distlock_advisory_tokens AS t \
                                   (name, token, owner, ttl_ms) \
                            SELECT $2, {clock_us}, $6, $7 FROM l, cfg WHERE l.ok \
                            ON CONFLICT (name) DO UPDATE \
                               SET token = greatest(t.token + 1, {clock_us}), \
                                   owner = EXCLUDED.owner, ttl_ms = EXCLUDED.ttl_ms \
                            RETURNING token) \
                 SELECT l.held, pg_backend_pid() AS pid, \
                        (SELECT token FROM bumped) AS token \
                   FROM l",
            )),
            token: s.sql("SELECT token FROM {s}.distlock_advisory_tokens WHERE name = $1"),
            // The holder's remaining time is its idle-session budget: the TTL minus the
            // time since its session's last state change.
            inspect: s.sql(
                "SELECT t.token, t.owner, \
                        (SELECT greatest(1, (extract(epoch FROM a.state_change - clock_timestamp()) \
                                             * 1000000)::bigint + t.ttl_ms * 1000) \
                           FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid \
                          WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 1 \
                            AND k.classid = $2::bigint::oid AND k.objid = $3::bigint::oid \
                            AND k.database = (SELECT oid FROM pg_database \
                                               WHERE datname = current_database()) \
                          LIMIT 1) AS remaining_us \
                   FROM {s}.distlock_advisory_tokens t WHERE t.name = $1",
            ),
            purge: s.sql("DELETE FROM {s}.distlock_advisory_tokens WHERE name = $1"),
        };
        let releases = ReleaseListener::new(
            channel("advisory", s),
            (*client.pool.connect_options()).clone(),
            client.connect_timeout,
        );
        Self {
            id: BackendId::next(),
            client,
            releases,
            max_held,
            slots: Arc::new(Semaphore::new(max_held)),
            held: Arc::new(AtomicUsize::new(0)),
            sql,
        }
    }

    /// Opens all of the pool's connections now and checks that the tables exist: fails
    /// with [`LockError::Unavailable`] when the server cannot be reached and with
    /// [`LockError::Config`] on a refused login or a database without `setup()`.
    /// Optional: without it, connections open on first use.
    pub async fn connect(&self) -> Result<(), LockError> {
        self.client.warm_up(NAME, "distlock_advisory_tokens").await
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

    /// The session of a lease granted by this backend; `None` for a lease that does not
    /// carry this acquisition's session (another owner or token), which holds nothing.
    fn session<'a>(&self, lease: &'a Lease) -> Result<Option<&'a Session>, LockError> {
        lease.check_backend(self.id, NAME)?;
        Ok(lease
            .handle::<Session>()
            .filter(|s| s.owner == lease.owner() && s.token == lease.token()))
    }

    /// Fails with [`LockError::ForeignLease`] if any lease of a batch is not this
    /// backend's, before anything is sent.
    fn check_all(&self, leases: &[Lease]) -> Result<(), LockError> {
        leases
            .iter()
            .try_for_each(|lease| lease.check_backend(self.id, NAME))
    }

    fn exhausted(&self) -> LockError {
        LockError::unavailable(
            NAME,
            format!(
                "all {} lock slots are in use: each held advisory lock pins one of the \
                 pool's connections; release a lock or raise pool_size",
                self.max_held
            ),
        )
    }

    /// Acquires with the validity counted from `sent` (taken before anything was sent).
    async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        if self.held.load(Ordering::SeqCst) >= self.max_held {
            return Err(self.exhausted());
        }
        // Attempts in flight finish quickly; wait for one of them, not for a lock holder.
        let slot = tokio::time::timeout(
            self.client.connect_timeout,
            self.slots.clone().acquire_owned(),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| self.exhausted())?;
        let id = self.lock_id(key);
        let ms = ttl_ms(ttl);
        // Keepalive probes start after a third of the TTL and give up after about one TTL.
        let keepalive_secs = (ms / 1000 / (KEEPALIVE_PROBES + 1)).max(1);
        let owner = OwnerId::random();
        let mut conn = self.client.conn(NAME).await?;
        let attempt = Attempt {
            conn: &mut conn,
            finished: false,
        };
        let (held_before, pid, token): (i64, i32, Option<i64>) = self
            .client
            .timed(
                NAME,
                Operation::Acquire,
                sqlx::query_as(AssertSqlSafe(self.sql.acquire.clone()))
                    .bind(id)
                    .bind(key.as_str())
                    .bind(ms.to_string())
                    .bind(keepalive_secs.to_string())
                    .bind(KEEPALIVE_PROBES.to_string())
                    .bind(owner_uuid(owner))
                    .bind(ms)
                    .fetch_one(&mut **attempt.conn),
            )
            .await
            .map_err(|failed| failed.error)?;
        if held_before != 0 {
            // Dropping the attempt closes the session, and so frees what it held.
            return Err(LockError::unavailable(
                NAME,
                format!(
                    "the pooled session already held {held_before} advisory lock(s) that this \
                     backend did not take; it was closed. Behind a transaction-pooling proxy \
                     (PgBouncer pool_mode = transaction or statement) advisory locks cannot work"
                ),
            ));
        }
        attempt.finish();
        let Some(token) = token else {
            return Ok(None);
        };
        let token = token_from(token);
        let session = Session {
            key: id,
            pid,
            owner,
            token,
            pinned: Mutex::new(Some(Pinned {
                conn,
                _slot: slot,
                _held: Held::new(&self.held),
            })),
        };
        let lease = Lease::new(
            self.id,
            key.clone(),
            owner,
            token,
            ttl,
            valid_until(sent, ttl),
        );
        Ok(Some(lease.with_handle(Arc::new(session))))
    }

    /// Renews with the validity counted from `sent`.
    async fn renew_sent(&self, lease: &Lease, sent: Instant) -> Result<Renewal, LockError> {
        let Some(session) = self.session(lease)? else {
            return Ok(Renewal::Lost);
        };
        Ok(if self.holds(session, Operation::Renew).await? {
            Renewal::Renewed {
                valid_until: valid_until(sent, lease.ttl()),
            }
        } else {
            Renewal::Lost
        })
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

    /// Whether the pinned session still holds the lock; `None` when the session is gone
    /// (and then the connection has been dropped, closing it).
    async fn holds(&self, session: &Session, op: Operation) -> Result<bool, LockError> {
        let mut slot = session.pinned.lock().await;
        let Some(pinned) = slot.as_mut() else {
            return Ok(false);
        };
        let (classid, objid) = split(session.key);
        let result = self
            .client
            .timed(
                NAME,
                op,
                if op == Operation::Renew {
                    sqlx::query_as::<_, (i32, bool)>(ALIVE)
                } else {
                    sqlx::query_as::<_, (i32, bool)>(HOLDS)
                        .bind(classid)
                        .bind(objid)
                }
                .fetch_one(&mut *pinned.conn),
            )
            .await;
        match result {
            // Left pinned: closing this client connection would not end the proxy's
            // server sessions, and a lease dropped later closes it anyway.
            Ok((pid, _)) if pid != session.pid => Err(session_moved(session.pid, Some(pid))),
            Ok((_, true)) => Ok(true),
            Ok((_, false)) => {
                // Nothing else unlocks on this session; unpin it rather than trust it.
                unpin(&mut slot);
                Ok(false)
            }
            Err(failed) if failed.broken => {
                // The session is gone or unusable, and with it the lock.
                unpin(&mut slot);
                Ok(false)
            }
            Err(failed) => Err(failed.error),
        }
    }
}

/// The error for a lease whose connection no longer reaches the server session that took
/// its lock (`now`, when known): only a proxy that pools server sessions per transaction
/// or statement does that.
fn session_moved(took: i32, now: Option<i32>) -> LockError {
    let now = now.map_or_else(
        || "another server session".to_owned(),
        |p| format!("server session {p}"),
    );
    LockError::Config(format!(
        "the advisory lock was taken by server session {took}, but its connection now \
         reaches {now}: a transaction-pooling proxy (PgBouncer pool_mode = transaction or \
         statement) is between client and server. Advisory locks need the session: \
         connect directly or through a session-mode pool"
    ))
}

/// A batch's results from one call per item: a failed item becomes `unreachable` and the
/// others keep their outcome, as a cluster's batch reports a node that did not answer;
/// when every item failed, the batch fails with the first error, as a single call would.
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
    Ok(results
        .into_iter()
        .map(|r| r.unwrap_or(unreachable))
        .collect())
}

/// Takes the pinned connection out of its session and closes it, which ends the server
/// session and so frees any lock it still holds.
fn unpin(slot: &mut Option<Pinned>) {
    if let Some(mut pinned) = slot.take() {
        pinned.conn.close_on_drop();
    }
}

/// `(classid, objid)` of a bigint advisory key, as `pg_locks` shows them.
fn split(key: i64) -> (i64, i64) {
    let bits = key as u64;
    ((bits >> 32) as i64, (bits & 0xffff_ffff) as i64)
}

/// The first 8 bytes of SHA-256 of `distlock:<schema>:<name>`, big-endian.
pub(crate) fn lock_id(schema: &Schema, key: &LockKey) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"distlock:")
        .chain_update(schema.as_str().as_bytes())
        .chain_update(b":")
        .chain_update(key.as_str().as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
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
        let sent = Instant::now();
        let mut out: Vec<Option<Lease>> = Vec::with_capacity(keys.len());
        for key in keys {
            match self.acquire_sent(key, ttl, sent).await {
                Ok(lease) => out.push(lease),
                Err(e) => {
                    let taken: Vec<Lease> = out.into_iter().flatten().collect();
                    // Best effort: a lease that cannot be released frees with its session.
                    let _ = self.release_many(&taken).await;
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// One check after another, each on its lease's session; every new validity counts
    /// from the batch's start. Every lease is checked to be this backend's before any
    /// session is asked. An item whose session answers with an error is
    /// [`Renewal::Unreachable`] (the watchdog retries it); only when every item fails
    /// does the call fail, with the first error.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        self.check_all(leases)?;
        let sent = Instant::now();
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(self.renew_sent(lease, sent).await);
        }
        per_item(out, Renewal::Unreachable)
    }

    /// One release after another, each on its lease's session. Every lease is checked to
    /// be this backend's before any is released. An item whose release fails is
    /// [`Release::Unreachable`]; only when every item fails does the call fail, with the
    /// first error.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        self.check_all(leases)?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(self.release(lease).await);
        }
        per_item(out, Release::Unreachable)
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.renew_sent(lease, Instant::now()).await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        let Some(session) = self.session(lease)? else {
            return Ok(Release::NotHeld);
        };
        let mut slot = session.pinned.lock().await;
        let Some(pinned) = slot.as_mut() else {
            return Ok(Release::NotHeld);
        };
        let result = self
            .client
            .timed(
                NAME,
                Operation::Release,
                sqlx::query_scalar::<_, bool>(UNLOCK)
                    .bind(session.key)
                    .bind(session.pid)
                    .bind(self.releases.channel())
                    .bind(lease.key().as_str())
                    .fetch_optional(&mut *pinned.conn),
            )
            .await;
        if let Ok(None) = result {
            // Another server session answered, and nothing was done in it; the connection
            // stays pinned, as in `holds`.
            return Err(session_moved(session.pid, None));
        }
        if result
            .as_ref()
            .is_ok_and(|unlocked| *unlocked == Some(true))
        {
            // Unlocked and reset: the connection goes back to the pool.
            slot.take();
            Ok(Release::Released)
        } else {
            // Not held, or the session is gone: closing it frees whatever it held.
            unpin(&mut slot);
            Ok(Release::NotHeld)
        }
    }

    /// Watches `key` through the backend's one `LISTEN` session, which starts with the
    /// first watched key. A release announces itself; a lock freed by its session ending
    /// does not (its waiters take it at their next backoff step). `None` outside a tokio
    /// runtime.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.releases.watch(key)
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
        let query = sqlx::query(AssertSqlSafe(self.sql.inspect.clone()))
            .bind(key.as_str())
            .bind(classid)
            .bind(objid);
        key_row::inspect(&self.client, NAME, query).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_stable_and_namespaced() {
        let a = Schema::new("distlock").unwrap();
        let b = Schema::new("other").unwrap();
        let key = LockKey::new("payout:42").unwrap();
        // SHA-256("distlock:distlock:payout:42"), first 8 bytes, big-endian.
        let digest = Sha256::digest(b"distlock:distlock:payout:42");
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(lock_id(&a, &key), expected);
        assert_ne!(lock_id(&a, &key), lock_id(&b, &key));
    }

    #[test]
    fn keys_split_into_classid_and_objid() {
        assert_eq!(split(0x0000_0001_0000_0002), (1, 2));
        assert_eq!(split(-1), (0xffff_ffff, 0xffff_ffff));
    }

    /// Behind a transaction-pooling proxy a lease's connection reaches whichever server
    /// session the proxy picks. Swapping two leases' pinned connections does exactly
    /// that, on a real server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_answered_by_another_server_session_names_the_pooling_proxy() {
        use harness::postgres::PostgresServer;

        let server = harness::require(PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        let backend = crate::PgBuilder::new(server.url())
            .build_advisory_backend()
            .unwrap();
        backend.setup().await.unwrap();
        let ttl = Duration::from_secs(30);
        let (ka, kb) = (
            LockKey::new("pooled:a").unwrap(),
            LockKey::new("pooled:b").unwrap(),
        );
        let a = backend.acquire(&ka, ttl).await.unwrap().expect("free");
        let b = backend.acquire(&kb, ttl).await.unwrap().expect("free");
        let (sa, sb) = (
            a.handle::<Session>().unwrap(),
            b.handle::<Session>().unwrap(),
        );
        std::mem::swap(&mut *sa.pinned.lock().await, &mut *sb.pinned.lock().await);

        let names_the_pooler = |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pool_mode = transaction"));
        let err = backend.renew(&a).await.unwrap_err();
        assert!(names_the_pooler(&err), "{err}");
        let err = backend.release(&b).await.unwrap_err();
        assert!(names_the_pooler(&err), "{err}");
        // Nothing ran in the wrong sessions: `b`'s release did not unlock (or unlock all
        // of) the session holding `a`, so both keys are still held.
        assert_eq!(backend.inspect(&ka).await.unwrap().owner, Some(a.owner()));
        assert_eq!(backend.inspect(&kb).await.unwrap().owner, Some(b.owner()));
    }

    /// One item of a renewal batch whose session answers with an error (here: another
    /// server session answers, as behind a pooling proxy) is `Unreachable`; the others
    /// are renewed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renew_many_reports_a_failing_item_as_unreachable_and_renews_the_rest() {
        use harness::postgres::PostgresServer;

        let server = harness::require(PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        let backend = crate::PgBuilder::new(server.url())
            .build_advisory_backend()
            .unwrap();
        backend.setup().await.unwrap();
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

        let renewals = backend.renew_many(&[b.clone(), a.clone()]).await.unwrap();
        assert_eq!(renewals[0], Renewal::Unreachable, "{renewals:?}");
        assert!(
            matches!(renewals[1], Renewal::Renewed { .. }),
            "{renewals:?}"
        );

        std::mem::swap(&mut *sb.pinned.lock().await, &mut *sc.pinned.lock().await);
        assert_eq!(
            backend.release_many(&[a, b, c]).await.unwrap(),
            [Release::Released; 3]
        );
    }
}
