//! [`RecordingBackend`]: a client whose calls are recorded, one [`Event`](super::Event)
//! per call and one per input of a batch call, into a [`History`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    BackendLayer, Fence, Layered, Lease, LockBackend, LockError, LockKey, Release, Renewal,
};
use tokio::time::Instant;

use super::event::{History, Op, Reply};

/// A backend wrapper that records every call into a [`History`]; behaves exactly like
/// the backend it wraps (batch calls stay batch calls).
///
/// `RecordingBackend::new(inner, history)` records the calls made to `inner` into
/// `history`; `layer()` is that history.
pub type RecordingBackend = Layered<Arc<History>>;

/// The history is the layer that records calls into itself: one event per call, one per
/// input of a batch call. `inspect`, `adopt`, `purge` and release watches pass through
/// unrecorded.
///
/// # Cancel safety
/// As cancel safe as the wrapped backend; a cancelled call records nothing.
#[async_trait]
impl BackendLayer for History {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let invoked = Instant::now();
        let result = next.acquire(key, ttl).await;
        self.record_acquire(key, ttl, invoked, result.as_ref());
        result
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        let invoked = Instant::now();
        let result = next.renew(lease).await;
        self.record_renewal(lease, invoked, result.as_ref());
        result
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        let invoked = Instant::now();
        let result = next.release(lease).await;
        self.record_release(lease, invoked, result.as_ref());
        result
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        let invoked = Instant::now();
        let result = next.fence(lease).await;
        let reply = match &result {
            Ok(Fence::Current) => Reply::Current,
            Ok(Fence::Stale { current }) => Reply::Stale { current: *current },
            Err(e) => Reply::Error(e.to_string()),
        };
        self.record_lease(Op::Fence, lease, invoked, None, reply);
        result
    }

    /// A grant is recorded on the key it took; "every key held" as a refused acquire
    /// of each key asked for.
    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let invoked = Instant::now();
        let result = next.acquire_any(keys, ttl).await;
        match &result {
            Ok(Some(lease)) => {
                self.record_acquire(lease.key(), ttl, invoked, Ok(&Some(lease.clone())));
            }
            Ok(None) => keys
                .iter()
                .for_each(|key| self.record_acquire(key, ttl, invoked, Ok(&None))),
            Err(e) => keys
                .iter()
                .for_each(|key| self.record_acquire(key, ttl, invoked, Err(e))),
        }
        result
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let invoked = Instant::now();
        let result = next.acquire_many(keys, ttl).await;
        each_outcome(keys, &result, |key, outcome| {
            self.record_acquire(key, ttl, invoked, outcome);
        });
        result
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let invoked = Instant::now();
        let result = next.renew_many(leases).await;
        each_outcome(leases, &result, |lease, outcome| {
            self.record_renewal(lease, invoked, outcome);
        });
        result
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        let invoked = Instant::now();
        let result = next.release_many(leases).await;
        each_outcome(leases, &result, |lease, outcome| {
            self.record_release(lease, invoked, outcome);
        });
        result
    }
}

/// What [`RecordingBackend`] records for each kind of call.
impl History {
    fn record_lease(
        &self,
        op: Op,
        lease: &Lease,
        invoked: Instant,
        valid_until: Option<Instant>,
        reply: Reply,
    ) {
        self.record(
            op,
            lease.key(),
            Some(lease.owner()),
            Some(lease.token()),
            Some(lease.ttl()),
            invoked,
            valid_until,
            reply,
        );
    }

    fn record_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        invoked: Instant,
        result: Result<&Option<Lease>, &LockError>,
    ) {
        let (owner, token, valid, reply) = match result {
            Ok(Some(l)) => (
                Some(l.owner()),
                Some(l.token()),
                Some(l.valid_until()),
                Reply::Granted,
            ),
            Ok(None) => (None, None, None, Reply::Busy),
            Err(e) => (None, None, None, Reply::Error(e.to_string())),
        };
        self.record(
            Op::Acquire,
            key,
            owner,
            token,
            Some(ttl),
            invoked,
            valid,
            reply,
        );
    }

    fn record_renewal(
        &self,
        lease: &Lease,
        invoked: Instant,
        result: Result<&Renewal, &LockError>,
    ) {
        let (valid, reply) = match result {
            Ok(Renewal::Renewed { valid_until }) => (Some(*valid_until), Reply::Renewed),
            Ok(Renewal::Lost) => (None, Reply::Lost),
            Ok(Renewal::Unreachable) => (None, Reply::Error("unreachable".into())),
            Err(e) => (None, Reply::Error(e.to_string())),
        };
        self.record_lease(Op::Renew, lease, invoked, valid, reply);
    }

    fn record_release(
        &self,
        lease: &Lease,
        invoked: Instant,
        result: Result<&Release, &LockError>,
    ) {
        let reply = match result {
            Ok(Release::Released) => Reply::Released,
            Ok(Release::NotHeld) => Reply::NotHeld,
            Ok(Release::Unreachable) => Reply::Error("unreachable".into()),
            Err(e) => Reply::Error(e.to_string()),
        };
        self.record_lease(Op::Release, lease, invoked, None, reply);
    }
}

/// Calls `record` once per input of a batch call with that input's own outcome: its
/// item of the reply, or the error that failed the whole batch.
fn each_outcome<I, T>(
    inputs: &[I],
    result: &Result<Vec<T>, LockError>,
    mut record: impl FnMut(&I, Result<&T, &LockError>),
) {
    match result {
        Ok(items) => inputs.iter().zip(items).for_each(|(i, t)| record(i, Ok(t))),
        Err(e) => inputs.iter().for_each(|i| record(i, Err(e))),
    }
}
