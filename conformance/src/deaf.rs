//! [`Deaf`]: a layer whose release watches never fire.

use async_trait::async_trait;
use distlock_core::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use distlock_core::{BackendLayer, LockBackend, LockKey};

/// A layer whose release watches never fire, as when every notification is lost (a
/// listener whose connection silently stopped delivering): a waiter on it takes a
/// released key only by its backoff. The watches are real ones, so the backend's
/// `watched_keys` still shows what its waiters wait for.
#[derive(Debug)]
pub struct Deaf {
    silent: ReleaseHub,
}

impl Default for Deaf {
    fn default() -> Self {
        Self {
            silent: ReleaseHub::new(AllKeys),
        }
    }
}

#[async_trait]
impl BackendLayer for Deaf {
    fn watch_releases(&self, _: &dyn LockBackend, key: &LockKey) -> Option<ReleaseWatch> {
        Some(self.silent.watch(key))
    }
    fn watched_keys(&self, _: &dyn LockBackend) -> Vec<LockKey> {
        self.silent.watched_keys()
    }
}
