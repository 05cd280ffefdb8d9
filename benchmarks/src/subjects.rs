//! What the benchmarks measure: every distlock backend, and beside each store the raw-client
//! baselines and the `rslock` peer it is compared with, all behind [`Subject`].
//!
//! A subject performs one *cycle* per call: acquire a free key, then release it. The
//! baselines do the same with the store's primitive operations and nothing else, so the
//! ratio of a backend to its matching baseline ([`SubjectId::baseline`]) is the cost of the
//! abstraction, measured in one run against one server.
//!
//! Here: [`open`], which makes the subject of a [`SubjectId`]. Beside it, one file each
//! for the servers a run starts ([`Servers`]), a distlock backend as a subject, and the
//! baselines of each store.

mod backend;
mod raw_etcd;
mod raw_postgres;
mod raw_redis;
mod servers;

use std::sync::Arc;

use distlock_core::memory::MemoryBackend;

pub use capacity::subject::{BenchKey, Cycle, Store, Subject, SubjectId, TTL};
pub use servers::Servers;

use crate::BenchError;
use backend::Backend;
use raw_etcd::RawEtcd;
use raw_postgres::RawPostgres;
use raw_redis::RawRedis;

/// Connections per PostgreSQL pool: one per task at the highest concurrency measured (64),
/// plus slack. Each pool is closed before the next subject opens its own, so the server's
/// `max_connections` (200 in the harness) is never reached.
pub const PG_POOL_SIZE: u32 = 66;

/// Connects `id` to its server and prepares it (tables, scripts, shared leases).
pub async fn open(id: SubjectId, servers: &Servers) -> Result<Arc<dyn Subject>, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: id.slug(),
        source,
    };
    Ok(match id {
        SubjectId::Memory => Arc::new(Backend::new(id, MemoryBackend::new(), None)),
        SubjectId::Redis
        | SubjectId::RedisPing
        | SubjectId::RedisSetNx
        | SubjectId::RedisTwoStep
        | SubjectId::Rslock => open_redis(id, &servers.redis_url()?).await?,
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
        SubjectId::PgRawAdvisory | SubjectId::PgRawAdvisoryToken | SubjectId::PgRawLease => {
            Arc::new(RawPostgres::connect(id, &servers.postgres_url()?).await?)
        }
        SubjectId::EtcdRawTxn | SubjectId::EtcdRawSameOps => {
            Arc::new(RawEtcd::connect(id, &servers.etcd_endpoint()?).await?)
        }
    })
}

/// Connects `id`, a subject of the Redis store, to the server at `url`.
pub async fn open_redis(id: SubjectId, url: &str) -> Result<Arc<dyn Subject>, BenchError> {
    match id {
        SubjectId::Redis => {
            let backend = lock_redis::RedisBackend::builder()
                .url(url)
                .build()
                .await
                .map_err(|source| BenchError::Lock {
                    subject: id.slug(),
                    source,
                })?;
            Ok(Arc::new(Backend::new(id, backend, None)))
        }
        SubjectId::RedisPing
        | SubjectId::RedisSetNx
        | SubjectId::RedisTwoStep
        | SubjectId::Rslock => Ok(Arc::new(RawRedis::connect(id, url).await?)),
        other => Err(BenchError::Unexpected {
            subject: other.slug(),
            detail: "not a subject of the Redis store".into(),
        }),
    }
}
