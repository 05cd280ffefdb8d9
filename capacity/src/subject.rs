//! What a measurement runs: a [`Subject`] performs one *cycle* per call (acquire a free
//! key, then release it), named by a [`SubjectId`] — a distlock backend, or one of the
//! raw-client baselines and peers the `benchmarks` crate measures beside it.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::{LockBackend, LockKey, Release};

use crate::error::BenchError;

/// The TTL every acquire asks for: long enough that no lease expires during a measurement,
/// and whole seconds so that etcd accepts it.
pub const TTL: Duration = Duration::from_secs(10);

/// A store, which decides the servers a run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Store {
    /// The in-memory reference backend (no server).
    Memory,
    /// `redis-server`.
    Redis,
    /// PostgreSQL.
    Postgres,
    /// `etcd`.
    Etcd,
}

impl Store {
    /// The store's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Redis => "redis",
            Store::Postgres => "postgres",
            Store::Etcd => "etcd",
        }
    }
}

/// One thing the benchmarks measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SubjectId {
    /// `distlock_core::memory::MemoryBackend`.
    Memory,
    /// `lock_redis::RedisBackend` on one multiplexed connection.
    Redis,
    /// `lock_postgres::PgLeaseBackend`.
    PgLease,
    /// `lock_postgres::PgAdvisoryBackend`.
    PgAdvisory,
    /// `lock_etcd::EtcdBackend`.
    Etcd,
    /// Redis `PING`: the round-trip floor.
    RedisPing,
    /// Raw `SET key v NX PX ttl`, then `DEL key`.
    RedisSetNx,
    /// The usual article design: `SET NX PX`, then a separate `INCR` for a token, and an
    /// owner-checked `DEL` script to release.
    RedisTwoStep,
    /// The `rslock` crate (Redlock on one server, no fencing token): lock, unlock.
    Rslock,
    /// Raw `pg_try_advisory_lock` + `pg_advisory_unlock` on one pooled connection.
    PgRawAdvisory,
    /// The advisory backend's own SQL sent raw: try-lock + session settings + token upsert in
    /// one statement, then unlock + settings reset.
    PgRawAdvisoryToken,
    /// The lease-table backend's own SQL sent raw: the take-if-expired upsert, then the
    /// owner-checked release update.
    PgRawLease,
    /// Raw etcd txn put-if-absent (on one shared lease) + delete.
    EtcdRawTxn,
    /// The etcd backend's primitive operations sent raw: read the lock and token keys,
    /// grant a lease, txn put-if-absent (lock key + token key), owner-checked delete txn,
    /// revoke in the background.
    EtcdRawSameOps,
}

impl SubjectId {
    /// Every subject, backends first.
    pub const ALL: [SubjectId; 14] = [
        SubjectId::Memory,
        SubjectId::Redis,
        SubjectId::PgLease,
        SubjectId::PgAdvisory,
        SubjectId::Etcd,
        SubjectId::RedisPing,
        SubjectId::RedisSetNx,
        SubjectId::RedisTwoStep,
        SubjectId::Rslock,
        SubjectId::PgRawAdvisory,
        SubjectId::PgRawAdvisoryToken,
        SubjectId::PgRawLease,
        SubjectId::EtcdRawTxn,
        SubjectId::EtcdRawSameOps,
    ];

    /// The distlock backends.
    pub const BACKENDS: [SubjectId; 5] = [
        SubjectId::Memory,
        SubjectId::Redis,
        SubjectId::PgLease,
        SubjectId::PgAdvisory,
        SubjectId::Etcd,
    ];

