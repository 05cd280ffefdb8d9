//! [`WriteFence`]: the name a holder's writes are fenced under and its token, taken
//! together from the lease, and [`FencedResourceExt`], the fenced resource's calls that
//! take one.
//!
//! A token is ordered only against the other tokens of the key it was granted on. Passing
//! the name and the token separately lets a caller pair a token with a name whose tokens
//! it is not ordered against: a permit's token under its semaphore's name makes the
//! holders of two slots refuse each other. A `WriteFence` is made from the lease alone,
//! so its name is always the key its token was granted on.

use async_trait::async_trait;

use crate::error::LockError;
use crate::fencing::{Admission, FencedResource};
use crate::key::{FencingToken, LockKey};

/// The key a lease was granted on and its fencing token, together: what a holder's writes
/// are fenced under ([`FencedResourceExt::write_under`]).
///
/// It is made from the lease only ([`Permit::fence`] for a permit, the slot's key;
/// [`WriteFence::of`] for a lock's guard), never from a name and a token given apart, so
/// a token is never checked against another key's. Cheap to clone: hand it to the tasks
/// that write for the job.
///
/// [`Permit::fence`]: crate::locker::semaphore::Permit::fence
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct WriteFence {
    key: LockKey,
    token: FencingToken,
}

impl WriteFence {
    /// The fence of the grant of `token` on `key`: made by the leases only (see
    /// `WriteFence::of`, in the locker's guard).
    pub(crate) fn granted(key: LockKey, token: FencingToken) -> Self {
        Self { key, token }
    }

    /// The key the token was granted on: the resource name the fenced resource keeps the
    /// highest token under (for a permit, its slot `<name>:permit:<n>`).
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token of the grant.
    pub fn token(&self) -> FencingToken {
        self.token
    }
}

/// The calls of a [`FencedResource`] that take a [`WriteFence`], for every fenced
/// resource: each is the trait's call under the fence's key and with its token.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use distlock::{EnforcementMode, FencedResourceExt, LockKey, Locker, MemoryFencedResource};
///
/// let locker = Locker::new(distlock::connect("memory://").await?)?;
/// let exports = locker.semaphore(&LockKey::new("exports:tenant-7")?, 2)?;
/// let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
/// let first = exports.acquire().await?;
/// let second = exports.acquire().await?;
/// // Each permit writes under its own slot's fence: both holders are admitted, whatever
/// // their tokens, and a holder whose slot went to another is refused.
/// assert!(ledger.write_under(&second.fence(), b"rows 0-99").await?.is_admitted());
/// assert!(ledger.write_under(&first.fence(), b"rows 100-199").await?.is_admitted());
/// # Ok(()) }
/// ```
#[async_trait]
pub trait FencedResourceExt: FencedResource {
    /// [`FencedResource::write`] under the fence: stores `value` as the value of the
    /// fence's key if its token is at least the highest admitted for that key, in one
    /// atomic step of the store.
    ///
    /// # Cancel safety
    /// As [`FencedResource::write`]: a cancelled write may or may not have been applied
    /// (never a stale one in enforce mode).
    async fn write_under(&self, fence: &WriteFence, value: &[u8]) -> Result<Admission, LockError> {
        self.write(fence.key.as_str(), fence.token, value).await
    }

    /// [`FencedResource::check_only`] under the fence: **check only**, not atomic with any
    /// write (see the trait's docs).
    ///
    /// # Cancel safety
    /// As [`FencedResource::check_only`]: a cancelled call may or may not have recorded
    /// the token; it never writes.
    async fn check_only_under(&self, fence: &WriteFence) -> Result<Admission, LockError> {
        self.check_only(fence.key.as_str(), fence.token).await
    }

    /// [`FencedResource::read`] of the value last written under the fence's key, by any
    /// holder of that key.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn read_under(&self, fence: &WriteFence) -> Result<Option<Vec<u8>>, LockError> {
        self.read(fence.key.as_str()).await
    }
}

impl<R: FencedResource + ?Sized> FencedResourceExt for R {}
