//! Bugs `lockctl torture --break` puts into the store's client, to show that the checker
//! catches a store that breaks mutual exclusion: each is a way real deployments have
//! lost locks. Never use them for anything else.

use std::sync::Arc;
use std::time::Duration;

use distlock::backend::{BackendLayer, Layered, async_trait};
use distlock::{Lease, LockBackend, LockError, LockKey};

/// A bug to put into the workers' clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Break {
    /// The store loses a held lock whenever another worker asks for it, as a store that
    /// evicts keys under memory pressure or fails over to a replica that missed the
    /// grant does: an acquire that finds the key held purges it and takes it.
    LoseHeldKeys,
}

impl Break {
    /// `backend` with the bug.
    pub fn into_backend(self, backend: Arc<dyn LockBackend>) -> Arc<dyn LockBackend> {
        match self {
            Break::LoseHeldKeys => Arc::new(Layered::new(backend, LoseHeldKeys)),
        }
    }
}

#[derive(Debug)]
struct LoseHeldKeys;

#[async_trait]
impl BackendLayer for LoseHeldKeys {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        match next.acquire(key, ttl).await? {
            Some(lease) => Ok(Some(lease)),
            None => {
                next.purge(key).await?;
                next.acquire(key, ttl).await
            }
        }
    }
}
