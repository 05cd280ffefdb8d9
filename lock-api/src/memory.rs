//! The in-memory reference backend, and the fault layer for testing the code above a
//! backend.
//!
//! [`MemoryBackend`] keeps its state in one process, on tokio's clock (so tests can
//! pause time). It is the reference every other backend is compared against: it meets
//! the whole [`LockBackend`] contract. [`Faults`], a layer around it (or around any
//! backend), makes calls fail, slow down, hang, lose their replies, or fail until
//! "healed", to test how `Locker`, the watchdog and user code react.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::backend::LockBackend;
use crate::backend::lease::{
    BackendId, Capabilities, Fence, Lease, LockInfo, Release, Renewal, valid_until,
};
use crate::backend::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};

pub use crate::layer::faults::Faults;
#[doc(hidden)]
pub use key_state::{Holder, KeyState};

mod key_state;

const NAME: &str = "memory";

/// The in-memory reference backend.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use distlock::{LockBackend, LockKey, memory::MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let key = LockKey::new("job:1").unwrap();
/// let lease = backend.acquire(&key, Duration::from_secs(5)).await.unwrap().unwrap();
/// assert!(backend.acquire(&key, Duration::from_secs(5)).await.unwrap().is_none());
/// backend.release(&lease).await.unwrap();
/// # }
/// ```
#[derive(Debug)]
pub struct MemoryBackend {
    id: BackendId,
    keys: Arc<Mutex<HashMap<LockKey, KeyState>>>,
    /// Wakes waiters of every client of the store when a key is released (not when a
    /// TTL runs out: like Redis, the store does not announce expiries).
    releases: ReleaseHub,
    capabilities: Capabilities,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// A backend with TTLs from 3 ms (the shortest a lease is trusted for at all) to 1
    /// day, in whole milliseconds.
    pub fn new() -> Self {
        Self::with_capabilities(
            Capabilities::new(
                Duration::from_millis(1),
                Duration::from_millis(3),
                Duration::from_secs(24 * 3600),
            )
            .inspect(true)
            .wakes_waiters(true),
        )
    }

    /// A backend that declares other capabilities, e.g. to test TTL bounds handling.
    pub fn with_capabilities(capabilities: Capabilities) -> Self {
        Self {
            id: BackendId::next(),
            keys: Arc::new(Mutex::new(HashMap::new())),
            releases: ReleaseHub::new(AllKeys),
            capabilities,
        }
    }

    /// Another client of the same store: it sees the same locks, but is a separate
    /// backend instance, so leases do not cross between the two (as with two
    /// connections to one Redis server).
    pub fn client(&self) -> Self {
        Self {
            id: BackendId::next(),
            keys: self.keys.clone(),
            releases: self.releases.clone(),
            capabilities: self.capabilities.clone(),
        }
    }

    fn check_lease(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_backend(self.id, NAME)
    }

    /// `key` taken for `ttl` at `now` (asked at `sent`), unless a live holder has it.
    fn take(
        &self,
        keys: &mut HashMap<LockKey, KeyState>,
        key: &LockKey,
        ttl: Duration,
        sent: Instant,
        now: Instant,
    ) -> Option<Lease> {
        let state = keys.entry(key.clone()).or_default();
        if state.live_holder(now).is_some() {
            return None;
        }
        state.last_token += 1;
        let holder = Holder {
            owner: OwnerId::random(),
            token: FencingToken(state.last_token),
            expires_at: now + ttl,
        };
        state.holder = Some(holder);
        Some(Lease::new(
            self.id,
            key.clone(),
            holder.owner,
            holder.token,
            ttl,
            valid_until(sent, ttl),
        ))
    }
}

