//! The subject the unit tests measure: distlock's in-memory backend through
//! [`LockBackend`], one [`Cycle::of_backend`] a cycle.

use std::sync::Arc;

use async_trait::async_trait;
use distlock_core::LockBackend;
use distlock_core::memory::MemoryBackend;

use crate::error::BenchError;
use crate::subject::{BenchKey, Cycle, Subject, SubjectId};

/// Acquire + release on one in-memory backend, which it also hands out as its backend.
pub(crate) struct MemorySubject(pub(crate) Arc<MemoryBackend>);

impl MemorySubject {
    /// On a store of its own.
    pub(crate) fn new() -> Self {
        Self(Arc::new(MemoryBackend::new()))
    }
}

#[async_trait]
impl Subject for MemorySubject {
    fn id(&self) -> SubjectId {
        SubjectId::Memory
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        Cycle::of_backend(SubjectId::Memory, self.0.as_ref(), key.lock_key()).await
    }

    fn backend(&self) -> Option<Arc<dyn LockBackend>> {
        Some(self.0.clone())
    }
}
