//! [`PgLeaseBackend`]: one row per lock name in `<schema>.distlock_leases`, taken and
//! checked with single statements on the server's clock. No connection stays pinned.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, Fence, Lease, LockBackend, LockError, LockInfo, LockKey, OwnerId,
    Release, Renewal, valid_until,
};
use sqlx::Row;
use sqlx::postgres::{PgQueryResult, PgRow};
use tokio::time::Instant;
use tracing::warn;
use uuid::Uuid;

use crate::client::{PgClient, on_conn, owner_uuid, token_from, token_i64, ttl_ms};
use crate::error::Operation;
use crate::key_row;
use crate::pooling::PgPooling;
use crate::releases::ReleaseListener;
use crate::retention::{Sweeper, Table};
use crate::session_check::SessionCheck;
use crate::statement::{Statement, Value};

mod statements;

use self::statements::Statements;

const NAME: &str = "postgres-lease";

/// The most names one `release_many` statement releases. Each released name takes a
/// transaction-level advisory lock until the statement commits (the waiters' check,
/// [`crate::waiters`]), and those locks share PostgreSQL's lock table with every session
/// of the server: `max_locks_per_transaction` (64 by default) times the connection slots,
/// about 7,800 entries on a default server, plus spare shared memory. A larger batch is
/// released this many names per statement, so one call never holds more of the table.
const RELEASE_STATEMENT_NAMES: usize = 500;

/// Why every call is refused once the pooling check found, with the default
/// [`PgPooling::Session`], that client connections do not keep their server sessions: the
/// lease table's part of the refusal.
const SESSIONS_SHARED: &str = "where the lease table's prepared statements could run in \
     other clients' sessions: set pooling=transaction in the URL \
     (PgBuilder::pooling(PgPooling::Transaction)), or connect directly or through a \
     session-mode pool (pool_mode = session)";

/// PostgreSQL lease-table backend: one row per lock name in `<schema>.distlock_leases`,
/// taken and checked with single statements on the server's clock. No connection stays
/// pinned.
///
/// # How it works
///
/// - **acquire** is one upsert: it inserts the row, or takes it over only when it is free
///   (`owner IS NULL`) or expired (`expires_at <= statement_timestamp()`), bumping the
///   token either way. The new token is `greatest(token + 1, server clock in µs)`, so a
///   row that lost its last updates (asynchronous commit, failover to a lagging replica)
///   or was deleted never issues a token twice, as long as the server's clock does not go back. An
///   attempt on a name its snapshot shows held inserts nothing and locks nothing: a
///   refused attempt writes no WAL, commits nothing durable and never waits for the
///   holder's row.
/// - **renew** and **release** match name, owner *and* token, and only while
///   `expires_at > statement_timestamp()`: an expired lease is never brought back, even
///   by its owner.
/// - **release** clears the owner and keeps the row, so the next token is still higher;
///   free rows are deleted once their token is older than the
///   [token retention](crate::PgBuilder::token_retention) (24 h by default).
///   When some process waits for the key (its release listener registered the key; see
///   [`LockBackend::watch_releases`]), the statement says so, and once it committed the
///   backend's announcer notifies the backend's channel with the name (`pg_notify`, many
///   names in one transaction), which wakes a waiter in [`distlock_core::Locker::lock`]
///   in every process that listens. The release's own transaction never notifies, so it
///   never waits for PostgreSQL's cluster-wide notify lock. A lease that runs out is not
///   announced: waiters take it at their next backoff step.
///
/// Expiry uses the server's clock only, read when the statement starts
/// (`statement_timestamp()`, not `now()`: through a transaction pooler each statement runs
/// in a transaction of its own, and `now()` would be the time of its `BEGIN`, a round trip
/// or two before: a renew could then bring back a lease that expired meanwhile). The
/// client's own deadline ([`Lease::valid_until`]) is counted from the instant the request
/// was sent, so it always ends before the server's.
///
/// TTLs are whole milliseconds. Tokens survive server restarts (the table is durable).
///
/// # Behind a transaction-pooling proxy
///
/// With [`PgPooling::Transaction`] (`?pooling=transaction`) the backend works behind
/// PgBouncer in `pool_mode = transaction`: every statement runs unnamed inside a
/// transaction of its own (see [`PgPooling::Transaction`]), which the server ends when it
/// waits on the client, or a statement of it runs, for longer than the request time limit,
/// and no session state is used; its releases do not wake this process's waiters (they poll with their backoff). With
/// the default [`PgPooling::Session`] it checks before its first call (or in
/// [`connect`](Self::connect)) that client connections keep their server sessions, and
/// fails every call with [`LockError::Config`] naming `pooling=transaction` when they do
/// not: its prepared statements could otherwise run in another client's session.
///
/// Call [`PgLeaseBackend::setup`] once per database (idempotent) before using it; calls on
/// a database without the tables fail with [`LockError::Config`] naming `setup()`.
pub struct PgLeaseBackend {
    id: BackendId,
    client: PgClient,
    sql: Statements,
    sweeper: Sweeper,
    /// The pooling check, run with [`PgPooling::Session`] only.
    sessions: SessionCheck,
    pub(crate) releases: ReleaseListener,
}

