//! A simulated worker process's connection to the lock store, so pauses and crashes
//! affect everything the process does, its renewal task included.
//!
//! A real stop-the-world pause freezes the watchdog along with the job: no renewal is
//! sent until the process thaws. A crashed process sends nothing at all. Tokio tasks
//! share one runtime, so each simulated process talks to the store through its own
//! [`ProcessLink`], which holds calls while the process is frozen and fails them once
//! it has crashed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distlock::wake::ReleaseWatch;
use distlock::{
    Capabilities, Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal,
    async_trait,
};
use parking_lot::Mutex;
use tokio::time::{Instant, sleep_until};

/// One process's connection to the store.
#[derive(Debug)]
pub struct ProcessLink {
    store: Arc<dyn LockBackend>,
    frozen_until: Mutex<Option<Instant>>,
    crashed: AtomicBool,
}

impl ProcessLink {
    /// A live process on `store`.
    pub fn new(store: Arc<dyn LockBackend>) -> Self {
        Self {
            store,
            frozen_until: Mutex::new(None),
            crashed: AtomicBool::new(false),
        }
    }

    /// Freezes the process for `pause`: calls made meanwhile wait until it ends.
    pub fn freeze(&self, pause: Duration) {
        *self.frozen_until.lock() = Some(Instant::now() + pause);
    }

    /// Kills the process: every call from now on fails and reaches nothing.
    pub fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
    }

    async fn gate(&self) -> Result<(), LockError> {
        let thaw = *self.frozen_until.lock();
        if let Some(thaw) = thaw {
            sleep_until(thaw).await;
        }
        if self.crashed.load(Ordering::SeqCst) {
            return Err(LockError::unavailable(
                self.store.name(),
                "the worker process crashed",
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl LockBackend for ProcessLink {
    fn name(&self) -> &'static str {
        self.store.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.gate().await?;
        self.store.acquire(key, ttl).await
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.gate().await?;
        self.store.renew(lease).await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.gate().await?;
        self.store.release(lease).await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.gate().await?;
        self.store.fence(lease).await
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.store.watch_releases(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.store.watched_keys()
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.gate().await?;
        self.store.inspect(key).await
    }

    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.gate().await?;
        self.store.acquire_many(keys, ttl).await
    }

    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        self.gate().await?;
        self.store.renew_many(leases).await
    }

    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        self.gate().await?;
        self.store.release_many(leases).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock::memory::MemoryBackend;

    #[tokio::test(start_paused = true)]
    async fn a_frozen_process_sends_nothing_until_it_thaws() {
        let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let link = ProcessLink::new(store.clone());
        let key = LockKey::new("k").unwrap();
        let lease = link
            .acquire(&key, Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        link.freeze(Duration::from_secs(3));
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
        let link = ProcessLink::new(store.clone());
        let key = LockKey::new("k").unwrap();
        let lease = link
            .acquire(&key, Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        link.crash();
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
