//! What a backend grants ([`Lease`]), what it can do ([`Capabilities`]), and the
//! outcomes of renew, release and fence.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};

/// The share of a TTL a client assumes the clocks may drift by (1%).
pub const DRIFT_FACTOR: f64 = 0.01;
/// A fixed margin subtracted from every validity window, for timer and scheduling slack.
pub const VALIDITY_MARGIN: Duration = Duration::from_millis(2);

/// The local monotonic deadline until which a lease granted for `ttl` may be trusted,
/// counted from the instant the request was `sent` (not from when the reply arrived):
/// `sent + ttl * (1 - DRIFT_FACTOR) - VALIDITY_MARGIN`.
pub fn valid_until(sent: Instant, ttl: Duration) -> Instant {
    sent + trusted_for(ttl)
}

/// How long after its send instant a lease granted for `ttl` may be trusted; zero for a
/// TTL too short to be trusted at all, which [`Capabilities::check_ttl`] refuses.
pub fn trusted_for(ttl: Duration) -> Duration {
    ttl.mul_f64(1.0 - DRIFT_FACTOR)
        .saturating_sub(VALIDITY_MARGIN)
}

/// Identifies one backend instance, so a lease cannot be used with another instance.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BackendId(u64);

impl BackendId {
    /// A process-unique id for a new backend instance.
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A granted lock: key, owner, fencing token, TTL and the local validity deadline.
///
/// Cheap to clone. Backends may attach a private handle (an etcd lease id, a pinned
/// PostgreSQL session) with [`Lease::with_handle`].
#[derive(Clone)]
pub struct Lease {
    key: LockKey,
    owner: OwnerId,
    token: FencingToken,
    ttl: Duration,
    valid_until: Instant,
    backend: BackendId,
    handle: Option<Arc<dyn Any + Send + Sync>>,
}

impl Lease {
    /// A lease granted by the backend instance `backend`.
    pub fn new(
        backend: BackendId,
        key: LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
        valid_until: Instant,
    ) -> Self {
        Self {
            key,
            owner,
            token,
            ttl,
            valid_until,
            backend,
            handle: None,
        }
    }

    /// A lease rebuilt from its owner id and token by [`crate::LockBackend::adopt`]: this
    /// process never saw the grant, so its local validity ends at once (`valid_until` is
    /// now) and only the store's owner and token checks decide what it may do.
    pub fn adopted(
        backend: BackendId,
        key: LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Self {
        Self::new(backend, key, owner, token, ttl, Instant::now())
    }

    /// The same lease, trusted only until `valid_until` (a layer that knows the request
    /// left earlier than the backend saw it).
    pub(crate) fn with_valid_until(mut self, valid_until: Instant) -> Self {
        self.valid_until = valid_until;
        self
    }

    /// Attaches a backend-private handle.
    #[must_use]
    pub fn with_handle(mut self, handle: Arc<dyn Any + Send + Sync>) -> Self {
        self.handle = Some(handle);
        self
    }

    /// The backend-private handle, if it is of type `T`.
    pub fn handle<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.handle.as_deref()?.downcast_ref()
    }

    /// The lock's name.
    pub fn key(&self) -> &LockKey {
        &self.key
    }
    /// The owner id of this acquisition.
    pub fn owner(&self) -> OwnerId {
        self.owner
    }
    /// The fencing token of this acquisition.
    pub fn token(&self) -> FencingToken {
        self.token
    }
    /// The TTL the lease was granted (and is renewed) with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
    /// The local deadline given when the lease was granted; renewals move it, see [`Renewal`].
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }
    /// The backend instance that granted the lease.
    pub fn backend_id(&self) -> BackendId {
        self.backend
    }

    /// Fails with [`LockError::ForeignLease`] unless the lease came from `backend`.
    pub fn check_backend(&self, backend: BackendId, name: &'static str) -> Result<(), LockError> {
        if self.backend == backend {
            Ok(())
        } else {
            Err(LockError::ForeignLease { backend: name })
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("token", &self.token)
            .field("ttl", &self.ttl)
            .field("valid_until", &self.valid_until)
            .finish_non_exhaustive()
    }
}

/// The outcome of a renewal.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Renewal {
    /// The lease was extended by its TTL; the new local deadline is `valid_until`.
    Renewed {
        /// The new local deadline, counted from the renewal's send instant.
        valid_until: Instant,
    },
    /// The lease had expired or belongs to someone else: nothing was extended.
    Lost,
    /// Batch forms only: the part of the store that keeps this lease (a cluster node) did
    /// not answer, so nothing is known. The watchdog retries it, as after a transient error,
    /// until its `valid_until`. The single form returns an error instead.
    Unreachable,
}

