//! TTLs and waits fitted to a backend's capabilities ([`Timing`], [`fit_ttl`]).

use std::time::Duration;

use distlock_core::Capabilities;
use tokio::time::Instant;

/// TTLs and waits fitted to a backend's capabilities, so the same case runs on a store
/// with millisecond TTLs and on one with whole-second TTLs.
#[derive(Clone, Debug)]
pub struct Timing {
    /// The TTL the cases use: 500 ms, or the store's minimum rounded up to its granularity.
    pub ttl: Duration,
    /// How long after a TTL runs out the store may take to notice (expiry lag).
    pub expiry_slack: Duration,
    /// A TTL for a holder that must not lose its lease while a case waits or works on a
    /// loaded machine (20 TTLs, at least 10 s, fitted to the store): only a release, a
    /// fault or a cut frees its key.
    pub long_ttl: Duration,
    /// The TTL of a lease the case has the watchdog keep through all its checks (4 TTLs,
    /// at least 2 s, fitted to the store). The watchdog renews at a third of the TTL, so
    /// a renewal has two thirds of it to come back: with the 500 ms TTL that is 333 ms,
    /// and at load 12 on two cores one PostgreSQL renewal took 438 ms, so a case checking
    /// that the lease is kept failed for the load alone; 2 s leaves 1.3 s. Cases about
    /// loss and expiry keep [`Timing::ttl`].
    pub renewed_ttl: Duration,
}

impl Timing {
    /// The timing for a backend with `caps`.
    pub fn for_capabilities(caps: &Capabilities) -> Self {
        let ttl = fit_ttl(caps, Duration::from_millis(500));
        Self {
            ttl,
            // Stores expire leases on their own schedule (etcd checks every 500 ms):
            // half a TTL, at least 200 ms, past the deadline is still "on time".
            expiry_slack: (ttl / 2).max(Duration::from_millis(200)),
            long_ttl: fit_ttl(caps, (ttl * 20).max(Duration::from_secs(10))),
            renewed_ttl: fit_ttl(caps, (ttl * 4).max(Duration::from_secs(2))),
        }
    }

    /// The instant by which the store must have expired a lease whose last grant or
    /// renewal completed at `completed`.
    pub fn expired_by(&self, completed: Instant) -> Instant {
        completed + self.ttl + self.ttl / 50 + self.expiry_slack
    }
}

/// `want`, raised to the store's minimum, rounded up to its granularity, capped at its
/// maximum.
pub fn fit_ttl(caps: &Capabilities, want: Duration) -> Duration {
    let ttl = want.max(caps.min_ttl);
    let grain = caps.ttl_granularity.as_nanos();
    let ttl = if grain > 1 {
        let n = ttl.as_nanos().div_ceil(grain) * grain;
        Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
    } else {
        ttl
    };
    ttl.min(caps.max_ttl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_fit_the_store() {
        let ms = Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        assert_eq!(
            Timing::for_capabilities(&ms).ttl,
            Duration::from_millis(500)
        );
        let secs = Capabilities::new(
            Duration::from_secs(1),
            Duration::from_secs(2),
            Duration::from_secs(60),
        );
        assert_eq!(Timing::for_capabilities(&secs).ttl, Duration::from_secs(2));
        let coarse = Capabilities::new(
            Duration::from_millis(100),
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        assert_eq!(
            fit_ttl(&coarse, Duration::from_millis(201)),
            Duration::from_millis(300)
        );
    }
}