impl PgLeaseBackend {
    pub(crate) fn from_client(client: PgClient) -> Self {
        let s = &client.schema;
        let sql = Statements::new(s);
        let releases = ReleaseListener::new(
            "lease",
            s,
            (*client.pool.connect_options()).clone(),
            client.connect_timeout,
            client.request_timeout,
            client.pooling,
        );
        if client.pooling == PgPooling::Transaction {
            warn!(
                schema = %client.schema,
                "pooling=transaction: releases do not wake this process's waiters (LISTEN \
                 needs a server session of its own); waiters poll with their backoff"
            );
        }
        Self {
            id: BackendId::next(),
            sweeper: Sweeper::new(&client, NAME, Table::Leases),
            client,
            sql,
            sessions: SessionCheck::default(),
            releases,
        }
    }

    /// With [`PgPooling::Session`], fails with [`LockError::Config`] naming
    /// `pooling=transaction` when client connections do not keep their server sessions.
    /// Runs the check once; a check that could not run is an error and is tried again
    /// next time.
    async fn check_pooling(&self) -> Result<(), LockError> {
        if self.client.pooling == PgPooling::Transaction {
            return Ok(());
        }
        self.sessions
            .require_own_sessions(&self.client, NAME, SESSIONS_SHARED)
            .await
    }

    /// Opens all of the pool's connections now and checks that the tables exist: fails
    /// with [`LockError::Unavailable`] when the server cannot be reached and with
    /// [`LockError::Config`] on a refused login, a database without `setup()`, or (with
    /// the default [`PgPooling::Session`]) connections that do not keep their server
    /// sessions. Optional: without it, connections open on first use.
    ///
    /// # Cancel safety
    /// Cancel safe: it changes nothing in the store; a cancelled call leaves some
    /// connections opened, or none.
    pub async fn connect(&self) -> Result<(), LockError> {
        // The check first: the pool's connections set session limits with the default
        // pooling, which must not be left on server sessions a pooler shares.
        self.check_pooling().await?;
        self.client.warm_up(NAME, "distlock_leases").await
    }

    /// Creates the schema and tables if they do not exist. Idempotent; run it once at
    /// deployment or start-up, never implicitly per call. Works with either pooling: it
    /// runs in one transaction, with unnamed statements.
    ///
    /// # Cancel safety
    /// A cancelled setup rolls back: nothing or everything is created.
    pub async fn setup(&self) -> Result<(), LockError> {
        self.client.setup(NAME).await
    }

    /// The pool, for sharing with [`crate::PgFencedResource`] or the application. Its
    /// connections send no `extra_float_digits` (PgBouncer refuses it unless told to
    /// ignore it): floating-point values a simple query returns as text come at the
    /// server's default precision, which is exact from PostgreSQL 12 on.
    ///
    /// With the default [`PgPooling::Session`] each of its connections has the server
    /// bound its statements and its transactions' waits on the client by the request time
    /// limit (`statement_timeout`, `idle_in_transaction_session_timeout`; see
    /// [`PgPooling::Session`]). An application statement or transaction that needs longer
    /// sets its own in its transaction (`SET LOCAL statement_timeout = ...`).
    ///
    /// With [`PgPooling::Transaction`] its connections go through a transaction pooler:
    /// [`crate::PgFencedResource`] and [`crate::IdempotencyKeys`] work there; the
    /// application's own statements on it must not be cached under a name
    /// (`.persistent(false)`) and must run inside a transaction, as theirs do.
    pub fn pool(&self) -> &sqlx::PgPool {
        &self.client.pool
    }

    /// The validated schema name.
    pub fn schema(&self) -> &str {
        self.client.schema.as_str()
    }

    fn check(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_backend(self.id, NAME)
    }

