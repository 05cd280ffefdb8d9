//! A layer that does one thing before every call a client sends to the store and then
//! hands the call on unchanged: what a simulated process's gate (`demo::process`, hold or
//! fail the call) and `check`'s key recorder (`used_keys`, note the call's keys) each do,
//! with the forwarding of every [`BackendLayer`] method written once here.

use std::fmt::Debug;
use std::ops::Deref;
use std::time::Duration;

use distlock::backend::{BackendLayer, async_trait};
use distlock::{Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal};

/// What a call names: a key, keys, a lease or leases.
#[derive(Debug, Clone, Copy)]
pub enum Sent<'a> {
    /// `acquire`, `inspect`, `purge`.
    Key(&'a LockKey),
    /// `acquire_any`, `acquire_many`.
    Keys(&'a [LockKey]),
    /// `renew`, `release`, `fence`.
    Lease(&'a Lease),
    /// `renew_many`, `release_many`.
    Leases(&'a [Lease]),
}

impl<'a> Sent<'a> {
    /// Every key the call names, in the order it names them.
    pub fn keys(self) -> Box<dyn Iterator<Item = &'a LockKey> + 'a> {
        match self {
            Sent::Key(key) => Box::new(std::iter::once(key)),
            Sent::Keys(keys) => Box::new(keys.iter()),
            Sent::Lease(lease) => Box::new(std::iter::once(lease.key())),
            Sent::Leases(leases) => Box::new(leases.iter().map(Lease::key)),
        }
    }
}

/// The step [`BeforeCall`] takes before each call.
///
/// Contract: `before` runs once per call, before the call reaches `next`; an error from it
/// is the call's answer and the call is not sent. Release watches and the calls the trait
/// leaves to [`BackendLayer`]'s defaults (`adopt`, `name`, `capabilities`) pass untouched.
#[async_trait]
pub trait BeforeEachCall: Debug + Send + Sync + 'static {
    /// Runs before a call that names `sent` goes on to `next`.
    async fn before(&self, next: &dyn LockBackend, sent: Sent<'_>) -> Result<(), LockError>;
}

/// The [`BackendLayer`] that runs its step's [`BeforeEachCall::before`] and then the call.
///
/// # Cancel safety
/// As the step's `before`: a call dropped there has sent nothing; one dropped later is
/// as cancel safe as `next`'s method.
#[derive(Debug, Default)]
pub struct BeforeCall<T>(pub T);

/// The step itself, so a link's `layer()` reaches the step's own methods.
impl<T> Deref for BeforeCall<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

#[async_trait]
impl<T: BeforeEachCall> BackendLayer for BeforeCall<T> {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.0.before(next, Sent::Key(key)).await?;
        next.acquire(key, ttl).await
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        self.0.before(next, Sent::Lease(lease)).await?;
        next.renew(lease).await
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        self.0.before(next, Sent::Lease(lease)).await?;
        next.release(lease).await
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        self.0.before(next, Sent::Lease(lease)).await?;
        next.fence(lease).await
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        self.0.before(next, Sent::Key(key)).await?;
        next.inspect(key).await
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        self.0.before(next, Sent::Key(key)).await?;
        next.purge(key).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.0.before(next, Sent::Keys(keys)).await?;
        next.acquire_any(keys, ttl).await
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.0.before(next, Sent::Keys(keys)).await?;
        next.acquire_many(keys, ttl).await
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.0.before(next, Sent::Leases(leases)).await?;
        next.renew_many(leases).await
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        self.0.before(next, Sent::Leases(leases)).await?;
        next.release_many(leases).await
    }
}