    /// The short name used in the CSV, on the command line and in bench ids.
    pub fn slug(self) -> &'static str {
        match self {
            SubjectId::Memory => "memory",
            SubjectId::Redis => "redis",
            SubjectId::PgLease => "pg-lease",
            SubjectId::PgAdvisory => "pg-advisory",
            SubjectId::Etcd => "etcd",
            SubjectId::RedisPing => "redis-ping",
            SubjectId::RedisSetNx => "redis-setnx-del",
            SubjectId::RedisTwoStep => "redis-two-step",
            SubjectId::Rslock => "rslock",
            SubjectId::PgRawAdvisory => "pg-raw-advisory",
            SubjectId::PgRawAdvisoryToken => "pg-raw-advisory-token",
            SubjectId::PgRawLease => "pg-raw-lease",
            SubjectId::EtcdRawTxn => "etcd-raw-txn",
            SubjectId::EtcdRawSameOps => "etcd-raw-same-ops",
        }
    }

    /// What one cycle of the subject does, for the report.
    pub fn describe(self) -> &'static str {
        match self {
            SubjectId::Memory => "distlock in-memory backend: acquire + release",
            SubjectId::Redis => {
                "distlock Redis: acquire script (SET NX PX + token) + release script"
            }
            SubjectId::PgLease => "distlock PostgreSQL lease table: upsert + release update",
            SubjectId::PgAdvisory => {
                "distlock PostgreSQL advisory: try-lock + token upsert, unlock (pinned session)"
            }
            SubjectId::Etcd => {
                "distlock etcd: read beside a lease granted ahead + txn, delete txn (+ background revoke)"
            }
            SubjectId::RedisPing => "baseline: Redis PING",
            SubjectId::RedisSetNx => "baseline: raw SET key v NX PX + DEL",
            SubjectId::RedisTwoStep => {
                "baseline: article two-step (SET NX PX, then INCR) + owner-checked DEL script"
            }
            SubjectId::Rslock => "peer: rslock 0.10 lock + unlock (no fencing token)",
            SubjectId::PgRawAdvisory => "baseline: raw pg_try_advisory_lock + pg_advisory_unlock",
            SubjectId::PgRawAdvisoryToken => {
                "baseline: the advisory backend's SQL sent raw (same statements)"
            }
            SubjectId::PgRawLease => "baseline: the lease-table backend's SQL sent raw",
            SubjectId::EtcdRawTxn => "baseline: raw txn put-if-absent (shared lease) + delete",
            SubjectId::EtcdRawSameOps => {
                "baseline: raw read + grant + txn put-if-absent + delete txn + background revoke"
            }
        }
    }

    /// Whether this is a distlock backend (not a baseline or peer).
    pub fn is_backend(self) -> bool {
        Self::BACKENDS.contains(&self)
    }

    /// The store the subject talks to.
    pub fn store(self) -> Store {
        match self {
            SubjectId::Memory => Store::Memory,
            SubjectId::Redis
            | SubjectId::RedisPing
            | SubjectId::RedisSetNx
            | SubjectId::RedisTwoStep
            | SubjectId::Rslock => Store::Redis,
            SubjectId::PgLease
            | SubjectId::PgAdvisory
            | SubjectId::PgRawAdvisory
            | SubjectId::PgRawAdvisoryToken
            | SubjectId::PgRawLease => Store::Postgres,
            SubjectId::Etcd | SubjectId::EtcdRawTxn | SubjectId::EtcdRawSameOps => Store::Etcd,
        }
    }

    /// The baseline a backend's ratio column is computed against: the raw client doing
    /// the same primitive operations.
    pub fn baseline(self) -> Option<SubjectId> {
        match self {
            SubjectId::Redis => Some(SubjectId::RedisSetNx),
            SubjectId::PgLease => Some(SubjectId::PgRawLease),
            SubjectId::PgAdvisory => Some(SubjectId::PgRawAdvisoryToken),
            SubjectId::Etcd => Some(SubjectId::EtcdRawSameOps),
            _ => None,
        }
    }

    /// The subject named `slug`.
    pub fn from_slug(slug: &str) -> Option<SubjectId> {
        Self::ALL.into_iter().find(|s| s.slug() == slug)
    }
}

/// A key prepared outside the measured loop: its text, its [`LockKey`] and a 64-bit id
/// for PostgreSQL advisory locks.
#[derive(Clone, Debug)]
pub struct BenchKey {
    lock: LockKey,
    id: i64,
}

impl BenchKey {
    /// Prepares `text` as a key.
    pub fn new(text: impl Into<String>) -> Result<Self, BenchError> {
        let lock = LockKey::new(text.into()).map_err(|source| BenchError::Lock {
            subject: "key",
            source,
        })?;
        let mut h = DefaultHasher::new();
        lock.as_str().hash(&mut h);
        let id = i64::from_ne_bytes(h.finish().to_ne_bytes());
        Ok(Self { lock, id })
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        self.lock.as_str()
    }

    /// The key as distlock takes it.
    pub fn lock_key(&self) -> &LockKey {
        &self.lock
    }

    /// A stable 64-bit id for advisory locks.
    pub fn id(&self) -> i64 {
        self.id
    }
}

/// What one cycle observed.
#[derive(Clone, Copy, Debug)]
pub struct Cycle {
    /// How long the acquire step took (from sending it to having the answer).
    pub acquire: Duration,
    /// Whether the key was taken (and so released again).
    pub acquired: bool,
}

impl Cycle {
    /// One cycle of the distlock backend `id` through [`LockBackend`], as an application
    /// calls it: `key` acquired with [`TTL`] (timed), and released at once when taken,
    /// which must answer `Released`.
    pub async fn of_backend(
        id: SubjectId,
        backend: &dyn LockBackend,
        key: &LockKey,
    ) -> Result<Cycle, BenchError> {
        let lock_err = |source| BenchError::Lock {
            subject: id.slug(),
            source,
        };
        let start = Instant::now();
        let lease = backend.acquire(key, TTL).await.map_err(lock_err)?;
        let acquire = start.elapsed();
        let Some(lease) = lease else {
            return Ok(Cycle {
                acquire,
                acquired: false,
            });
        };
        match backend.release(&lease).await.map_err(lock_err)? {
            Release::Released => Ok(Cycle {
                acquire,
                acquired: true,
            }),
            other => Err(BenchError::Unexpected {
                subject: id.slug(),
                detail: format!("releasing a lease just taken answered {other:?}"),
            }),
        }
    }
}

/// One measured thing: a backend or a baseline, ready to run cycles from many tasks.
#[async_trait]
pub trait Subject: Send + Sync {
    /// Which subject this is.
    fn id(&self) -> SubjectId;

    /// Acquires `key`, then releases it if it was taken.
    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError>;

    /// The distlock backend behind the subject, for renewals and batches.
    fn backend(&self) -> Option<Arc<dyn LockBackend>> {
        None
    }

    /// Gives back the subject's connections at once instead of whenever they drop.
    async fn close(&self) {}
}
