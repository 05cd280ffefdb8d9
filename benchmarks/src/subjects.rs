//! What the benchmarks measure: every distlock backend, and beside each store the raw-client
//! baselines and the `rslock` peer it is compared with, all behind [`Subject`].
//!
//! A subject performs one *cycle* per call: acquire a free key, then release it. The
//! baselines do the same with the store's primitive operations and nothing else, so the
//! ratio of a backend to its matching baseline ([`SubjectId::baseline`]) is the cost of the
//! abstraction, measured in one run against one server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use harness::etcd::EtcdServer;
use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use lock_api::memory::MemoryBackend;
use lock_api::{LockBackend, Release};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub use capacity::subject::{BenchKey, Cycle, Store, Subject, SubjectId, TTL};

use crate::BenchError;

/// Connections per PostgreSQL pool: one per task at the highest concurrency measured (64),
/// plus slack. Each pool is closed before the next subject opens its own, so the server's
/// `max_connections` (200 in the harness) is never reached.
pub const PG_POOL_SIZE: u32 = 66;

/// The servers one run measures, started from the test harness on free loopback
/// ports and stopped when this value is dropped.
#[derive(Debug, Default)]
pub struct Servers {
    redis: Option<RedisServer>,
    postgres: Option<PostgresServer>,
    etcd: Option<EtcdServer>,
}

impl Servers {
    /// Starts the servers of `stores` (the memory store needs none).
    pub async fn start(stores: &[Store]) -> Result<Self, BenchError> {
        let mut servers = Servers::default();
        if stores.contains(&Store::Redis) {
            servers.redis = Some(RedisServer::start().await?);
        }
        if stores.contains(&Store::Postgres) {
            let postgres = PostgresServer::start().await?;
            // The role the benchmarks connect as may create the backends' schema, as a
            // deployment grants once.
            postgres
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await?;
            servers.postgres = Some(postgres);
        }
        if stores.contains(&Store::Etcd) {
            servers.etcd = Some(EtcdServer::start().await?);
        }
        Ok(servers)
    }

    fn missing(store: Store) -> BenchError {
        BenchError::Unexpected {
            subject: store.name(),
            detail: "the server for this store was not started".into(),
        }
    }

    /// The Redis server's URL.
    pub fn redis_url(&self) -> Result<String, BenchError> {
        self.redis
            .as_ref()
            .map(RedisServer::url)
            .ok_or_else(|| Self::missing(Store::Redis))
    }

    /// Sends one command to the Redis server and returns its reply as text.
    pub async fn redis_command(&self, args: &[&str]) -> Result<String, BenchError> {
        let redis = self
            .redis
            .as_ref()
            .ok_or_else(|| Self::missing(Store::Redis))?;
        let reply = redis.command(args).await?;
        match reply.as_text() {
            Some(text) if !reply.is_error() => Ok(text),
            _ => Err(BenchError::Unexpected {
                subject: "redis",
                detail: format!("{args:?} answered {reply:?}"),
            }),
        }
    }

    /// The PostgreSQL server's URL (the harness's unprivileged role).
    pub fn postgres_url(&self) -> Result<String, BenchError> {
        self.postgres
            .as_ref()
            .map(PostgresServer::url)
            .ok_or_else(|| Self::missing(Store::Postgres))
    }

    /// The etcd client endpoint.
    pub fn etcd_endpoint(&self) -> Result<String, BenchError> {
        self.etcd
            .as_ref()
            .map(EtcdServer::endpoint)
            .ok_or_else(|| Self::missing(Store::Etcd))
    }
}

