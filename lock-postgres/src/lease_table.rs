//! [`PgLeaseBackend`]: one row per lock name in `<schema>.distlock_leases`, taken and
//! checked with single statements on the server's clock. No connection stays pinned.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal, valid_until,
};
use sqlx::{AssertSqlSafe, Row};
use tokio::time::Instant;
use uuid::Uuid;

use crate::client::{PgClient, on_conn, owner_uuid, token_from, token_i64, ttl_ms, with_clock};
use crate::config::PgBuilder;
use crate::error::Operation;
use crate::key_row;
use crate::releases::ReleaseListener;
use crate::retention::{Sweeper, Table};
use crate::waiters::waited;

const NAME: &str = "postgres-lease";

/// The statements, with the schema name filled in once.
struct Statements {
    acquire: Arc<str>,
    acquire_many: Arc<str>,
    renew_many: Arc<str>,
    release_many: Arc<str>,
    renew: Arc<str>,
    release: Arc<str>,
    fence: Arc<str>,
    inspect: Arc<str>,
    purge: Arc<str>,
}

/// PostgreSQL lease-table backend: one row per lock name in `<schema>.distlock_leases`,
/// taken and checked with single statements on the server's clock. No connection stays
/// pinned.
///
/// # How it works
///
/// - **acquire** is one upsert: it inserts the row, or takes it over only when it is free
///   (`owner IS NULL`) or expired (`expires_at <= now()`), bumping the token either way.
///   The new token is `greatest(token + 1, server clock in µs)`, so a row that lost its
///   last updates (asynchronous commit, failover to a lagging replica) or was deleted
///   never issues a token twice, as long as the server's clock does not go back. An
///   attempt on a name its snapshot shows held inserts nothing and locks nothing: a
///   refused attempt writes no WAL, commits nothing durable and never waits for the
///   holder's row.
/// - **renew** and **release** match name, owner *and* token, and only while
///   `expires_at > now()`: an expired lease is never brought back, even by its owner.
/// - **release** clears the owner and keeps the row, so the next token is still higher;
///   free rows are deleted once their token is older than the
///   [token retention](PgBuilder::token_retention) (24 h by default).
///   When some process waits for the key (its release listener registered the key; see
///   [`LockBackend::watch_releases`]), the statement says so, and once it committed the
///   backend's announcer notifies the backend's channel with the name (`pg_notify`, many
///   names in one transaction), which wakes a waiter in [`distlock_core::Locker::lock`]
///   in every process that listens. The release's own transaction never notifies, so it
///   never waits for PostgreSQL's cluster-wide notify lock. A lease that runs out is not
///   announced: waiters take it at their next backoff step.
///
/// Expiry uses the server's clock only (`now()`); the client's own deadline
/// ([`Lease::valid_until`]) is counted from the instant the request was sent, so it always
/// ends before the server's.
///
/// TTLs are whole milliseconds. Tokens survive server restarts (the table is durable).
///
/// Call [`PgLeaseBackend::setup`] once per database (idempotent) before using it; calls on
/// a database without the tables fail with [`LockError::Config`] naming `setup()`.
pub struct PgLeaseBackend {
    id: BackendId,
    client: PgClient,
    sql: Statements,
    sweeper: Sweeper,
    pub(crate) releases: ReleaseListener,
}

impl PgLeaseBackend {
    /// Settings for the server at `url`; see [`PgBuilder`].
    pub fn builder(url: impl Into<String>) -> PgBuilder {
        PgBuilder::new(url)
    }

