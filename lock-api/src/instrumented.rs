//! [`Instrumented`]: a backend wrapper that puts a `tracing` span on every call and
//! records the acquire and renew metrics. [`crate::Locker`] wraps every backend in it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tracing::Instrument;

use crate::backend::LockBackend;
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};
use crate::lease::{Capabilities, Fence, Lease, LockInfo, Release, Renewal};
use crate::telemetry::{ACQUIRE_SECONDS, ACQUIRE_TOTAL, RENEW_TOTAL};

/// Wraps a backend with tracing spans and metrics; behaves exactly like the inner backend.
#[derive(Debug, Clone)]
pub struct Instrumented {
    inner: Arc<dyn LockBackend>,
}

impl Instrumented {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn LockBackend>) -> Self {
        Self { inner }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn LockBackend> {
        &self.inner
    }

    fn record_acquire(&self, outcome: &'static str, count: usize, took: Duration) {
        if count == 0 {
            return;
        }
        let backend = self.inner.name();
        metrics::counter!(ACQUIRE_TOTAL, "backend" => backend, "outcome" => outcome)
            .increment(count as u64);
        metrics::histogram!(ACQUIRE_SECONDS, "backend" => backend).record(took.as_secs_f64());
    }

    /// `renewals` is `None` when the whole call failed.
    fn record_renewals(&self, renewals: Option<&[Renewal]>, count: usize) {
        let backend = self.inner.name();
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
}

fn acquire_outcome(lease: &Option<Lease>) -> &'static str {
    if lease.is_some() {
        "acquired"
    } else {
        "contended"
    }
}

#[async_trait]
impl LockBackend for Instrumented {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        let span = tracing::debug_span!("distlock.acquire", backend = self.inner.name(), %key, ttl_ms = ttl.as_millis() as u64);
        let start = std::time::Instant::now();
        let result = self.inner.acquire(key, ttl).instrument(span).await;
        let outcome = result.as_ref().map_or("error", acquire_outcome);
        self.record_acquire(outcome, 1, start.elapsed());
        result
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        let span = tracing::debug_span!("distlock.renew", backend = self.inner.name(), key = %lease.key(), token = %lease.token());
        let result = self.inner.renew(lease).instrument(span).await;
        self.record_renewals(result.as_ref().ok().map(std::slice::from_ref), 1);
        result
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        let span = tracing::debug_span!("distlock.release", backend = self.inner.name(), key = %lease.key(), token = %lease.token());
        self.inner.release(lease).instrument(span).await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        let span = tracing::debug_span!("distlock.fence", backend = self.inner.name(), key = %lease.key(), token = %lease.token());
        self.inner.fence(lease).instrument(span).await
    }

    fn watch_releases(&self, key: &LockKey) -> Option<crate::wake::ReleaseWatch> {
        self.inner.watch_releases(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.watched_keys()
    }

    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        self.inner.adopt(key, owner, token, ttl)
    }

    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let span = tracing::debug_span!("distlock.purge", backend = self.inner.name(), %key);
        self.inner.purge(key).instrument(span).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let span = tracing::debug_span!("distlock.inspect", backend = self.inner.name(), %key);
        self.inner.inspect(key).instrument(span).await
    }

    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let span = tracing::debug_span!(
            "distlock.acquire_many",
            backend = self.inner.name(),
            count = keys.len(),
            ttl_ms = ttl.as_millis() as u64
        );
        let start = std::time::Instant::now();
        let result = self.inner.acquire_many(keys, ttl).instrument(span).await;
        let took = start.elapsed();
        match &result {
            Ok(leases) => {
                let acquired = leases.iter().filter(|l| l.is_some()).count();
                self.record_acquire("acquired", acquired, took);
                self.record_acquire("contended", leases.len() - acquired, took);
            }
            Err(_) => self.record_acquire("error", keys.len(), took),
        }
        result
    }

    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        let span = tracing::debug_span!(
            "distlock.renew_many",
            backend = self.inner.name(),
            count = leases.len()
        );
        let result = self.inner.renew_many(leases).instrument(span).await;
        self.record_renewals(result.as_ref().ok().map(Vec::as_slice), leases.len());
        result
    }

    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        let span = tracing::debug_span!(
            "distlock.release_many",
            backend = self.inner.name(),
            count = leases.len()
        );
        self.inner.release_many(leases).instrument(span).await
    }
}
