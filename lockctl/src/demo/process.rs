//! A simulated worker process's connection to the lock store, so pauses and crashes
//! affect everything the process does, its renewal task included.
//!
//! A real stop-the-world pause freezes the watchdog along with the job: no renewal is
//! sent until the process thaws. A crashed process sends nothing at all. Tokio tasks
//! share one runtime, so each simulated process talks to the store through its own
//! [`ProcessLink`], which holds calls while the process is frozen and fails them once
//! it has crashed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distlock::backend::{BackendLayer, Layered, async_trait};
use distlock::{Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal};
use parking_lot::Mutex;
use tokio::time::{Instant, sleep_until};

/// One process's connection to the store: every call it makes passes its [`ProcessGate`]
/// (`link.layer()`).
pub type ProcessLink = Layered<ProcessGate>;

/// A live process on `store`.
pub fn process_link(store: std::sync::Arc<dyn LockBackend>) -> ProcessLink {
    Layered::new(store, ProcessGate::default())
}

/// What a process's pauses and crash do to its calls: held while it is frozen, failed
/// once it has crashed. Release watches pass untouched (a waiter's wake is local).
#[derive(Debug, Default)]
pub struct ProcessGate {
    frozen_until: Mutex<Option<Instant>>,
    crashed: AtomicBool,
}

impl ProcessGate {
    /// Freezes the process for `pause`: calls made meanwhile wait until it ends.
    pub fn freeze(&self, pause: Duration) {
        *self.frozen_until.lock() = Some(Instant::now() + pause);
    }

    /// Kills the process: every call from now on fails and reaches nothing.
    pub fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
    }

    async fn pass(&self, store: &dyn LockBackend) -> Result<(), LockError> {
        let thaw = *self.frozen_until.lock();
        if let Some(thaw) = thaw {
            sleep_until(thaw).await;
        }
        if self.crashed.load(Ordering::SeqCst) {
            return Err(LockError::unavailable(
                store.name(),
                "the worker process crashed",
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl BackendLayer for ProcessGate {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.pass(next).await?;
        next.acquire(key, ttl).await
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        self.pass(next).await?;
        next.renew(lease).await
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        self.pass(next).await?;
        next.release(lease).await
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        self.pass(next).await?;
        next.fence(lease).await
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        self.pass(next).await?;
        next.inspect(key).await
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        self.pass(next).await?;
        next.purge(key).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.pass(next).await?;
        next.acquire_any(keys, ttl).await
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.pass(next).await?;
        next.acquire_many(keys, ttl).await
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.pass(next).await?;
        next.renew_many(leases).await
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        self.pass(next).await?;
        next.release_many(leases).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use distlock::memory::MemoryBackend;

    #[tokio::test(start_paused = true)]
    async fn a_frozen_process_sends_nothing_until_it_thaws() {
        let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let link = process_link(store.clone());
        let key = LockKey::new("k").unwrap();
        let lease = link
            .acquire(&key, Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        link.layer().freeze(Duration::from_secs(3));
        // The renewal is held past the TTL, so it reaches the store too late.
        assert_eq!(link.renew(&lease).await.unwrap(), Renewal::Lost);
        assert!(
            store
                .acquire(&key, Duration::from_secs(1))
                .await
                .unwrap()
                .is_some()
        );
    }

    #[tokio::test]
    async fn a_crashed_process_reaches_nothing() {
        let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let link = process_link(store.clone());
        let key = LockKey::new("k").unwrap();
        let lease = link
            .acquire(&key, Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        link.layer().crash();
        assert!(link.release(&lease).await.unwrap_err().is_retryable());
        assert!(
            store
                .acquire(&key, Duration::from_secs(5))
                .await
                .unwrap()
                .is_none()
        );
    }
}