#[async_trait]
impl LockBackend for MemoryBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities.clone()
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities.check_ttl(ttl)?;
        let sent = Instant::now();
        let now = Instant::now();
        let mut keys = self.keys.lock();
        Ok(self.take(&mut keys, key, ttl, sent, now))
    }

    /// The first free key of `keys`, in order, taken under one lock of the store: no key
    /// is cloned or entered before a free one is found.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.capabilities.check_ttl(ttl)?;
        let sent = Instant::now();
        let now = Instant::now();
        let mut table = self.keys.lock();
        let free = keys.iter().find(|key| {
            table
                .get(*key)
                .is_none_or(|state| state.live_holder(now).is_none())
        });
        Ok(free.and_then(|key| self.take(&mut table, key, ttl, sent, now)))
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.check_lease(lease)?;
        let sent = Instant::now();
        let renewal = {
            let now = Instant::now();
            let mut keys = self.keys.lock();
            match keys.get_mut(lease.key()) {
                Some(state) if state.is_held_by(lease, now) => {
                    if let Some(h) = state.holder.as_mut() {
                        h.expires_at = now + lease.ttl();
                    }
                    Renewal::Renewed {
                        valid_until: valid_until(sent, lease.ttl()),
                    }
                }
                _ => Renewal::Lost,
            }
        };
        Ok(renewal)
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.check_lease(lease)?;
        let release = {
            let now = Instant::now();
            let mut keys = self.keys.lock();
            match keys.get_mut(lease.key()) {
                Some(state) if state.is_held_by(lease, now) => {
                    state.holder = None;
                    Release::Released
                }
                _ => Release::NotHeld,
            }
        };
        if release == Release::Released {
            self.releases.notify(lease.key());
        }
        Ok(release)
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.check_lease(lease)?;
        let fence = {
            let now = Instant::now();
            let keys = self.keys.lock();
            match keys.get(lease.key()) {
                Some(state) if state.is_held_by(lease, now) => Fence::Current,
                Some(state) => Fence::Stale {
                    current: FencingToken(state.last_token),
                },
                None => Fence::Stale {
                    current: lease.token(),
                },
            }
        };
        Ok(fence)
    }

    /// Adopted leases are checked by owner and token in the table, as any other.
    fn adopts_as(&self) -> Option<BackendId> {
        Some(self.id)
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.capabilities
            .wakes_waiters
            .then(|| self.releases.watch(key))
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        if self.capabilities.wakes_waiters {
            self.releases.watch_permits(slots)
        } else {
            None
        }
    }

    /// The keys waiters watch on every client of this store (they share one hub).
    fn watched_keys(&self) -> Vec<LockKey> {
        self.releases.watched_keys()
    }

    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.keys.lock().remove(key);
        Ok(())
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let now = Instant::now();
        let keys = self.keys.lock();
        let state = keys.get(key);
        let holder = state.and_then(|s| s.live_holder(now));
        Ok(LockInfo {
            owner: holder.map(|h| h.owner),
            token: state
                .filter(|s| s.last_token > 0)
                .map(|s| FencingToken(s.last_token)),
            remaining: holder.map(|h| h.expires_at - now),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> LockKey {
        LockKey::new(s).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn an_adopted_lease_releases_only_with_the_right_owner_and_token() {
        let b = MemoryBackend::new();
        let k = key("k");
        let ttl = Duration::from_secs(10);
        let lease = b.acquire(&k, ttl).await.unwrap().unwrap();
        let wrong_owner = b.adopt(&k, OwnerId::random(), lease.token(), ttl).unwrap();
        assert_eq!(b.release(&wrong_owner).await.unwrap(), Release::NotHeld);
        let wrong_token = b.adopt(&k, lease.owner(), FencingToken(99), ttl).unwrap();
        assert_eq!(b.release(&wrong_token).await.unwrap(), Release::NotHeld);
        let adopted = b.adopt(&k, lease.owner(), lease.token(), ttl).unwrap();
        assert_eq!(b.release(&adopted).await.unwrap(), Release::Released);
    }

    #[tokio::test(start_paused = true)]
    async fn clients_share_the_store_but_not_their_leases() {
        let a = MemoryBackend::new();
        let b = a.client();
        let ttl = Duration::from_secs(1);
        let lease = a.acquire(&key("k"), ttl).await.unwrap().unwrap();
        assert!(b.acquire(&key("k"), ttl).await.unwrap().is_none());
        assert!(matches!(
            b.release(&lease).await,
            Err(LockError::ForeignLease { .. })
        ));
        assert_eq!(a.release(&lease).await.unwrap(), Release::Released);
        let next = b.acquire(&key("k"), ttl).await.unwrap().unwrap();
        assert!(next.token() > lease.token());
    }

    #[tokio::test(start_paused = true)]
    async fn inspect_reports_holder_token_and_remaining_ttl() {
        let b = MemoryBackend::new();
        let k = key("k");
        assert_eq!(
            b.inspect(&k).await.unwrap(),
            LockInfo {
                owner: None,
                token: None,
                remaining: None
            }
        );
        let lease = b
            .acquire(&k, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        let info = b.inspect(&k).await.unwrap();
        assert_eq!(info.owner, Some(lease.owner()));
        assert_eq!(info.token, Some(lease.token()));
        assert_eq!(info.remaining, Some(Duration::from_secs(6)));
    }
}
