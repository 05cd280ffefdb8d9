//! [`BackendLayer`] and [`Layered`]: middleware around a [`LockBackend`], written once.
//!
//! A wrapper that adds something to a backend (tracing, recording, fault injection) is
//! a layer: it overrides the calls it changes and leaves the rest to the trait's
//! defaults, which hand each call to the wrapped backend unchanged. [`Layered`] turns a
//! layer and a backend into a backend, and is the one place that forwards every
//! [`LockBackend`] method, so a new method cannot be forgotten by one wrapper.

pub(crate) mod faults;
pub(crate) mod instrumented;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::backend::LockBackend;
use crate::backend::lease::{BackendId, Capabilities, Fence, Lease, LockInfo, Release, Renewal};
use crate::backend::wake::ReleaseWatch;
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};

/// Middleware around a [`LockBackend`]: each method mirrors the backend method of the
/// same name and gets the wrapped backend as `next`. Wrap a backend in a layer with
/// [`Layered::new`].
///
/// # Contract
///
/// - **Override only what you change.** Every default hands the call to `next`
///   unchanged and returns its answer, so a layer that overrides nothing behaves
///   exactly like the backend it wraps, release watches, `adopt` and `purge` included.
/// - **Batches stay batches.** The defaults of `acquire_many`, `renew_many` and
///   `release_many` call `next`'s batch form (one round trip where the store offers it),
///   not this layer's single forms. A layer that changes single calls and must see the
///   batched ones too overrides the batch forms as well.
/// - **Stay consistent with `next`.** A layer that changes what
///   [`BackendLayer::capabilities`] says also changes what follows from it (hiding
///   `wakes_waiters` means `watch_releases` returns `None`), and the wrapped result
///   still meets the [`LockBackend`] contract.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::time::Duration;
/// use distlock::memory::MemoryBackend;
/// use distlock::backend::{BackendLayer, Layered, async_trait};
/// use distlock::{Lease, LockBackend, LockError, LockKey};
///
/// /// Counts acquire calls; everything else goes through unchanged.
/// #[derive(Debug, Default)]
/// struct CountAcquires(AtomicUsize);
///
/// #[async_trait]
/// impl BackendLayer for CountAcquires {
///     async fn acquire(
///         &self,
///         next: &dyn LockBackend,
///         key: &LockKey,
///         ttl: Duration,
///     ) -> Result<Option<Lease>, LockError> {
///         self.0.fetch_add(1, Ordering::Relaxed);
///         next.acquire(key, ttl).await
///     }
/// }
///
/// let backend = Layered::new(Arc::new(MemoryBackend::new()), CountAcquires::default());
/// let lease = backend.acquire(&LockKey::new("job:1")?, Duration::from_secs(5)).await?;
/// backend.release(&lease.expect("a free key")).await?;
/// assert_eq!(backend.layer().0.load(Ordering::Relaxed), 1);
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// [`Layered`] adds no await point of its own: a call through it is as cancel safe as
/// the layer's method, and a default is as cancel safe as `next`'s method. A layer that
/// awaits something of its own (a gate, a delay) or keeps state across `next`'s await
/// (a start instant, a count) says in its docs what a cancelled call leaves behind.
#[async_trait]
pub trait BackendLayer: Debug + Send + Sync + 'static {
    /// [`LockBackend::name`].
    fn name(&self, next: &dyn LockBackend) -> &'static str {
        next.name()
    }

    /// [`LockBackend::capabilities`].
    fn capabilities(&self, next: &dyn LockBackend) -> Capabilities {
        next.capabilities()
    }

    /// [`LockBackend::acquire`].
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        next.acquire(key, ttl).await
    }

    /// [`LockBackend::renew`].
    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        next.renew(lease).await
    }

    /// [`LockBackend::release`].
    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        next.release(lease).await
    }

    /// [`LockBackend::fence`].
    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        next.fence(lease).await
    }

    /// [`LockBackend::inspect`].
    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        next.inspect(key).await
    }

    /// [`LockBackend::watch_releases`].
    fn watch_releases(&self, next: &dyn LockBackend, key: &LockKey) -> Option<ReleaseWatch> {
        next.watch_releases(key)
    }

    /// [`LockBackend::watch_permit_releases`].
    fn watch_permit_releases(
        &self,
        next: &dyn LockBackend,
        slots: &[LockKey],
    ) -> Option<ReleaseWatch> {
        next.watch_permit_releases(slots)
    }

    /// [`LockBackend::watched_keys`].
    fn watched_keys(&self, next: &dyn LockBackend) -> Vec<LockKey> {
        next.watched_keys()
    }

    /// [`LockBackend::adopt`].
    fn adopt(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        next.adopt(key, owner, token, ttl)
    }

    /// [`LockBackend::purge`].
    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        next.purge(key).await
    }

    /// [`LockBackend::acquire_any`].
    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        next.acquire_any(keys, ttl).await
    }

    /// [`LockBackend::acquire_many`].
    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        next.acquire_many(keys, ttl).await
    }

    /// [`LockBackend::renew_many`].
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        next.renew_many(leases).await
    }

    /// [`LockBackend::release_many`].
    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        next.release_many(leases).await
    }
}

