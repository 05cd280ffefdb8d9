//! Metric names and the few places that record them.
//!
//! Metrics go through the `metrics` facade, so any exporter (Prometheus, StatsD, ...)
//! installed by the application receives them; with none installed they cost nothing.

use tracing::warn;

use crate::key::FencingToken;

/// Counter of acquire calls, labelled `backend` and `outcome` (`acquired`, `contended`, `error`).
///
/// Every attempt counts, so `outcome="contended"` is the count of contended attempts: each
/// `try_lock` that found the key held, and each attempt of a waiting `Locker::lock` that
/// did (a batch counts each of its keys).
pub const ACQUIRE_TOTAL: &str = "distlock_acquire_total";
/// Histogram of acquire latency in seconds (one call to the store), labelled `backend`.
pub const ACQUIRE_SECONDS: &str = "distlock_acquire_seconds";
/// Histogram of the time a waiting acquire (`Locker::lock`, and so `Locker::with_lock`;
/// `Semaphore::acquire`) waited in seconds, from its call to its answer, labelled
/// `backend`, [`kind`](Kind) and `outcome`:
/// `acquired`, `timed_out` (the wait timeout passed), `error` (a store error it could not
/// retry). A cancelled wait records nothing.
pub const WAIT_SECONDS: &str = "distlock_wait_seconds";
/// Histogram of the time a lease was held in seconds, from its grant to its guard's
/// release (or drop) or the loss of the lease, labelled `backend` and [`kind`](Kind). It
/// never counts past
/// the lease's local validity deadline: a lease found lost after its deadline (after a
/// pause, say) counts up to the deadline, not to when the loss was noticed.
pub const HELD_SECONDS: &str = "distlock_held_seconds";
/// Counter of lease renewals, labelled `backend` and `outcome` (`renewed`, `lost`, `error`).
pub const RENEW_TOTAL: &str = "distlock_renew_total";
/// Counter of guards that lost their lease, labelled `backend` and [`kind`](Kind).
pub const LOST_TOTAL: &str = "distlock_lost_total";
/// Counter of stale writes seen by a fenced resource, labelled `mode` (`shadow`, `enforce`).
pub const FENCE_REJECTED_TOTAL: &str = "distlock_fence_rejected_total";
/// Gauge of leases currently held by guards, labelled `backend` and [`kind`](Kind).
pub const HELD: &str = "distlock_held";

/// What a lease held by a guard is for: the `kind` label of [`WAIT_SECONDS`],
/// [`HELD_SECONDS`], [`HELD`] and [`LOST_TOTAL`], so that permits and leaderships, whose
/// leases are long or many, do not blur the locks' figures. The store-call metrics
/// ([`ACQUIRE_TOTAL`], [`ACQUIRE_SECONDS`], [`RENEW_TOTAL`]) are recorded below the
/// locker and count every kind alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// A lock of [`Locker::lock`](crate::Locker::lock) and its kin: `kind="lock"`.
    Lock,
    /// A permit of a [`Semaphore`](crate::Semaphore): `kind="permit"`.
    Permit,
    /// The leadership of an [`Election`](crate::Election): `kind="leader"`.
    Leader,
}

impl Kind {
    /// The label's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Lock => "lock",
            Kind::Permit => "permit",
            Kind::Leader => "leader",
        }
    }
}

/// Records a stale write seen by a fenced resource in enforcement `mode` (its label,
/// `EnforcementMode::as_str`): a warning and a counter.
pub(crate) fn stale_write(
    mode: &'static str,
    resource: &str,
    token: FencingToken,
    latest: FencingToken,
) {
    warn!(
        %resource, %token, %latest, mode,
        "stale fencing token: a newer lock holder has written"
    );
    metrics::counter!(FENCE_REJECTED_TOTAL, "mode" => mode).increment(1);
}