    pub(crate) fn from_client(client: PgClient) -> Self {
        let s = &client.schema;
        let sql = Statements {
            // A name its snapshot shows held is filtered out before the upsert: the
            // refused attempt then inserts nothing and locks no row, so it writes no WAL,
            // takes no transaction id, and never waits for the holder's renew. The
            // upsert's own condition still decides when the row changed meanwhile.
            acquire: s.sql(&with_clock(
                "INSERT INTO {s}.distlock_leases AS l (name, owner, token, expires_at) \
                 SELECT $1, $2, {clock_us}, now() + $3::bigint * interval '1 millisecond' \
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.distlock_leases h \
                                     WHERE h.name = $1 AND h.expires_at > now()) \
                 ON CONFLICT (name) DO UPDATE \
                    SET owner = EXCLUDED.owner, token = greatest(l.token + 1, {clock_us}), \
                        expires_at = EXCLUDED.expires_at \
                  WHERE l.owner IS NULL OR l.expires_at <= now() \
                 RETURNING token",
            )),
            acquire_many: s.sql(&with_clock(
                "INSERT INTO {s}.distlock_leases AS l (name, owner, token, expires_at) \
                 SELECT k.name, k.owner, {clock_us}, \
                        now() + $3::bigint * interval '1 millisecond' \
                   FROM unnest($1::text[], $2::uuid[]) AS k(name, owner) \
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.distlock_leases h \
                                     WHERE h.name = k.name AND h.expires_at > now()) \
                 ON CONFLICT (name) DO UPDATE \
                    SET owner = EXCLUDED.owner, token = greatest(l.token + 1, {clock_us}), \
                        expires_at = EXCLUDED.expires_at \
                  WHERE l.owner IS NULL OR l.expires_at <= now() \
                 RETURNING name, token",
            )),
            renew_many: s.sql(
                "UPDATE {s}.distlock_leases AS l \
                    SET expires_at = now() + k.ttl_ms * interval '1 millisecond' \
                   FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[]) \
                        AS k(name, owner, token, ttl_ms) \
                  WHERE l.name = k.name AND l.owner = k.owner AND l.token = k.token \
                    AND l.expires_at > now() \
                 RETURNING l.name, l.token, false AS waited",
            ),
            // Each released row says whether some process waits for its key
            // (`crate::waiters`); the backend then has it announced.
            release_many: s.sql(&format!(
                "WITH r AS (UPDATE {{s}}.distlock_leases AS l SET owner = NULL, expires_at = NULL \
                   FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::int4[], $5::int4[]) \
                        AS k(name, owner, token, wclass, wobj) \
                  WHERE l.name = k.name AND l.owner = k.owner AND l.token = k.token \
                    AND l.expires_at > now() \
                 RETURNING l.name, l.token, k.wclass, k.wobj) \
                 SELECT r.name, r.token, {} AS waited FROM r",
                waited("r.wclass", "r.wobj")
            )),
            renew: s.sql(
                "UPDATE {s}.distlock_leases \
                    SET expires_at = now() + $4::bigint * interval '1 millisecond' \
                  WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > now()",
            ),
            // A row when released, saying whether some process waits for the key.
            release: s.sql(&format!(
                "WITH r AS (UPDATE {{s}}.distlock_leases SET owner = NULL, expires_at = NULL \
                  WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > now() \
                 RETURNING name) \
                 SELECT {} AS waited FROM r",
                waited("$4", "$5")
            )),
            fence: s.sql(
                "SELECT token, (owner = $2 AND token = $3 AND expires_at > now()) AS held \
                   FROM {s}.distlock_leases WHERE name = $1",
            ),
            inspect: s.sql(
                "SELECT CASE WHEN expires_at > now() THEN owner END AS owner, token, \
                        CASE WHEN expires_at > now() \
                             THEN (extract(epoch FROM expires_at - now()) * 1000000)::bigint \
                        END AS remaining_us \
                   FROM {s}.distlock_leases WHERE name = $1",
            ),
            purge: s.sql("DELETE FROM {s}.distlock_leases WHERE name = $1"),
        };
        let releases = ReleaseListener::new(
            "lease",
            s,
            (*client.pool.connect_options()).clone(),
            client.connect_timeout,
            client.request_timeout,
        );
        Self {
            id: BackendId::next(),
            sweeper: Sweeper::new(&client, NAME, Table::Leases),
            client,
            sql,
            releases,
        }
    }

    /// Opens all of the pool's connections now and checks that the tables exist: fails
    /// with [`LockError::Unavailable`] when the server cannot be reached and with
    /// [`LockError::Config`] on a refused login or a database without `setup()`.
    /// Optional: without it, connections open on first use.
    pub async fn connect(&self) -> Result<(), LockError> {
        self.client.warm_up(NAME, "distlock_leases").await
    }

    /// Creates the schema and tables if they do not exist. Idempotent; run it once at
    /// deployment or start-up, never implicitly per call.
    pub async fn setup(&self) -> Result<(), LockError> {
        self.client.setup(NAME).await
    }

    /// The pool, for sharing with [`crate::PgFencedResource`] or the application.
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