/// A layer shared behind an `Arc` is the same layer: code that keeps a clone of the
/// `Arc` reads the layer's state (its counts, its switches) while the backend runs.
///
/// Every method is forwarded (the lint says so when one is added): a default here would
/// bypass the layer.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<L: BackendLayer + ?Sized> BackendLayer for Arc<L> {
    fn name(&self, next: &dyn LockBackend) -> &'static str {
        (**self).name(next)
    }

    fn capabilities(&self, next: &dyn LockBackend) -> Capabilities {
        (**self).capabilities(next)
    }

    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        (**self).acquire(next, key, ttl).await
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        (**self).renew(next, lease).await
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        (**self).release(next, lease).await
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        (**self).fence(next, lease).await
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        (**self).inspect(next, key).await
    }

    fn watch_releases(&self, next: &dyn LockBackend, key: &LockKey) -> Option<ReleaseWatch> {
        (**self).watch_releases(next, key)
    }

    fn watch_permit_releases(
        &self,
        next: &dyn LockBackend,
        slots: &[LockKey],
    ) -> Option<ReleaseWatch> {
        (**self).watch_permit_releases(next, slots)
    }

    fn watched_keys(&self, next: &dyn LockBackend) -> Vec<LockKey> {
        (**self).watched_keys(next)
    }

    fn adopt(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        (**self).adopt(next, key, owner, token, ttl)
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        (**self).purge(next, key).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        (**self).acquire_any(next, keys, ttl).await
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        (**self).acquire_many(next, keys, ttl).await
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        (**self).renew_many(next, leases).await
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        (**self).release_many(next, leases).await
    }
}

/// A backend wrapped in a [`BackendLayer`]: every call goes to the layer, with the
/// wrapped backend as `next`.
#[derive(Debug, Clone)]
pub struct Layered<L> {
    inner: Arc<dyn LockBackend>,
    layer: L,
}

