//! [`Instrumented`]: the layer that puts a `tracing` span on every call and records the
//! acquire and renew metrics. [`crate::Locker`] wraps every backend in it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tracing::Instrument;

use crate::backend::LockBackend;
use crate::backend::lease::{Fence, Lease, LockInfo, Release, Renewal};
use crate::error::LockError;
use crate::key::LockKey;
use crate::layer::{BackendLayer, Layered};
use crate::telemetry::{ACQUIRE_SECONDS, ACQUIRE_TOTAL, RENEW_TOTAL};

/// Tracing spans and metrics around a backend; answers exactly as the backend does.
///
/// # Cancel safety
/// As cancel safe as the wrapped backend: a cancelled call records no metric.
#[derive(Debug, Clone, Copy, Default)]
pub struct Instrumented;

impl Instrumented {
    /// Wraps `inner`: `Layered::new(inner, Instrumented)`.
    pub fn new(inner: Arc<dyn LockBackend>) -> Layered<Self> {
        Layered::new(inner, Self)
    }
}

fn record_acquire(backend: &'static str, outcome: &'static str, count: usize, took: Duration) {
    if count == 0 {
        return;
    }
    metrics::counter!(ACQUIRE_TOTAL, "backend" => backend, "outcome" => outcome)
        .increment(count as u64);
    metrics::histogram!(ACQUIRE_SECONDS, "backend" => backend).record(took.as_secs_f64());
}

/// `renewals` is `None` when the whole call failed.
fn record_renewals(backend: &'static str, renewals: Option<&[Renewal]>, count: usize) {
    let Some(renewals) = renewals else {
        metrics::counter!(RENEW_TOTAL, "backend" => backend, "outcome" => "error")
            .increment(count as u64);
        return;
    };
    let count_of = |wanted: fn(&Renewal) -> bool| renewals.iter().filter(|r| wanted(r)).count();
    let renewed = count_of(|r| matches!(r, Renewal::Renewed { .. }));
    let lost = count_of(|r| matches!(r, Renewal::Lost));
    let unreachable = count_of(|r| matches!(r, Renewal::Unreachable));
    for (outcome, n) in [("renewed", renewed), ("lost", lost), ("error", unreachable)] {
        metrics::counter!(RENEW_TOTAL, "backend" => backend, "outcome" => outcome)
            .increment(n as u64);
    }
}

fn acquire_outcome(lease: &Option<Lease>) -> &'static str {
    if lease.is_some() {
        "acquired"
    } else {
        "contended"
    }
}

#[async_trait]
impl BackendLayer for Instrumented {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let span = tracing::debug_span!("distlock.acquire", backend = next.name(), %key, ttl_ms = ttl.as_millis() as u64);
        let start = std::time::Instant::now();
        let result = next.acquire(key, ttl).instrument(span).await;
        let outcome = result.as_ref().map_or("error", acquire_outcome);
        record_acquire(next.name(), outcome, 1, start.elapsed());
        result
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        let span = tracing::debug_span!("distlock.renew", backend = next.name(), key = %lease.key(), token = %lease.token());
        let result = next.renew(lease).instrument(span).await;
        record_renewals(
            next.name(),
            result.as_ref().ok().map(std::slice::from_ref),
            1,
        );
        result
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        let span = tracing::debug_span!("distlock.release", backend = next.name(), key = %lease.key(), token = %lease.token());
        next.release(lease).instrument(span).await
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        let span = tracing::debug_span!("distlock.fence", backend = next.name(), key = %lease.key(), token = %lease.token());
        next.fence(lease).instrument(span).await
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        let span = tracing::debug_span!("distlock.purge", backend = next.name(), %key);
        next.purge(key).instrument(span).await
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        let span = tracing::debug_span!("distlock.inspect", backend = next.name(), %key);
        next.inspect(key).instrument(span).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let span = tracing::debug_span!(
            "distlock.acquire_any",
            backend = next.name(),
            count = keys.len(),
            ttl_ms = ttl.as_millis() as u64
        );
        let start = std::time::Instant::now();
        let result = next.acquire_any(keys, ttl).instrument(span).await;
        let outcome = result.as_ref().map_or("error", acquire_outcome);
        record_acquire(next.name(), outcome, 1, start.elapsed());
        result
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let span = tracing::debug_span!(
            "distlock.acquire_many",
            backend = next.name(),
            count = keys.len(),
            ttl_ms = ttl.as_millis() as u64
        );
        let start = std::time::Instant::now();
        let result = next.acquire_many(keys, ttl).instrument(span).await;
        let took = start.elapsed();
        match &result {
            Ok(leases) => {
                let acquired = leases.iter().filter(|l| l.is_some()).count();
                record_acquire(next.name(), "acquired", acquired, took);
                record_acquire(next.name(), "contended", leases.len() - acquired, took);
            }
            Err(_) => record_acquire(next.name(), "error", keys.len(), took),
        }
        result
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let span = tracing::debug_span!(
            "distlock.renew_many",
            backend = next.name(),
            count = leases.len()
        );
        let result = next.renew_many(leases).instrument(span).await;
        record_renewals(
            next.name(),
            result.as_ref().ok().map(Vec::as_slice),
            leases.len(),
        );
        result
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        let span = tracing::debug_span!(
            "distlock.release_many",
            backend = next.name(),
            count = leases.len()
        );
        next.release_many(leases).instrument(span).await
    }
}