/// Connects `id` to its server and prepares it (tables, scripts, shared leases).
pub async fn open(id: SubjectId, servers: &Servers) -> Result<Arc<dyn Subject>, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: id.slug(),
        source,
    };
    Ok(match id {
        SubjectId::Memory => Arc::new(Backend::new(id, MemoryBackend::new(), None)),
        SubjectId::Redis => {
            let backend = lock_redis::RedisBackend::builder()
                .url(servers.redis_url()?)
                .build()
                .await
                .map_err(lock_err)?;
            Arc::new(Backend::new(id, backend, None))
        }
        SubjectId::PgLease => {
            let backend = lock_postgres::PgBuilder::new(servers.postgres_url()?)
                .pool_size(PG_POOL_SIZE)
                .build_lease_backend()
                .map_err(lock_err)?;
            backend.setup().await.map_err(lock_err)?;
            backend.connect().await.map_err(lock_err)?;
            let pool = backend.pool().clone();
            Arc::new(Backend::new(id, backend, Some(pool)))
        }
        SubjectId::PgAdvisory => {
            let backend = lock_postgres::PgBuilder::new(servers.postgres_url()?)
                .pool_size(PG_POOL_SIZE)
                .build_advisory_backend()
                .map_err(lock_err)?;
            backend.setup().await.map_err(lock_err)?;
            backend.connect().await.map_err(lock_err)?;
            Arc::new(Backend::new(id, backend, None))
        }
        SubjectId::Etcd => {
            let backend = lock_etcd::EtcdBackend::builder()
                .endpoint(servers.etcd_endpoint()?)
                .build()
                .await
                .map_err(lock_err)?;
            Arc::new(Backend::new(id, backend, None))
        }
        SubjectId::RedisPing
        | SubjectId::RedisSetNx
        | SubjectId::RedisTwoStep
        | SubjectId::Rslock => Arc::new(RawRedis::connect(id, &servers.redis_url()?).await?),
        SubjectId::PgRawAdvisory | SubjectId::PgRawAdvisoryToken | SubjectId::PgRawLease => {
            Arc::new(RawPostgres::connect(id, &servers.postgres_url()?).await?)
        }
        SubjectId::EtcdRawTxn | SubjectId::EtcdRawSameOps => {
            Arc::new(RawEtcd::connect(id, &servers.etcd_endpoint()?).await?)
        }
    })
}

/// A distlock backend measured through the `LockBackend` trait, as an application calls it.
struct Backend {
    id: SubjectId,
    backend: Arc<dyn LockBackend>,
    pool: Option<PgPool>,
}

impl Backend {
    fn new(id: SubjectId, backend: impl LockBackend, pool: Option<PgPool>) -> Self {
        Self {
            id,
            backend: Arc::new(backend),
            pool,
        }
    }
}

#[async_trait]
impl Subject for Backend {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let lock_err = |source| BenchError::Lock {
            subject: self.id.slug(),
            source,
        };
        let start = Instant::now();
        let lease = self
            .backend
            .acquire(key.lock_key(), TTL)
            .await
            .map_err(lock_err)?;
        let acquire = start.elapsed();
        let Some(lease) = lease else {
            return Ok(Cycle {
                acquire,
                acquired: false,
            });
        };
        match self.backend.release(&lease).await.map_err(lock_err)? {
            Release::Released => Ok(Cycle {
                acquire,
                acquired: true,
            }),
            other => Err(BenchError::Unexpected {
                subject: self.id.slug(),
                detail: format!("releasing a lease just taken answered {other:?}"),
            }),
        }
    }

    fn backend(&self) -> Option<Arc<dyn LockBackend>> {
        Some(self.backend.clone())
    }

    async fn close(&self) {
        if let Some(pool) = &self.pool {
            pool.close().await;
        }
    }
}

/// The owner-checked delete of the article design (the same check distlock's release does).
const CHECKED_DEL: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                               return redis.call('DEL', KEYS[1]) \
                           else return 0 end";

/// The Redis baselines and the `rslock` peer, on one multiplexed connection like the backend.
struct RawRedis {
    id: SubjectId,
    conn: redis::aio::MultiplexedConnection,
    checked_del: redis::Script,
    rslock: rslock::LockManager,
    ttl_ms: u64,
}