impl<L: BackendLayer> Layered<L> {
    /// Wraps `inner` in `layer`.
    pub fn new(inner: Arc<dyn LockBackend>, layer: L) -> Self {
        Self { inner, layer }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn LockBackend> {
        &self.inner
    }

    /// The layer.
    pub fn layer(&self) -> &L {
        &self.layer
    }
}

/// Every method goes through the layer (the lint says so when one is added): a default
/// here would bypass it, and a waiter on a layered backend would poll.
#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl<L: BackendLayer> LockBackend for Layered<L> {
    fn name(&self) -> &'static str {
        self.layer.name(&*self.inner)
    }

    fn capabilities(&self) -> Capabilities {
        self.layer.capabilities(&*self.inner)
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.layer.acquire(&*self.inner, key, ttl).await
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.layer.renew(&*self.inner, lease).await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.layer.release(&*self.inner, lease).await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.layer.fence(&*self.inner, lease).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.layer.inspect(&*self.inner, key).await
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.layer.watch_releases(&*self.inner, key)
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.layer.watch_permit_releases(&*self.inner, slots)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.layer.watched_keys(&*self.inner)
    }

    fn adopts_as(&self) -> Option<BackendId> {
        self.inner.adopts_as()
    }

    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        self.layer.adopt(&*self.inner, key, owner, token, ttl)
    }

    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.layer.purge(&*self.inner, key).await
    }

    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.layer.acquire_any(&*self.inner, keys, ttl).await
    }

    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.layer.acquire_many(&*self.inner, keys, ttl).await
    }

    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        self.layer.renew_many(&*self.inner, leases).await
    }

    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        self.layer.release_many(&*self.inner, leases).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::time::timeout;

    use super::*;
    use crate::memory::MemoryBackend;

    const TTL: Duration = Duration::from_secs(5);

    /// Overrides nothing.
    #[derive(Debug)]
    struct Empty;

    impl BackendLayer for Empty {}

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    #[tokio::test]
    async fn an_empty_layer_forwards_every_call() {
        let store = Arc::new(MemoryBackend::new());
        let layered = Layered::new(store.clone(), Empty);
        assert_eq!(layered.name(), store.name());
        assert_eq!(layered.capabilities(), store.capabilities());

        let lease = layered.acquire(&key("one"), TTL).await.unwrap().unwrap();
        assert!(layered.acquire(&key("one"), TTL).await.unwrap().is_none());
        assert!(matches!(
            layered.renew(&lease).await.unwrap(),
            Renewal::Renewed { .. }
        ));
        assert_eq!(layered.fence(&lease).await.unwrap(), Fence::Current);
        let info = layered.inspect(&key("one")).await.unwrap();
        assert_eq!(
            (info.owner, info.token),
            (Some(lease.owner()), Some(lease.token()))
        );

        let adopted = layered
            .adopt(&key("one"), lease.owner(), lease.token(), TTL)
            .unwrap();
        assert_eq!(layered.release(&adopted).await.unwrap(), Release::Released);
        assert_eq!(layered.release(&lease).await.unwrap(), Release::NotHeld);
        layered.purge(&key("one")).await.unwrap();
        let info = store.inspect(&key("one")).await.unwrap();
        assert_eq!(info.token, None, "the purge reached the store");

        let keys = [key("a"), key("b")];
        let leases: Vec<Lease> = layered
            .acquire_many(&keys, TTL)
            .await
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(leases.len(), 2);
        let renewals = layered.renew_many(&leases).await.unwrap();
        assert!(
            renewals
                .iter()
                .all(|r| matches!(r, Renewal::Renewed { .. }))
        );
        assert_eq!(
            layered.release_many(&leases).await.unwrap(),
            vec![Release::Released; 2]
        );
    }

    #[tokio::test]
    async fn a_release_through_an_empty_layer_wakes_a_watch_made_through_it() {
        let layered = Layered::new(Arc::new(MemoryBackend::new()), Empty);
        let lease = layered.acquire(&key("k"), TTL).await.unwrap().unwrap();
        let mut watch = layered
            .watch_releases(&key("k"))
            .expect("memory wakes waiters");
        assert_eq!(layered.watched_keys(), vec![key("k")]);

        layered.release(&lease).await.unwrap();
        timeout(Duration::from_secs(5), watch.released())
            .await
            .expect("the release woke the watch");
        drop(watch);
        assert!(layered.watched_keys().is_empty());
    }

    /// Counts single acquire calls.
    #[derive(Debug, Default)]
    struct CountAcquires(AtomicUsize);

    #[async_trait]
    impl BackendLayer for CountAcquires {
        async fn acquire(
            &self,
            next: &dyn LockBackend,
            key: &LockKey,
            ttl: Duration,
        ) -> Result<Option<Lease>, LockError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            next.acquire(key, ttl).await
        }
    }

    #[tokio::test]
    async fn a_layer_behind_an_arc_shares_its_state_with_the_caller() {
        let counts = Arc::new(CountAcquires::default());
        let layered = Layered::new(Arc::new(MemoryBackend::new()), counts.clone());
        layered.acquire(&key("k"), TTL).await.unwrap();
        layered.acquire(&key("k"), TTL).await.unwrap();
        assert_eq!(counts.0.load(Ordering::SeqCst), 2);
    }
}
