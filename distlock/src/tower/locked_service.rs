//! What each of this module's layers hands its inner service: a job with its lease,
//! [`Locked`], and [`LockedService`], the bound that inner service meets, named once.

use distlock_core::{FencingToken, LeaseStatus, LockGuard, LockKey, WriteFence};
use tower_service::Service;

/// A service that runs a job `R` handed over as [`Locked<R>`], which [`LockService`],
/// [`LeaderService`] and [`TickService`] can wrap: cloneable, and sendable with its
/// future, response and error, since a wrapped call runs on a spawned task.
///
/// Every such service is one (a blanket implementation); nothing to implement.
///
/// [`LockService`]: super::LockService
/// [`LeaderService`]: super::LeaderService
/// [`TickService`]: super::TickService
pub trait LockedService<R>:
    Service<Locked<R>, Future: Send, Response: Send, Error: Send> + Clone + Send + 'static
{
}

impl<S, R> LockedService<R> for S where
    S: Service<Locked<R>, Future: Send, Response: Send, Error: Send> + Clone + Send + 'static
{
}

/// A request with the lease it runs under, made by the layers; more fields may come, so
/// it is built only by them, and a pattern on it needs `..`.
#[derive(Debug)]
#[non_exhaustive]
pub struct Locked<R> {
    /// The job's request.
    pub request: R,
    /// The key the lease holds, which its token fences: the job's lock key; under
    /// [`LockLayer::permits`] the permit's slot of the job's semaphore (tokens rise per
    /// slot; those of different slots are not ordered); under
    /// [`LockLayer::claimed`]`(.., `[`Until::Executed`]`)` the job's run key,
    /// `running:<job key>`, whose token is new for each run.
    ///
    /// [`LockLayer::permits`]: super::LockLayer::permits
    /// [`LockLayer::claimed`]: super::LockLayer::claimed
    /// [`Until::Executed`]: super::Until::Executed
    pub key: LockKey,
    /// The lease's fencing token: attach it to every write the job makes, fenced on
    /// [`Locked::key`].
    pub token: FencingToken,
    /// The lease's status, to check [`LeaseStatus::is_held`] inside the job. (Until
    /// executed, that of the run key; the layer stops the job when either of its leases
    /// ends.)
    pub status: LeaseStatus,
    /// [`Locked::key`] and [`Locked::token`] together, taken from the lease itself;
    /// `None` for a tick of the leader layers.
    fence: Option<WriteFence>,
}

impl<R> Locked<R> {
    /// What to fence the job's writes with: [`Locked::key`] and [`Locked::token`]
    /// together, made from the lease the job runs under (never from the two fields, which
    /// the job may change), to hand to
    /// [`FencedResourceExt::write_under`](distlock_core::FencedResourceExt::write_under).
    /// A run that lost its lease to a later one is refused there, and until executed
    /// every run is fenced on its run key, `running:<job key>`, whatever became of its
    /// claim.
    ///
    /// `Some` for every job of a [`LockLayer`](super::LockLayer); `None` for a tick of a
    /// [`LeaderLayer`](super::LeaderLayer) or [`TickLayer`](super::TickLayer), which
    /// fences with the election's key and [`Locked::token`].
    pub fn fence(&self) -> Option<WriteFence> {
        self.fence.clone()
    }

    /// Builds what a lock layer's job runs with: the key, token, status and fence of
    /// `guard`, the lease that fences it.
    pub(super) fn job(request: R, guard: &LockGuard) -> Self {
        Self {
            request,
            key: guard.key().clone(),
            token: guard.token(),
            status: guard.status(),
            fence: Some(WriteFence::of(guard)),
        }
    }

    /// Builds what a leader layer's tick runs with: no [`Locked::fence`].
    pub(super) fn tick(request: R, key: LockKey, token: FencingToken, status: LeaseStatus) -> Self {
        Self {
            request,
            key,
            token,
            status,
            fence: None,
        }
    }
}
