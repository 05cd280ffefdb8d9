//! The keys a `lockctl check` run sent to the store, so the run can purge them when it
//! ends and leave a live deployment as it found it.
//!
//! [`RecordingFactory`] wraps the factory the cases get and its clients: every key that
//! reaches the store through any backend call is noted. Only keys under the suite's
//! per-run prefixes (`conformance:<16 hex digits>:…`) are ever purged, so a key of the
//! deployment cannot be deleted even if a case touched one.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use conformance::{Factory, LinkFaults, ServerFaults};
use distlock::backend::{BackendLayer, Layered, async_trait};
use distlock::{Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal};
use parking_lot::Mutex;

/// The start of every key the conformance cases make (`suite::Ctx::key`).
const SUITE_PREFIX: &str = "conformance:";

/// The keys seen so far.
#[derive(Debug, Default)]
pub struct UsedKeys(Mutex<BTreeSet<LockKey>>);

/// What [`UsedKeys::purge`] did.
#[derive(Debug)]
pub enum Cleanup {
    /// Every recorded key under the suite's prefixes was purged.
    Purged(usize),
    /// The backend cannot purge; the keys stay.
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// How many keys stay.
        left: usize,
    },
    /// Some purges failed.
    Failed {
        /// How many keys were purged.
        purged: usize,
        /// The first error.
        error: LockError,
        /// How many keys could not be purged.
        left: usize,
    },
}

impl UsedKeys {
    fn note(&self, key: &LockKey) {
        self.0.lock().insert(key.clone());
    }

    fn note_leases(&self, leases: &[Lease]) {
        for lease in leases {
            self.note(lease.key());
        }
    }

    /// The recorded keys made by the suite, the only ones [`UsedKeys::purge`] touches.
    pub fn suite_keys(&self) -> Vec<LockKey> {
        self.0
            .lock()
            .iter()
            .filter(|key| is_suite_key(key))
            .cloned()
            .collect()
    }

    /// Purges every recorded key under the suite's prefixes through `backend`.
    pub async fn purge(&self, backend: &dyn LockBackend) -> Cleanup {
        let keys = self.suite_keys();
        let mut purged = 0;
        let mut first_error = None;
        for key in &keys {
            match backend.purge(key).await {
                Ok(()) => purged += 1,
                Err(LockError::Unsupported { backend, .. }) => {
                    return Cleanup::Unsupported {
                        backend,
                        left: keys.len() - purged,
                    };
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => Cleanup::Purged(purged),
            Some(error) => Cleanup::Failed {
                purged,
                error,
                left: keys.len() - purged,
            },
        }
    }
}

/// `conformance:<16 hex digits>:<case>:<name>`, as `suite::Ctx::key` makes them.
fn is_suite_key(key: &LockKey) -> bool {
    let Some(rest) = key.as_str().strip_prefix(SUITE_PREFIX) else {
        return false;
    };
    let Some((random, case_and_name)) = rest.split_once(':') else {
        return false;
    };
    random.len() == 16
        && random.bytes().all(|b| b.is_ascii_hexdigit())
        && case_and_name.contains(':')
}

/// A factory whose clients note every key they send to the store.
pub struct RecordingFactory<'f> {
    inner: &'f dyn Factory,
    used: Arc<UsedKeys>,
}

impl<'f> RecordingFactory<'f> {
    /// Wraps `inner`; keys go into `used`.
    pub fn new(inner: &'f dyn Factory, used: Arc<UsedKeys>) -> Self {
        Self { inner, used }
    }
}

#[async_trait]
impl Factory for RecordingFactory<'_> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(Layered::new(
            self.inner.backend().await,
            KeyRecorder {
                used: self.used.clone(),
            },
        ))
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        self.inner.link()
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        self.inner.server()
    }
}

/// Notes each key a call sends to the store, then hands the call on unchanged.
struct KeyRecorder {
    used: Arc<UsedKeys>,
}

/// Leaves out the keys, which can be many.
impl fmt::Debug for KeyRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRecorder").finish_non_exhaustive()
    }
}

#[async_trait]
impl BackendLayer for KeyRecorder {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.used.note(key);
        next.acquire(key, ttl).await
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        self.used.note(lease.key());
        next.renew(lease).await
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        self.used.note(lease.key());
        next.release(lease).await
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        self.used.note(lease.key());
        next.fence(lease).await
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        self.used.note(key);
        next.inspect(key).await
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        self.used.note(key);
        next.purge(key).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        keys.iter().for_each(|key| self.used.note(key));
        next.acquire_any(keys, ttl).await
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        for key in keys {
            self.used.note(key);
        }
        next.acquire_many(keys, ttl).await
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.used.note_leases(leases);
        next.renew_many(leases).await
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        self.used.note_leases(leases);
        next.release_many(leases).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use conformance::memory::MemoryFactory;

    const TTL: Duration = Duration::from_secs(5);

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    #[test]
    fn only_keys_made_by_the_suite_count() {
        for yes in [
            "conformance:0123456789abcdef:case:k",
            "conformance:0123456789ABCDEF:batch_x:free-0",
        ] {
            assert!(is_suite_key(&key(yes)), "{yes}");
        }
        for no in [
            "job:1",
            "conformance:",
            "conformance:0123:case:k",
            "conformance:0123456789abcdez:case:k",
            "conformance:0123456789abcdef:nocase",
            "xconformance:0123456789abcdef:case:k",
        ] {
            assert!(!is_suite_key(&key(no)), "{no}");
        }
    }

    #[tokio::test]
    async fn a_case_run_through_the_recorder_leaves_nothing_after_purge() {
        let memory = MemoryFactory::new();
        let used = Arc::new(UsedKeys::default());
        let recording = RecordingFactory::new(&memory, used.clone());
        let case = conformance::suite::case("tokens_increase_across_releases").unwrap();
        (case.run)(&recording).await.unwrap();

        let keys = used.suite_keys();
        assert!(!keys.is_empty(), "the case used keys");
        let store = memory.backend().await;
        let mut issued = 0;
        for k in &keys {
            issued += usize::from(store.inspect(k).await.unwrap().token.is_some());
        }
        assert!(issued > 0, "the case left tokens behind before the purge");

        assert!(matches!(used.purge(&*store).await, Cleanup::Purged(n) if n == keys.len()));
        for k in &keys {
            let info = store.inspect(k).await.unwrap();
            assert_eq!((info.owner, info.token), (None, None), "{k}");
        }
    }

    #[tokio::test]
    async fn keys_outside_the_suite_prefixes_are_never_purged() {
        let memory = MemoryFactory::new();
        let used = Arc::new(UsedKeys::default());
        let client = RecordingFactory::new(&memory, used.clone()).backend().await;
        let theirs = key("job:1");
        let lease = client.acquire(&theirs, TTL).await.unwrap().unwrap();
        client.release(&lease).await.unwrap();

        assert!(matches!(used.purge(&*client).await, Cleanup::Purged(0)));
        let info = client.inspect(&theirs).await.unwrap();
        assert_eq!(info.token, Some(lease.token()));
    }
}
