//! The suite's factory over a [`TableStore`].

use std::sync::Arc;

use conformance::Factory;
use distlock::LockBackend;
use distlock::backend::async_trait;
use distlock_own_backend_example::TableStore;

/// Makes clients of one fresh store; each [`Factory::backend`] call is a new client.
pub struct TableFactory {
    store: TableStore,
}

impl TableFactory {
    /// A factory over a new, empty store.
    pub fn new() -> Self {
        Self {
            store: TableStore::new(),
        }
    }
}

#[async_trait]
impl Factory for TableFactory {
    fn name(&self) -> &str {
        "table"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(self.store.client())
    }
}