impl RawRedis {
    async fn connect(id: SubjectId, url: &str) -> Result<Self, BenchError> {
        let err = |e: redis::RedisError| BenchError::client(id.slug(), e);
        let client = redis::Client::open(url).map_err(err)?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(err)?;
        let mut rslock = rslock::LockManager::new(vec![url.to_owned()]);
        // A refused lock fails at once instead of sleeping between retries, as distlock's
        // `acquire` does.
        rslock.set_retry(1, Duration::from_millis(1));
        Ok(Self {
            id,
            conn,
            checked_del: redis::Script::new(CHECKED_DEL),
            rslock,
            ttl_ms: u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> BenchError {
        BenchError::client(self.id.slug(), e)
    }

    /// `SET key owner NX PX ttl`; true when the key was taken.
    async fn set_nx(&self, key: &str, owner: &str) -> Result<bool, BenchError> {
        let mut conn = self.conn.clone();
        let reply: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(owner)
            .arg("NX")
            .arg("PX")
            .arg(self.ttl_ms)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(reply.is_some())
    }
}

#[async_trait]
impl Subject for RawRedis {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let mut conn = self.conn.clone();
        let key = key.as_str();
        let start = Instant::now();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let (acquire, acquired) = match self.id {
            SubjectId::RedisPing => {
                let _: String = redis::cmd("PING")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| self.err(e))?;
                (start.elapsed(), true)
            }
            SubjectId::RedisSetNx => {
                let taken = self.set_nx(key, &owner).await?;
                let acquire = start.elapsed();
                if taken {
                    let _: i64 = redis::cmd("DEL")
                        .arg(key)
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                (acquire, taken)
            }
            SubjectId::RedisTwoStep => {
                let taken = self.set_nx(key, &owner).await?;
                if taken {
                    let _token: u64 = redis::cmd("INCR")
                        .arg(format!("{key}:fence"))
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                let acquire = start.elapsed();
                if taken {
                    let _: i64 = self
                        .checked_del
                        .key(key)
                        .arg(&owner)
                        .invoke_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                (acquire, taken)
            }
            _ => match self.rslock.lock(key, TTL).await {
                Ok(lock) => {
                    let acquire = start.elapsed();
                    self.rslock.unlock(&lock).await;
                    (acquire, true)
                }
                Err(rslock::LockError::Unavailable) => (start.elapsed(), false),
                Err(e) => return Err(self.err(e)),
            },
        };
        Ok(Cycle { acquire, acquired })
    }
}

/// The PostgreSQL baselines, on their own tables so they depend on no backend code.
struct RawPostgres {
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
    async fn connect(id: SubjectId, url: &str) -> Result<Self, BenchError> {
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

/// The etcd baselines.
struct RawEtcd {
    id: SubjectId,
    client: etcd_client::Client,
    /// The one lease every key of [`SubjectId::EtcdRawTxn`] is put on.
    shared_lease: i64,
    ttl_secs: i64,
}

impl RawEtcd {
    async fn connect(id: SubjectId, endpoint: &str) -> Result<Self, BenchError> {
        let err = |e: etcd_client::Error| BenchError::client(id.slug(), e);
        let client = etcd_client::Client::connect([endpoint], None)
            .await
            .map_err(err)?;
        // Outlives any measurement; it lapses on its own after the run.
        let shared_lease = client
            .lease_client()
            .grant(3600, None)
            .await
            .map_err(err)?
            .id();
        Ok(Self {
            id,
            client,
            shared_lease,
            ttl_secs: i64::try_from(TTL.as_secs()).unwrap_or(i64::MAX),
        })
    }

    fn err(&self, e: etcd_client::Error) -> BenchError {
        BenchError::client(self.id.slug(), e)
    }

    fn revoke_in_background(&self, lease: i64) {
        let mut leases = self.client.lease_client();
        tokio::spawn(async move {
            let _ = leases.revoke(lease).await;
        });
    }
}

#[async_trait]
impl Subject for RawEtcd {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let mut kv = self.client.kv_client();
        let start = Instant::now();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let lock_key = format!("bench/locks/{}", key.as_str());
        if self.id == SubjectId::EtcdRawTxn {
            let put_if_absent = Txn::new()
                .when([Compare::create_revision(
                    lock_key.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([TxnOp::put(
                    lock_key.clone(),
                    owner,
                    Some(PutOptions::new().with_lease(self.shared_lease)),
                )]);
            let taken = kv
                .txn(put_if_absent)
                .await
                .map_err(|e| self.err(e))?
                .succeeded();
            let acquire = start.elapsed();
            if taken {
                kv.delete(lock_key, None).await.map_err(|e| self.err(e))?;
            }
            return Ok(Cycle {
                acquire,
                acquired: taken,
            });
        }

        let lease = self
            .client
            .lease_client()
            .grant(self.ttl_secs, None)
            .await
            .map_err(|e| self.err(e))?
            .id();
        let put_if_absent = Txn::new()
            .when([Compare::create_revision(
                lock_key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    lock_key.clone(),
                    owner.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::put(
                    format!("bench/tokens/{}", key.as_str()),
                    owner.clone(),
                    None,
                ),
            ])
            .or_else([TxnOp::get(lock_key.clone(), None)]);
        let resp = kv.txn(put_if_absent).await.map_err(|e| self.err(e))?;
        let acquire = start.elapsed();
        let token = resp.header().map(|h| h.revision()).unwrap_or(0);
        if resp.succeeded() {
            let checked_delete = Txn::new()
                .when([
                    Compare::create_revision(lock_key.clone(), CompareOp::Equal, token),
                    Compare::value(lock_key.clone(), CompareOp::Equal, owner),
                ])
                .and_then([
                    TxnOp::get(lock_key.clone(), None),
                    TxnOp::delete(lock_key, None),
                ]);
            kv.txn(checked_delete).await.map_err(|e| self.err(e))?;
        }
        self.revoke_in_background(lease);
        Ok(Cycle {
            acquire,
            acquired: resp.succeeded(),
        })
    }
}
