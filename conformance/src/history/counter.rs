//! [`FencedCounter`]: the downstream store of the read-modify-write workload, whose
//! writes are admitted by a fenced resource and recorded in the history.

use std::fmt;
use std::sync::Arc;

use distlock_core::{
    Admission, EnforcementMode, FencedResource, FencingToken, LockError, LockKey,
    MemoryFencedResource,
};
use tokio::time::Instant;

use super::event::{History, Op, Reply};

/// A counter kept by a fenced resource: the downstream store of the read-modify-write
/// workload. Its value is the resource's, written with [`FencedResource::write`], the
/// store's atomic check-and-write, and every write is recorded in the history.
///
/// The resource is in memory ([`FencedCounter::new`]) or a backend's own
/// ([`FencedCounter::on`]: a Redis script, a PostgreSQL transaction, an etcd transaction);
/// either way the store decides the admission and keeps the value, so a store that applies
/// a refused write, or loses an admitted one, shows as a lost update (I2). The counter
/// holds a lock of its own across each write only to record writes in the order the store
/// admitted them.
pub struct FencedCounter {
    resource: Arc<dyn FencedResource>,
    order: tokio::sync::Mutex<()>,
    history: Arc<History>,
}

impl fmt::Debug for FencedCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedCounter").finish_non_exhaustive()
    }
}

impl FencedCounter {
    /// A counter at zero on an in-memory resource in enforce mode, recording into
    /// `history`.
    pub fn new(history: Arc<History>) -> Self {
        Self::on(
            Arc::new(MemoryFencedResource::new(EnforcementMode::Enforce)),
            history,
        )
    }

    /// A counter at zero kept by `resource` (it must be in enforce mode), recording into
    /// `history`.
    pub fn on(resource: Arc<dyn FencedResource>, history: Arc<History>) -> Self {
        Self {
            resource,
            order: tokio::sync::Mutex::new(()),
            history,
        }
    }

    /// The counter's value for the resource named after `key` (zero before any write).
    pub async fn read(&self, key: &LockKey) -> Result<u64, LockError> {
        let Some(bytes) = self.resource.read(key.as_str()).await? else {
            return Ok(0);
        };
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| {
                LockError::backend(
                    "fenced counter",
                    format!("the resource holds {bytes:?}, not a counter value"),
                )
            })
    }

    /// Writes `value` (computed from `read`) with `token`, if the resource admits the
    /// token. Returns the admission, or the store's error (recorded; the write may or may
    /// not have been applied).
    pub async fn write(
        &self,
        key: &LockKey,
        token: FencingToken,
        read: u64,
        value: u64,
    ) -> Result<Admission, LockError> {
        let invoked = Instant::now();
        let _order = self.order.lock().await;
        let admission = self
            .resource
            .write(key.as_str(), token, value.to_string().as_bytes())
            .await;
        let reply = match &admission {
            Ok(Admission::Stale { latest } | Admission::ShadowStale { latest }) => {
                Reply::Rejected { latest: *latest }
            }
            Ok(Admission::Admitted) => Reply::Admitted { read, wrote: value },
            Err(e) => Reply::Error(e.to_string()),
        };
        // Recorded under the order lock, so the history's order is the admission order.
        self.history.record(
            Op::Write,
            key,
            None,
            Some(token),
            None,
            invoked,
            None,
            reply,
        );
        admission
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::CheckOptions;

    #[tokio::test]
    async fn the_recorder_numbers_events_and_the_counter_orders_writes() {
        let history = Arc::new(History::new());
        let counter = FencedCounter::new(history.clone());
        let key = LockKey::new("k").unwrap();
        let write = |token, read, value| counter.write(&key, FencingToken(token), read, value);
        assert!(write(2, 0, 1).await.unwrap().is_admitted());
        assert!(!write(1, 1, 2).await.unwrap().is_admitted());
        assert_eq!(counter.read(&key).await.unwrap(), 1);
        let events = history.events();
        assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(
            events[1].reply,
            Reply::Rejected {
                latest: FencingToken(2)
            }
        );
        assert_eq!(history.check(&CheckOptions::default()), vec![]);
    }
}
