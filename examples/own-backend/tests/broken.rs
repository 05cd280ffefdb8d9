//! The suite catches a bug in this backend: a client whose release, finding the key held
//! by someone else, frees it anyway ("the lock must be stuck"), as a store that deletes
//! locks by key does. It is the bug of the suite's own
//! `BrokenKind::ReleaseWithoutOwnerCheck`, so the cases `CAUGHT_BY` names for that
//! variant must fail on it, with I4 in the history check, while the same store without
//! the bug passes them. Run with `--nocapture` to see the failures.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TableFactory;
use conformance::Factory;
use conformance::broken::{BrokenKind, Caught, run_each};
use distlock::backend::wake::ReleaseWatch;
use distlock::backend::{BackendId, async_trait};
use distlock::{
    Capabilities, Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal,
};

/// A client of the table store with the bug in its release; everything else is the
/// client's own.
#[derive(Debug)]
struct ForceRelease(Arc<dyn LockBackend>);

#[async_trait]
impl LockBackend for ForceRelease {
    fn name(&self) -> &'static str {
        "table (force release)"
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

    /// The bug: a key someone else holds is freed anyway, with the holder's own owner id
    /// and token (read with `inspect`), and reported `Released`.
    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        if self.0.release(lease).await? == Release::Released {
            return Ok(Release::Released);
        }
        let info = self.0.inspect(lease.key()).await?;
        let (Some(owner), Some(token)) = (info.owner, info.token) else {
            return Ok(Release::NotHeld);
        };
        let holder = self.0.adopt(lease.key(), owner, token, lease.ttl())?;
        self.0.release(&holder).await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.0.fence(lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.0.inspect(key).await
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.0.watch_releases(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.0.watched_keys()
    }

    fn adopts_as(&self) -> Option<BackendId> {
        self.0.adopts_as()
    }

    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.0.purge(key).await
    }

    // The batch forms are the trait's defaults, which call the release above.
}

/// Clients of one fresh table store, each with the bug.
struct ForceReleaseFactory(TableFactory);

#[async_trait]
impl Factory for ForceReleaseFactory {
    fn name(&self) -> &str {
        "table (force release)"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(ForceRelease(self.0.backend().await))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_catches_a_release_that_frees_a_key_held_by_another() {
    let control = Caught::of(&run_each(TableFactory::new).await);
    assert!(
        control.cases.is_empty(),
        "the store without the bug must pass every case it can run: {control}"
    );

    let results = run_each(|| ForceReleaseFactory(TableFactory::new())).await;
    for failure in results
        .iter()
        .filter_map(|(_, result)| result.as_ref().err())
    {
        println!("{failure}");
    }
    let caught = Caught::of(&results);
    conformance::summary::record(
        "broken-variants",
        &format!("own backend (examples/own-backend), force release: {caught}"),
    );
    let must = BrokenKind::ReleaseWithoutOwnerCheck.caught_by();
    let lacks = caught.lacks(must.cases, must.invariants);
    assert!(lacks.is_empty(), "force release {}", lacks.join("; "));
    assert_eq!(control.ran, caught.ran, "the same cases ran on both");
}