/// The outcome of a release.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Release {
    /// The lease was held and is now freed.
    Released,
    /// The lease was no longer held (expired, taken over, or already released); nothing changed.
    NotHeld,
    /// Batch forms only: the part of the store that keeps this lease did not answer; it
    /// may still be held and frees itself when its TTL runs out. The single form returns
    /// an error instead.
    Unreachable,
}

/// The outcome of a fence check.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fence {
    /// The lease is still held and its token is the key's current one.
    Current,
    /// The lease is no longer held; `current` is the key's newest token.
    Stale {
        /// The newest token the store has issued for the key.
        current: FencingToken,
    },
}

/// What the store says about a key, for inspection tools.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct LockInfo {
    /// The current holder, if any.
    pub owner: Option<OwnerId>,
    /// The newest token issued for the key, if the store knows it: a held key's is its
    /// holder's; for a free key a store may keep it (a counter) or not (Redis keeps nothing
    /// after a release, its next token being its clock).
    pub token: Option<FencingToken>,
    /// How long the current holder's lease still runs, as the store sees it.
    pub remaining: Option<Duration>,
}

/// What a backend can do, so callers and the conformance suite adapt to it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// TTLs must be a whole multiple of this (1 ms for Redis, 1 s for etcd).
    pub ttl_granularity: Duration,
    /// The shortest TTL the store honours.
    pub min_ttl: Duration,
    /// The longest TTL the store honours.
    pub max_ttl: Duration,
    /// The batch forms are served by the store in one round trip, not one by one.
    pub native_batch: bool,
    /// A lease expires in the store on its own when its owner goes away.
    pub server_side_ttl: bool,
    /// Ownership ends when the owner's connection ends (a PostgreSQL session lock).
    pub session_bound: bool,
    /// The most leases one backend instance can hold at once, if bounded.
    pub max_held: Option<usize>,
    /// [`crate::LockBackend::inspect`] is implemented.
    pub inspect: bool,
    /// [`crate::LockBackend::watch_releases`] announces releases, so waiters are woken
    /// instead of polling.
    pub wakes_waiters: bool,
    /// [`crate::LockBackend::acquire_any`] over a semaphore's permit slots finds the first
    /// free one from an index the store keeps, without looking at the slots before it, in
    /// one atomic step: a [`crate::Semaphore`] then asks for its slots from slot 0 (the
    /// lowest free slot is one look), not from a random one (which spreads callers that
    /// look slot by slot).
    pub permit_index: bool,
}

impl Capabilities {
    /// Capabilities with the given TTL bounds and granularity, and no optional features.
    pub fn new(ttl_granularity: Duration, min_ttl: Duration, max_ttl: Duration) -> Self {
        Self {
            ttl_granularity,
            min_ttl,
            max_ttl,
            native_batch: false,
            server_side_ttl: true,
            session_bound: false,
            max_held: None,
            inspect: false,
            wakes_waiters: false,
            permit_index: false,
        }
    }

    /// Sets [`Capabilities::native_batch`].
    #[must_use]
    pub fn native_batch(mut self, yes: bool) -> Self {
        self.native_batch = yes;
        self
    }
    /// Sets [`Capabilities::server_side_ttl`].
    #[must_use]
    pub fn server_side_ttl(mut self, yes: bool) -> Self {
        self.server_side_ttl = yes;
        self
    }
    /// Sets [`Capabilities::session_bound`].
    #[must_use]
    pub fn session_bound(mut self, yes: bool) -> Self {
        self.session_bound = yes;
        self
    }
    /// Sets [`Capabilities::max_held`].
    #[must_use]
    pub fn max_held(mut self, limit: Option<usize>) -> Self {
        self.max_held = limit;
        self
    }
    /// Sets [`Capabilities::inspect`].
    #[must_use]
    pub fn inspect(mut self, yes: bool) -> Self {
        self.inspect = yes;
        self
    }
    /// Sets [`Capabilities::wakes_waiters`].
    #[must_use]
    pub fn wakes_waiters(mut self, yes: bool) -> Self {
        self.wakes_waiters = yes;
        self
    }
    /// Sets [`Capabilities::permit_index`].
    #[must_use]
    pub fn permit_index(mut self, yes: bool) -> Self {
        self.permit_index = yes;
        self
    }

