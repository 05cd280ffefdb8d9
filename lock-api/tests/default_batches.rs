//! The trait's default batch forms keep the contract for a backend that implements only
//! the single forms, as a third party's first backend does: a batch with a foreign lease
//! changes nothing.

use std::time::Duration;

use async_trait::async_trait;
use distlock_core::memory::MemoryBackend;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    Capabilities, Fence, Lease, LockBackend, LockError, LockKey, Release, Renewal,
};

/// A backend with only the required methods, over the memory backend.
#[derive(Debug, Default)]
struct SingleFormsOnly(MemoryBackend);

#[async_trait]
impl LockBackend for SingleFormsOnly {
    fn name(&self) -> &'static str {
        "single-forms-only"
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.0.acquire(key, ttl).await
    }
    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.0.renew(lease).await
    }
    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.0.release(lease).await
    }
    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.0.fence(lease).await
    }
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.0.watch_releases(key)
    }
    fn watched_keys(&self) -> Vec<LockKey> {
        self.0.watched_keys()
    }
}

const TTL: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_default_batch_with_a_foreign_lease_releases_and_renews_nothing() {
    let (ours, theirs) = (SingleFormsOnly::default(), SingleFormsOnly::default());
    let key = |name: &str| LockKey::new(name).unwrap();
    let own = ours.acquire(&key("own"), TTL).await.unwrap().unwrap();
    let foreign = theirs.acquire(&key("foreign"), TTL).await.unwrap().unwrap();

    for batch in [
        vec![own.clone(), foreign.clone()],
        vec![foreign.clone(), own.clone()],
    ] {
        let released = ours.release_many(&batch).await;
        assert!(
            matches!(released, Err(LockError::ForeignLease { .. })),
            "{released:?}"
        );
        let renewed = ours.renew_many(&batch).await;
        assert!(
            matches!(renewed, Err(LockError::ForeignLease { .. })),
            "{renewed:?}"
        );
        assert_eq!(
            ours.fence(&own).await.unwrap(),
            Fence::Current,
            "own lease kept"
        );
    }
    assert!(matches!(
        ours.release_many(std::slice::from_ref(&foreign)).await,
        Err(LockError::ForeignLease { .. })
    ));
    assert_eq!(theirs.fence(&foreign).await.unwrap(), Fence::Current);
    assert_eq!(
        ours.release_many(std::slice::from_ref(&own)).await.unwrap(),
        [Release::Released]
    );
}
