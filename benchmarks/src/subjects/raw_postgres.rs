//! The PostgreSQL baselines: a bare advisory lock, an advisory lock with a token row, and
//! a lease row, each in plain SQL.

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

const RAW_LEASE_ACQUIRE: &str = "INSERT INTO bench_raw_leases AS l (name, owner, token, expires_at) \
     VALUES ($1, $2, 1, now() + $3::bigint * interval '1 millisecond') \
     ON CONFLICT (name) DO UPDATE \
        SET owner = EXCLUDED.owner, token = l.token + 1, expires_at = EXCLUDED.expires_at \
      WHERE l.owner IS NULL OR l.expires_at <= now() \
     RETURNING token";

const RAW_LEASE_RELEASE: &str = "UPDATE bench_raw_leases SET owner = NULL, expires_at = NULL \
     WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > now()";

const RAW_ADVISORY_TOKEN_ACQUIRE: &str = "WITH l AS (SELECT pg_try_advisory_lock($1) AS ok), \
     cfg AS (SELECT set_config('idle_session_timeout', $3, false), \
                    set_config('tcp_user_timeout', $3, false), \
                    set_config('tcp_keepalives_idle', $4, false), \
                    set_config('tcp_keepalives_interval', $4, false), \
                    set_config('tcp_keepalives_count', $5, false) \
               FROM l WHERE l.ok) \
     INSERT INTO bench_raw_advisory_tokens AS t (name, token, owner, ttl_ms) \
     SELECT $2, 1, $6, $7 FROM l, cfg WHERE l.ok \
     ON CONFLICT (name) DO UPDATE \
        SET token = t.token + 1, owner = EXCLUDED.owner, ttl_ms = EXCLUDED.ttl_ms \
     RETURNING token";

const RAW_ADVISORY_TOKEN_RELEASE: &str = "SELECT pg_advisory_unlock($1) AS released, \
     set_config('idle_session_timeout', '0', false), \
     set_config('tcp_user_timeout', '0', false), \
     set_config('tcp_keepalives_idle', '0', false), \
     set_config('tcp_keepalives_interval', '0', false), \
     set_config('tcp_keepalives_count', '0', false)";

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
                    sqlx::query(RAW_LEASE_RELEASE)
                        .bind(key.as_str())
                        .bind(owner)
                        .bind(token)
                        .execute(&self.pool)
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
                let token: Option<i64> = sqlx::query_scalar(RAW_ADVISORY_TOKEN_ACQUIRE)
                    .bind(key.id())
                    .bind(key.as_str())
                    .bind(&ttl)
                    .bind("3")
                    .bind("2")
                    .bind(uuid::Uuid::new_v4())
                    .bind(ttl_ms)
                    .fetch_optional(&mut *conn)
                    .await
                    .map_err(|e| self.err(e))?;
                let acquire = start.elapsed();
                if token.is_some() {
                    sqlx::query(RAW_ADVISORY_TOKEN_RELEASE)
                        .bind(key.id())
                        .execute(&mut *conn)
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
