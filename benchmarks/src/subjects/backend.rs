//! A distlock backend as a subject: one acquire and release through [`LockBackend`].

use std::sync::Arc;

use async_trait::async_trait;
use distlock_core::LockBackend;
use sqlx::PgPool;

use super::{BenchKey, Cycle, Subject, SubjectId};
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
        Cycle::of_backend(self.id, self.backend.as_ref(), key.lock_key()).await
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