    /// The error for a reply whose row could not be read.
    fn decode(&self, op: Operation, e: sqlx::Error) -> LockError {
        crate::error::from_sqlx(NAME, op, &self.client.schema, e)
    }

    /// The row (if any) of the acquire statement `sql` taking `names` (one name or a list)
    /// as `owner` for `ttl`.
    async fn acquire_row(
        &self,
        sql: &Arc<str>,
        names: Value<'_>,
        owner: OwnerId,
        ttl: Duration,
    ) -> Result<Option<PgRow>, LockError> {
        let statement = Statement::new(sql)
            .bind(names)
            .bind(Value::Uuid(owner_uuid(owner)))
            .bind(Value::Int8(ttl_ms(ttl)));
        self.client
            .send::<Option<PgRow>>(NAME, Operation::Acquire, statement)
            .await
    }

    /// Runs a batch UPDATE over `leases` (owner- and token-checked) and returns, per lease,
    /// whether its row was updated. A lease listed twice is released once, as two single
    /// calls in a row would (the second finds it already released), and renewed twice.
    ///
    /// A renewal is one statement whatever its size; a release is one statement per
    /// [`RELEASE_STATEMENT_NAMES`] names, in name order, one after another on one
    /// connection. When one of them fails, the names of those before it stay released and
    /// the call returns the error, as releasing them one by one would.
    async fn update_many(
        &self,
        op: Operation,
        sql: &Arc<str>,
        leases: &[Lease],
    ) -> Result<Vec<bool>, LockError> {
        for lease in leases {
            self.check(lease)?;
        }
        self.check_pooling().await?;
        // Sent sorted by name, so concurrent batches lock rows in the same order and cannot
        // deadlock (as `acquire_many` does).
        let mut sorted: Vec<&Lease> = leases.iter().collect();
        sorted.sort_by(|a, b| a.key().as_str().cmp(b.key().as_str()));
        let per_statement = match op {
            Operation::Release => RELEASE_STATEMENT_NAMES,
            _ => sorted.len().max(1),
        };
        let mut conn = self.client.conn(NAME).await?;
        let mut updated = HashSet::with_capacity(sorted.len());
        for part in sorted.chunks(per_statement) {
            let names: Vec<&str> = part.iter().map(|l| l.key().as_str()).collect();
            let owners: Vec<Uuid> = part.iter().map(|l| owner_uuid(l.owner())).collect();
            let tokens: Vec<i64> = part.iter().map(|l| token_i64(l.token())).collect();
            let mut query = Statement::new(sql)
                .bind(Value::Texts(names))
                .bind(Value::Uuids(owners))
                .bind(Value::Int8s(tokens));
            if op == Operation::Renew {
                let ttls: Vec<i64> = part.iter().map(|l| ttl_ms(l.ttl())).collect();
                query = query.bind(Value::Int8s(ttls));
            } else {
                let (classes, objs): (Vec<i32>, Vec<i32>) = part
                    .iter()
                    .map(|l| self.releases.waiter_id(l.key()))
                    .unzip();
                query = query.bind(Value::Int4s(classes)).bind(Value::Int4s(objs));
            }
            let rows = on_conn!(
                self.client,
                NAME,
                op,
                conn,
                query.send::<Vec<PgRow>>(self.client.sending(), &mut conn)
            )?;
            for row in rows {
                let (name, token, waited): (String, i64, bool) = (
                    row.try_get(0).map_err(|e| self.decode(op, e))?,
                    row.try_get(1).map_err(|e| self.decode(op, e))?,
                    row.try_get(2).map_err(|e| self.decode(op, e))?,
                );
                if waited {
                    self.releases.announce(&name);
                }
                updated.insert((name, token));
            }
        }
        Ok(leases
            .iter()
            .map(|l| {
                let row = (l.key().as_str().to_owned(), token_i64(l.token()));
                // A renewal can be repeated; a release happens once.
                if op == Operation::Renew {
                    updated.contains(&row)
                } else {
                    updated.remove(&row)
                }
            })
            .collect())
    }
}

/// `sql` with the row of `lease` bound first: its name, owner and token, which the statement
/// matches so that it acts only on the acquisition `lease` names.
fn on_row<'a>(sql: &'a Arc<str>, lease: &'a Lease) -> Statement<'a> {
    Statement::new(sql)
        .bind(Value::Text(lease.key().as_str()))
        .bind(Value::Uuid(owner_uuid(lease.owner())))
        .bind(Value::Int8(token_i64(lease.token())))
}

