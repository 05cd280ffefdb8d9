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

/// A counter guarded by a fenced resource: the downstream store of the read-modify-write
/// workload. A write is admitted (and applied) atomically with the fencing check, and
/// recorded in the history in admission order.
///
/// The resource is in memory ([`FencedCounter::new`]) or a backend's own
/// ([`FencedCounter::on`]: a Redis script, a PostgreSQL guarded row, an etcd transaction);
/// either way the store decides the admission, and the counter's lock, held across it,
/// makes the check and the write one step for this workload.
pub struct FencedCounter {
    resource: Gate,
    value: tokio::sync::Mutex<u64>,
    history: Arc<History>,
}

/// Where a [`FencedCounter`]'s admissions are decided.
enum Gate {
    Memory(MemoryFencedResource),
    Store(Arc<dyn FencedResource>),
}

impl fmt::Debug for FencedCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gate = match self.resource {
            Gate::Memory(_) => "memory",
            Gate::Store(_) => "store",
        };
        f.debug_struct("FencedCounter")
            .field("resource", &gate)
            .finish_non_exhaustive()
    }
}

impl FencedCounter {
    /// A counter at zero on an in-memory resource in enforce mode, recording into
    /// `history`.
    pub fn new(history: Arc<History>) -> Self {
        Self::with_gate(
            Gate::Memory(MemoryFencedResource::new(EnforcementMode::Enforce)),
            history,
        )
    }

    /// A counter at zero whose writes `resource` admits (it must be in enforce mode),
    /// recording into `history`.
    pub fn on(resource: Arc<dyn FencedResource>, history: Arc<History>) -> Self {
        Self::with_gate(Gate::Store(resource), history)
    }

    fn with_gate(resource: Gate, history: Arc<History>) -> Self {
        Self {
            resource,
            value: tokio::sync::Mutex::new(0),
            history,
        }
    }

    /// The current value.
    pub async fn read(&self) -> u64 {
        *self.value.lock().await
    }

    /// Writes `value` (computed from `read`) with `token`, if the resource admits the
    /// token. Returns the admission, or the store's error (recorded, nothing written).
    pub async fn write(
        &self,
        key: &LockKey,
        token: FencingToken,
        read: u64,
        value: u64,
    ) -> Result<Admission, LockError> {
        let invoked = Instant::now();
        let mut current = self.value.lock().await;
        let admission = match &self.resource {
            Gate::Memory(resource) => Ok(resource.admit_now(key.as_str(), token)),
            Gate::Store(resource) => resource.admit(key.as_str(), token).await,
        };
        let reply = match &admission {
            Ok(Admission::Stale { latest } | Admission::ShadowStale { latest }) => {
                Reply::Rejected { latest: *latest }
            }
            Ok(Admission::Admitted) => {
                *current = value;
                Reply::Admitted { read, wrote: value }
            }
            Err(e) => Reply::Error(e.to_string()),
        };
        // Recorded under the value lock, so the history's order is the admission order.
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
        assert_eq!(counter.read().await, 1);
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
