//! The PostgreSQL baselines: a bare advisory lock, an advisory lock with a token row, and
//! a lease row, each in plain SQL.

use std::sync::LazyLock;
use std::time::Instant;

use async_trait::async_trait;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::{BenchKey, Cycle, PG_POOL_SIZE, Subject, SubjectId, TTL};
use crate::BenchError;

/// The PostgreSQL baselines, on their own tables so they depend on no backend code.
pub(super) struct RawPostgres {
    id: SubjectId,
    pool: PgPool,
}

const RAW_SETUP: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS bench_raw_leases (name text PRIMARY KEY, owner uuid, \
     token bigint NOT NULL, expires_at timestamptz)",
    "CREATE TABLE IF NOT EXISTS bench_raw_advisory_tokens (name text PRIMARY KEY, \
     token bigint NOT NULL, owner uuid NOT NULL, ttl_ms bigint NOT NULL)",
];

/// The server clock in µs, as the backends compute their tokens' floor.
macro_rules! clock_us {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
    };
}

// The lease-table statements are copies of lock-postgres's (`lease_table.rs`), on a
// table of their own: keep them in step when those change, or the pairs compare
// different work. The advisory ones are taken from the crate.

/// The lease table's acquire: skip a name held in the snapshot, else the upsert that
/// takes the row when free or expired, with a token at least the clock.
const RAW_LEASE_ACQUIRE: &str = concat!(
    "INSERT INTO bench_raw_leases AS l (name, owner, token, expires_at) \
     SELECT $1, $2, ",
    clock_us!(),
    ", now() + $3::bigint * interval '1 millisecond' \
      WHERE NOT EXISTS (SELECT 1 FROM bench_raw_leases h \
                         WHERE h.name = $1 AND h.expires_at > now()) \
     ON CONFLICT (name) DO UPDATE \
        SET owner = EXCLUDED.owner, token = greatest(l.token + 1, ",
    clock_us!(),
    "), expires_at = EXCLUDED.expires_at \
      WHERE l.owner IS NULL OR l.expires_at <= now() \
     RETURNING token"
);

/// The lease table's release: the owner-checked update, and whether a waiter's shared
/// lock is held on the key's waiter id (`$4`, `$5`).
const RAW_LEASE_RELEASE: &str = "WITH r AS (UPDATE bench_raw_leases \
        SET owner = NULL, expires_at = NULL \
      WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > now() \
     RETURNING name) \
     SELECT (NOT pg_try_advisory_xact_lock($4, $5)) AS waited FROM r";

/// The advisory backend's acquire: the session's mark, the try, the session settings and
/// the token bump, in one statement; lock-postgres's own, taken from the crate as the
/// release is, with the token bump going to the baseline's own table.
static RAW_ADVISORY_TOKEN_ACQUIRE: LazyLock<String> =
    LazyLock::new(|| lock_postgres::advisory_acquire_sql("bench_raw_advisory_tokens"));

/// The advisory backend's release: the unlock in the session that took the lock, whether
/// a waiter's shared lock is held on the key's waiter id, and the settings reset.
///
/// lock-postgres's own statement (`UNLOCK`, advisory.rs), taken from the crate rather than
/// copied so the pair always compares the same statement: the baseline sends it without
/// the backend's code around it (pool, pinned session, error mapping).
const RAW_ADVISORY_TOKEN_RELEASE: &str = lock_postgres::ADVISORY_UNLOCK_SQL;

/// A waiter id for `key`, two `int4` as the backends derive theirs (nobody waits on it).
fn waiter_id(key: &BenchKey) -> (i32, i32) {
    let id = key.id();
    ((id >> 32) as i32, id as i32)
}

impl RawPostgres {
    pub(super) async fn connect(id: SubjectId, url: &str) -> Result<Self, BenchError> {
        let err = |e: sqlx::Error| BenchError::client(id.slug(), e);
        let pool = PgPoolOptions::new()
            .max_connections(PG_POOL_SIZE)
            .connect(url)
            .await
            .map_err(err)?;
        // Open every connection now, as the backends' `connect()` does, so that no
        // measurement pays for connecting.
        let mut warm = Vec::new();
        for _ in 0..PG_POOL_SIZE {
            warm.push(pool.acquire().await.map_err(err)?);
        }
        drop(warm);
        for statement in RAW_SETUP {
            sqlx::query(statement).execute(&pool).await.map_err(err)?;
        }
        Ok(Self { id, pool })
    }

    fn err(&self, e: sqlx::Error) -> BenchError {
        BenchError::client(self.id.slug(), e)
    }
}

#[async_trait]
impl Subject for RawPostgres {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let start = Instant::now();
        let ttl_ms = i64::try_from(TTL.as_millis()).unwrap_or(i64::MAX);
        match self.id {
            SubjectId::PgRawLease => {
                let owner = uuid::Uuid::new_v4();
                let token: Option<i64> = sqlx::query_scalar(RAW_LEASE_ACQUIRE)
                    .bind(key.as_str())
                    .bind(owner)
                    .bind(ttl_ms)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(|e| self.err(e))?;
                let acquire = start.elapsed();
                if let Some(token) = token {
                    let (class, obj) = waiter_id(key);
                    sqlx::query(RAW_LEASE_RELEASE)
                        .bind(key.as_str())
                        .bind(owner)
                        .bind(token)
                        .bind(class)
                        .bind(obj)
                        .fetch_optional(&self.pool)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                Ok(Cycle {
                    acquire,
                    acquired: token.is_some(),
                })
            }
            SubjectId::PgRawAdvisoryToken => {
                let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
                let ttl = ttl_ms.to_string();
                let (_held, pid, token): (i64, i32, Option<i64>) =
                    sqlx::query_as(RAW_ADVISORY_TOKEN_ACQUIRE.as_str())
                        .bind(key.id())
                        .bind(key.as_str())
                        .bind(&ttl)
                        .bind("3")
                        .bind("2")
                        .bind(uuid::Uuid::new_v4())
                        .bind(ttl_ms)
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(|e| self.err(e))?;
                let acquire = start.elapsed();
                if token.is_some() {
                    let (class, obj) = waiter_id(key);
                    sqlx::query(RAW_ADVISORY_TOKEN_RELEASE)
                        .bind(key.id())
                        .bind(pid)
                        .bind(class)
                        .bind(obj)
                        .fetch_optional(&mut *conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                Ok(Cycle {
                    acquire,
                    acquired: token.is_some(),
                })
            }
            _ => {
                let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
                let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(key.id())
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
                let acquire = start.elapsed();
                if taken {
                    let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                        .bind(key.id())
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                Ok(Cycle {
                    acquire,
                    acquired: taken,
                })
            }
        }
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}