    /// Checks that the store can honour `ttl` exactly, and that a lease of `ttl` is
    /// trusted for some time at all ([`trusted_for`] above zero); never rounds it.
    pub fn check_ttl(&self, ttl: Duration) -> Result<(), LockError> {
        if ttl.is_zero() {
            return Err(LockError::invalid_ttl(
                ttl,
                "a TTL must be greater than zero",
            ));
        }
        if trusted_for(ttl).is_zero() {
            return Err(LockError::invalid_ttl(
                ttl,
                format!(
                    "a lease of {ttl:?} would be trusted for no time at all once the clock \
                     drift allowance ({}%) and the {VALIDITY_MARGIN:?} margin are taken off",
                    DRIFT_FACTOR * 100.0
                ),
            ));
        }
        if ttl < self.min_ttl {
            return Err(LockError::invalid_ttl(
                ttl,
                format!("the store's minimum TTL is {:?}", self.min_ttl),
            ));
        }
        if ttl > self.max_ttl {
            return Err(LockError::invalid_ttl(
                ttl,
                format!("the store's maximum TTL is {:?}", self.max_ttl),
            ));
        }
        if !self.ttl_granularity.is_zero() && ttl.as_nanos() % self.ttl_granularity.as_nanos() != 0
        {
            return Err(LockError::invalid_ttl(
                ttl,
                format!(
                    "the store keeps TTLs in whole multiples of {:?} and will not round",
                    self.ttl_granularity
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> Capabilities {
        Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(10),
            Duration::from_secs(60),
        )
    }

    #[test]
    fn ttl_checks_name_the_reason() {
        let c = caps();
        assert!(c.check_ttl(Duration::from_millis(10)).is_ok());
        for bad in [
            Duration::ZERO,
            Duration::from_millis(9),
            Duration::from_secs(61),
            Duration::from_micros(10_500),
        ] {
            assert!(
                matches!(c.check_ttl(bad), Err(LockError::InvalidTtl { ttl, .. }) if ttl == bad),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn a_ttl_trusted_for_no_time_is_refused_whatever_the_store_allows() {
        let c = Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        for bad in [Duration::from_millis(1), Duration::from_millis(2)] {
            let refused = c.check_ttl(bad);
            assert!(
                matches!(&refused, Err(LockError::InvalidTtl { ttl, reason }) if *ttl == bad && reason.contains("trusted for no time")),
                "{bad:?}: {refused:?}"
            );
        }
        assert!(c.check_ttl(Duration::from_millis(3)).is_ok());
        assert!(!trusted_for(Duration::from_millis(3)).is_zero());
    }

    #[test]
    fn validity_starts_at_the_send_instant_and_keeps_a_margin() {
        let sent = Instant::now();
        let ttl = Duration::from_secs(10);
        let until = valid_until(sent, ttl);
        assert!(until < sent + ttl);
        assert_eq!(until, sent + Duration::from_millis(9_900) - VALIDITY_MARGIN);
        // A tiny TTL never yields a deadline before the send instant.
        assert_eq!(valid_until(sent, Duration::from_millis(1)), sent);
    }

    #[test]
    fn leases_refuse_other_backends() {
        let a = BackendId::next();
        let b = BackendId::next();
        let lease = Lease::new(
            a,
            LockKey::new("k").unwrap(),
            OwnerId::random(),
            FencingToken(1),
            Duration::from_secs(1),
            Instant::now(),
        );
        assert!(lease.check_backend(a, "memory").is_ok());
        assert!(matches!(
            lease.check_backend(b, "memory"),
            Err(LockError::ForeignLease { .. })
        ));
    }
}