impl fmt::Debug for PgLeaseBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLeaseBackend")
            .field("url", &self.client.url)
            .field("schema", &self.client.schema)
            .field("pool_size", &self.client.pool_size)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockBackend for PgLeaseBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// TTL granularity 1 ms, server-side expiry, `inspect`, one-statement batches; no pinned connections, so no
    /// `max_held`. Wakes waiters unless [`PgPooling::Transaction`].
    fn capabilities(&self) -> Capabilities {
        self.client
            .capabilities()
            .inspect(true)
            .native_batch(true)
            .wakes_waiters(self.client.pooling == PgPooling::Session)
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        // Before the sweep too: a refused backend sends nothing at all.
        self.check_pooling().await?;
        self.sweeper.poke(&self.client);
        let owner = OwnerId::random();
        // Counted from before the connection is taken: earlier is the safe side.
        let sent = Instant::now();
        let row = self
            .acquire_row(&self.sql.acquire, Value::Text(key.as_str()), owner, ttl)
            .await?;
        let token: Option<i64> = row
            .map(|row| row.try_get(0))
            .transpose()
            .map_err(|e| self.decode(Operation::Acquire, e))?;
        Ok(token.map(|t| {
            Lease::new(
                self.id,
                key.clone(),
                owner,
                token_from(t),
                ttl,
                valid_until(sent, ttl),
            )
        }))
    }

    /// One statement: the first free name of `keys` in order, taken. A name another
    /// call took between the statement's snapshot and its upsert is skipped: the statement
    /// is then sent again (its next snapshot shows that name held), at most once per key.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        if keys.is_empty() {
            return Ok(None);
        }
        self.check_pooling().await?;
        self.sweeper.poke(&self.client);
        let names: Vec<&str> = keys.iter().map(LockKey::as_str).collect();
        for _ in 0..keys.len() {
            let owner = OwnerId::random();
            let sent = Instant::now();
            let row = self
                .acquire_row(
                    &self.sql.acquire_any,
                    Value::Texts(names.clone()),
                    owner,
                    ttl,
                )
                .await?;
            let decode = |e| self.decode(Operation::Acquire, e);
            let Some(row) = row else {
                return Err(self.decode(Operation::Acquire, sqlx::Error::RowNotFound));
            };
            let candidates: i64 = row.try_get(0).map_err(decode)?;
            let taken: Option<String> = row.try_get(1).map_err(decode)?;
            let token: Option<i64> = row.try_get(2).map_err(decode)?;
            match (taken, token) {
                (Some(name), Some(token)) => {
                    let key = keys.iter().find(|k| k.as_str() == name).ok_or_else(|| {
                        LockError::backend(NAME, format!("took {name:?}, which was not asked for"))
                    })?;
                    return Ok(Some(Lease::new(
                        self.id,
                        key.clone(),
                        owner,
                        token_from(token),
                        ttl,
                        valid_until(sent, ttl),
                    )));
                }
                _ if candidates == 0 => return Ok(None),
                // The free name was taken meanwhile: ask again.
                _ => {}
            }
        }
        Ok(None)
    }

    /// One statement for the whole batch.
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        self.check_pooling().await?;
        self.sweeper.poke(&self.client);
        // Each name once (a repeat in the same batch finds it held), in sorted order, so
        // concurrent batches lock rows in the same order and cannot deadlock.
        let unique: BTreeMap<&str, OwnerId> = keys
            .iter()
            .map(|k| (k.as_str(), OwnerId::random()))
            .collect();
        let sent = Instant::now();
        let names: Vec<&str> = unique.keys().copied().collect();
        let owners: Vec<Uuid> = unique.values().map(|o| owner_uuid(*o)).collect();
        let rows = self
            .client
            .send::<Vec<PgRow>>(
                NAME,
                Operation::Acquire,
                Statement::new(&self.sql.acquire_many)
                    .bind(Value::Texts(names))
                    .bind(Value::Uuids(owners))
                    .bind(Value::Int8(ttl_ms(ttl))),
            )
            .await?;
        let mut granted: HashMap<String, i64> = HashMap::with_capacity(rows.len());
        for row in rows {
            let decode = |e| self.decode(Operation::Acquire, e);
            granted.insert(
                row.try_get(0).map_err(decode)?,
                row.try_get(1).map_err(decode)?,
            );
        }
        Ok(keys
            .iter()
            .map(|key| {
                let token = granted.remove(key.as_str())?;
                Some(Lease::new(
                    self.id,
                    key.clone(),
                    unique[key.as_str()],
                    token_from(token),
                    ttl,
                    valid_until(sent, ttl),
                ))
            })
            .collect())
    }

    /// One statement for the whole batch.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        let sent = Instant::now();
        let renewed = self
            .update_many(Operation::Renew, &self.sql.renew_many, leases)
            .await?;
        Ok(leases
            .iter()
            .zip(renewed)
            .map(|(lease, renewed)| {
                if renewed {
                    Renewal::Renewed {
                        valid_until: valid_until(sent, lease.ttl()),
                    }
                } else {
                    Renewal::Lost
                }
            })
            .collect())
    }

    /// One statement per 500 names, in name order: each released name holds an advisory
    /// lock of PostgreSQL's shared lock table until its statement commits. A statement
    /// that fails fails the call; the names released by the statements before it stay
    /// released.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        let released = self
            .update_many(Operation::Release, &self.sql.release_many, leases)
            .await?;
        Ok(released
            .into_iter()
            .map(|r| {
                if r {
                    Release::Released
                } else {
                    Release::NotHeld
                }
            })
            .collect())
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.check(lease)?;
        // Counted from before the connection is taken: earlier is the safe side.
        let sent = Instant::now();
        self.check_pooling().await?;
        let done = self
            .client
            .send::<PgQueryResult>(
                NAME,
                Operation::Renew,
                on_row(&self.sql.renew, lease).bind(Value::Int8(ttl_ms(lease.ttl()))),
            )
            .await?;
        Ok(if done.rows_affected() == 1 {
            Renewal::Renewed {
                valid_until: valid_until(sent, lease.ttl()),
            }
        } else {
            Renewal::Lost
        })
    }

    /// # Cancel safety
    /// A release cancelled after its statement was sent may have released the key
    /// without announcing it: its waiters, if any, find it free at their next backoff
    /// step.
    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.check(lease)?;
        let (class, obj) = self.releases.waiter_id(lease.key());
        self.check_pooling().await?;
        let row = self
            .client
            .send::<Option<PgRow>>(
                NAME,
                Operation::Release,
                on_row(&self.sql.release, lease)
                    .bind(Value::Int4(class))
                    .bind(Value::Int4(obj)),
            )
            .await?;
        let released: Option<bool> = row
            .map(|row| row.try_get(0))
            .transpose()
            .map_err(|e| self.decode(Operation::Release, e))?;
        Ok(match released {
            Some(waited) => {
                if waited {
                    self.releases.announce(lease.key().as_str());
                }
                Release::Released
            }
            None => Release::NotHeld,
        })
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.check(lease)?;
        self.check_pooling().await?;
        let row = self
            .client
            .send::<Option<PgRow>>(NAME, Operation::Fence, on_row(&self.sql.fence, lease))
            .await?;
        let Some(row) = row else {
            return Ok(Fence::Stale {
                current: lease.token(),
            });
        };
        let decode = |e| self.decode(Operation::Fence, e);
        let token: i64 = row.try_get("token").map_err(decode)?;
        let held: Option<bool> = row.try_get("held").map_err(decode)?;
        Ok(if held == Some(true) {
            Fence::Current
        } else {
            Fence::Stale {
                current: token_from(token),
            }
        })
    }

    /// Watches `key` through the backend's one `LISTEN` session, which starts with the
    /// first watched key. A release announces itself; a lease that runs out does not (its
    /// waiters take it at their next backoff step). `None` outside a tokio runtime, and
    /// with [`PgPooling::Transaction`] (no session to `LISTEN` on).
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.releases.watch(key)
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.releases.watch_permits(slots)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.releases.watched_keys()
    }

    /// Adopted leases are this instance's: release, renew and fence match name, owner and
    /// token in the row, so an adopted lease acts only on the acquisition it names.
    fn adopts_as(&self) -> Option<BackendId> {
        Some(self.id)
    }

    /// Deletes the key's row, and with it the newest token. Tokens still never go back:
    /// the next grant's token is at least the server's clock in microseconds, past every
    /// token issued before. Purge only keys nobody holds: a holder's row goes too, and
    /// the key is free at once.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.check_pooling().await?;
        key_row::purge(&self.client, NAME, &self.sql.purge, key).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.check_pooling().await?;
        let query = Statement::new(&self.sql.inspect).bind(Value::Text(key.as_str()));
        key_row::inspect(&self.client, NAME, query).await
    }
}
