//! [`Permit`], one held permit of a [`Semaphore`], and [`Permits`], several taken
//! together.

use std::fmt;

use crate::backend::lease::Release;
use crate::error::LockError;
use crate::fencing::WriteFence;
use crate::key::{FencingToken, LockKey};
use crate::locker::guard::{LeaseStatus, LockGuard};

#[cfg(doc)]
use super::Semaphore;
#[cfg(doc)]
use crate::fencing::{FencedResource, FencedResourceExt};

/// One held permit of a [`Semaphore`]: a lease on one of its slots, renewed by the
/// locker's watchdog until released. Dropping it releases it in the background, as
/// dropping a [`LockGuard`] does.
///
/// **Fence its writes with [`Permit::fence`]**, the slot's key and the permit's token
/// together ([`FencedResourceExt::write_under`]): its token is its slot's fencing token,
/// which strictly increases with every grant of that slot, so a store downstream that
/// fences per slot rejects a permit holder that lost its permit to another. Tokens of
/// different slots are not ordered against each other: fenced under one name (the
/// semaphore's), the holders of two slots refuse each other.
#[must_use = "a permit is released as soon as it is dropped"]
pub struct Permit {
    pub(super) guard: LockGuard,
    pub(super) slot: u32,
}

impl Permit {
    /// The slot this permit holds, from 0.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot's key, `<name>:permit:<slot>`.
    pub fn key(&self) -> &LockKey {
        self.guard.key()
    }

    /// What to fence the permit's writes with: the slot's key and this grant's token,
    /// together. Hand it to [`FencedResourceExt::write_under`] (or
    /// [`MemoryFencedResource::admit_under`](crate::MemoryFencedResource::admit_under)):
    /// a holder of this slot that lost it to another is refused, and the holders of other
    /// slots are not.
    pub fn fence(&self) -> WriteFence {
        WriteFence::of(&self.guard)
    }

    /// The slot's fencing token for this grant, **ordered only against other grants of
    /// the same slot**.
    ///
    /// To fence a write, use [`Permit::fence`]: passed to [`FencedResource::write`] with
    /// the semaphore's name (or any name other than [`Permit::key`]), this token refuses
    /// legitimate holders: once the holder of one slot has written with a higher token,
    /// a holder of another slot, whose permit is valid, is stale there.
    pub fn token(&self) -> FencingToken {
        self.guard.token()
    }

    /// True until the permit is lost, released, or past its local validity deadline.
    pub fn is_held(&self) -> bool {
        self.guard.is_held()
    }

    /// The permit's status, to hand to the job's tasks ([`LeaseStatus::while_held`]).
    pub fn status(&self) -> LeaseStatus {
        self.guard.status()
    }

    /// The lease behind the permit, as a guard.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Stops renewal and gives the permit back. `Release::NotHeld` means it had already
    /// been lost.
    ///
    /// # Cancel safety
    /// As [`LockGuard::release`]: if dropped before the store answers, the permit frees
    /// itself when its TTL runs out.
    pub async fn release(self) -> Result<Release, LockError> {
        self.guard.release().await
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("key", self.key())
            .field("slot", &self.slot)
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish_non_exhaustive()
    }
}

/// Several permits of one [`Semaphore`], taken together, all or none
/// ([`Semaphore::acquire_many`]), each on its own slot with its own token. They are
/// renewed by the locker's watchdog like any permit; [`Permits::release`] gives them all
/// back at once, and dropping them releases each in the background.
#[must_use = "permits are released as soon as they are dropped"]
pub struct Permits {
    permits: Vec<Permit>,
}

impl Permits {
    pub(super) fn new(permits: Vec<Permit>) -> Self {
        Self { permits }
    }

    /// How many permits these are.
    pub fn len(&self) -> usize {
        self.permits.len()
    }

    /// Never true for permits a semaphore granted (it grants at least one); here for
    /// symmetry with [`Permits::len`].
    pub fn is_empty(&self) -> bool {
        self.permits.is_empty()
    }

    /// Each permit, in the order taken: its slot, key and token (fence each write with
    /// the permit it uses, [`Permit::fence`]).
    pub fn iter(&self) -> std::slice::Iter<'_, Permit> {
        self.permits.iter()
    }

    /// Each permit's [`Permit::fence`], in the order taken: one per slot held, each
    /// admitted by a fenced resource whatever the tokens of the other slots.
    pub fn fences(&self) -> Vec<WriteFence> {
        self.permits.iter().map(Permit::fence).collect()
    }

    /// The slots held, in the order taken.
    pub fn slots(&self) -> Vec<u32> {
        self.permits.iter().map(Permit::slot).collect()
    }

    /// True until one of them is lost, released, or past its local validity deadline.
    pub fn is_held(&self) -> bool {
        self.permits.iter().all(Permit::is_held)
    }

    /// The permits, to release or hand on one by one.
    pub fn into_vec(self) -> Vec<Permit> {
        self.permits
    }

    /// Stops renewing them all and gives them all back, the releases sent concurrently:
    /// one [`Release`] per permit, in order (`NotHeld` for one already lost), or the first
    /// error (the others were still sent).
    ///
    /// # Cancel safety
    /// Renewal of every permit stops at once; a permit whose release is dropped before
    /// the store answers frees itself when its TTL runs out.
    pub async fn release(self) -> Result<Vec<Release>, LockError> {
        let released =
            futures::future::join_all(self.permits.into_iter().map(Permit::release)).await;
        released.into_iter().collect()
    }
}

impl IntoIterator for Permits {
    type Item = Permit;
    type IntoIter = std::vec::IntoIter<Permit>;

    fn into_iter(self) -> Self::IntoIter {
        self.permits.into_iter()
    }
}

impl fmt::Debug for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.permits).finish()
    }
}