    /// Runs a batch UPDATE over `leases` (owner- and token-checked) and returns, per lease,
    /// whether its row was updated. A lease listed twice is released once, as two single
    /// calls in a row would (the second finds it already released), and renewed twice.
    async fn update_many(
        &self,
        op: Operation,
        sql: &Arc<str>,
        leases: &[Lease],
    ) -> Result<Vec<bool>, LockError> {
        for lease in leases {
            self.check(lease)?;
        }
        // Sent sorted by name, so concurrent batches lock rows in the same order and cannot
        // deadlock (as `acquire_many` does).
        let mut sorted: Vec<&Lease> = leases.iter().collect();
        sorted.sort_by(|a, b| a.key().as_str().cmp(b.key().as_str()));
        let mut conn = self.client.conn(NAME).await?;
        let names: Vec<&str> = sorted.iter().map(|l| l.key().as_str()).collect();
        let owners: Vec<Uuid> = sorted.iter().map(|l| owner_uuid(l.owner())).collect();
        let tokens: Vec<i64> = sorted.iter().map(|l| token_i64(l.token())).collect();
        let ttls: Vec<i64> = sorted.iter().map(|l| ttl_ms(l.ttl())).collect();
        let mut query = sqlx::query_as::<_, (String, i64, bool)>(AssertSqlSafe(sql.clone()))
            .bind(names)
            .bind(owners)
            .bind(tokens);
        if op == Operation::Renew {
            query = query.bind(ttls);
        } else {
            let (classes, objs): (Vec<i32>, Vec<i32>) = sorted
                .iter()
                .map(|l| self.releases.waiter_id(l.key()))
                .unzip();
            query = query.bind(classes).bind(objs);
        }
        let rows = on_conn!(self.client, NAME, op, conn, query.fetch_all(&mut *conn))?;
        let mut updated = HashSet::with_capacity(rows.len());
        for (name, token, waited) in rows {
            if waited {
                self.releases.announce(&name);
            }
            updated.insert((name, token));
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
    /// `max_held`.
    fn capabilities(&self) -> Capabilities {
        self.client
            .capabilities()
            .inspect(true)
            .native_batch(true)
            .wakes_waiters(true)
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        self.sweeper.poke(&self.client);
        let owner = OwnerId::random();
        // Counted from before the connection is taken: earlier is the safe side.
        let sent = Instant::now();
        let mut conn = self.client.conn(NAME).await?;
        let token: Option<i64> = on_conn!(
            self.client,
            NAME,
            Operation::Acquire,
            conn,
            sqlx::query_scalar(AssertSqlSafe(self.sql.acquire.clone()))
                .bind(key.as_str())
                .bind(owner_uuid(owner))
                .bind(ttl_ms(ttl))
                .fetch_optional(&mut *conn)
        )?;
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

    /// One statement for the whole batch.
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        self.sweeper.poke(&self.client);
        // Each name once (a repeat in the same batch finds it held), in sorted order, so
        // concurrent batches lock rows in the same order and cannot deadlock.
        let unique: BTreeMap<&str, OwnerId> = keys
            .iter()
            .map(|k| (k.as_str(), OwnerId::random()))
            .collect();
        let sent = Instant::now();
        let mut conn = self.client.conn(NAME).await?;
        let names: Vec<&str> = unique.keys().copied().collect();
        let owners: Vec<Uuid> = unique.values().map(|o| owner_uuid(*o)).collect();
        let rows: Vec<(String, i64)> = on_conn!(
            self.client,
            NAME,
            Operation::Acquire,
            conn,
            sqlx::query_as(AssertSqlSafe(self.sql.acquire_many.clone()))
                .bind(names)
                .bind(owners)
                .bind(ttl_ms(ttl))
                .fetch_all(&mut *conn)
        )?;
        let mut granted: HashMap<String, i64> = rows.into_iter().collect();
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

    /// One statement for the whole batch.
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
        let mut conn = self.client.conn(NAME).await?;
        let done = on_conn!(
            self.client,
            NAME,
            Operation::Renew,
            conn,
            sqlx::query(AssertSqlSafe(self.sql.renew.clone()))
                .bind(lease.key().as_str())
                .bind(owner_uuid(lease.owner()))
                .bind(token_i64(lease.token()))
                .bind(ttl_ms(lease.ttl()))
                .execute(&mut *conn)
        )?;
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
        let mut conn = self.client.conn(NAME).await?;
        let released: Option<bool> = on_conn!(
            self.client,
            NAME,
            Operation::Release,
            conn,
            sqlx::query_scalar(AssertSqlSafe(self.sql.release.clone()))
                .bind(lease.key().as_str())
                .bind(owner_uuid(lease.owner()))
                .bind(token_i64(lease.token()))
                .bind(class)
                .bind(obj)
                .fetch_optional(&mut *conn)
        )?;
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
        let mut conn = self.client.conn(NAME).await?;
        let row = on_conn!(
            self.client,
            NAME,
            Operation::Fence,
            conn,
            sqlx::query(AssertSqlSafe(self.sql.fence.clone()))
                .bind(lease.key().as_str())
                .bind(owner_uuid(lease.owner()))
                .bind(token_i64(lease.token()))
                .fetch_optional(&mut *conn)
        )?;
        let Some(row) = row else {
            return Ok(Fence::Stale {
                current: lease.token(),
            });
        };
        let decode = |e| crate::error::from_sqlx(NAME, Operation::Fence, &self.client.schema, e);
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
    /// waiters take it at their next backoff step). `None` outside a tokio runtime.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.releases.watch(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.releases.watched_keys()
    }

    /// A lease of this instance for `owner` and `token`. No statement runs: release, renew
    /// and fence match name, owner and token in the row, so an adopted lease acts only on
    /// the acquisition it names. Its local validity is already over (`valid_until` is now),
    /// because how much of the TTL is left is known only to the server.
    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        self.capabilities().check_ttl(ttl)?;
        Ok(Lease::adopted(self.id, key.clone(), owner, token, ttl))
    }

    /// Deletes the key's row, and with it the newest token. Tokens still never go back:
    /// the next grant's token is at least the server's clock in microseconds, past every
    /// token issued before. Purge only keys nobody holds: a holder's row goes too, and
    /// the key is free at once.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        key_row::purge(&self.client, NAME, &self.sql.purge, key).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let query = sqlx::query(AssertSqlSafe(self.sql.inspect.clone())).bind(key.as_str());
        key_row::inspect(&self.client, NAME, query).await
    }
}
