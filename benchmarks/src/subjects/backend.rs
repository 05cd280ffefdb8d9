//! A distlock backend as a subject: one acquire and release through [`LockBackend`].

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use distlock_core::{LockBackend, Release};
use sqlx::PgPool;

use super::{BenchKey, Cycle, Subject, SubjectId, TTL};
use crate::BenchError;

/// A distlock backend measured through the `LockBackend` trait, as an application calls it.
pub(super) struct Backend {
    id: SubjectId,
    backend: Arc<dyn LockBackend>,
    pool: Option<PgPool>,
}

impl Backend {
    pub(super) fn new(id: SubjectId, backend: impl LockBackend, pool: Option<PgPool>) -> Self {
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
