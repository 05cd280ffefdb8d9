//! [`BrokenBackend`]: a deliberately wrong backend that proves the suite can fail.
//!
//! It looks like a working lock (mutual exclusion and TTLs hold) but breaks two rules of
//! the [`LockBackend`] contract: `release` frees the key whoever holds it (no owner
//! check), and every grant carries token 1 (tokens do not increase), so its `fence`
//! cannot tell an old holder from a new one. The conformance suite must fail on it;
//! `tests/broken.rs` checks that it does. Never use it for anything else.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_api::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockKey, OwnerId,
    Release, Renewal, valid_until,
};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::factory::Factory;

const NAME: &str = "broken";

/// The constant token every grant carries.
const TOKEN: FencingToken = FencingToken(1);

/// A lock backend without owner checks on release and with a constant fencing token.
#[derive(Debug)]
pub struct BrokenBackend {
    id: BackendId,
    /// Key -> (owner, expiry).
    keys: Mutex<HashMap<LockKey, (OwnerId, Instant)>>,
}

impl Default for BrokenBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl BrokenBackend {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            id: BackendId::next(),
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// The live holder of `key`, if any.
    fn holder(&self, key: &LockKey, now: Instant) -> Option<OwnerId> {
        self.keys
            .lock()
            .get(key)
            .filter(|(_, expiry)| *expiry > now)
            .map(|(owner, _)| *owner)
    }
}

#[async_trait]
impl LockBackend for BrokenBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
            Duration::from_secs(24 * 3600),
        )
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        let now = Instant::now();
        let mut keys = self.keys.lock();
        if keys.get(key).is_some_and(|(_, expiry)| *expiry > now) {
            return Ok(None);
        }
        let owner = OwnerId::random();
        keys.insert(key.clone(), (owner, now + ttl));
        Ok(Some(Lease::new(
            self.id,
            key.clone(),
            owner,
            TOKEN,
            ttl,
            valid_until(now, ttl),
        )))
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        lease.check_backend(self.id, NAME)?;
        let now = Instant::now();
        let mut keys = self.keys.lock();
        match keys.get_mut(lease.key()) {
            Some((owner, expiry)) if *owner == lease.owner() && *expiry > now => {
                *expiry = now + lease.ttl();
                Ok(Renewal::Renewed {
                    valid_until: valid_until(now, lease.ttl()),
                })
            }
            _ => Ok(Renewal::Lost),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        lease.check_backend(self.id, NAME)?;
        // The bug: whoever holds the key loses it.
        let now = Instant::now();
        match self.keys.lock().remove(lease.key()) {
            Some((_, expiry)) if expiry > now => Ok(Release::Released),
            _ => Ok(Release::NotHeld),
        }
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        lease.check_backend(self.id, NAME)?;
        // The bug: any live holder makes every lease of the key look current.
        match self.holder(lease.key(), Instant::now()) {
            Some(_) => Ok(Fence::Current),
            None => Ok(Fence::Stale { current: TOKEN }),
        }
    }
}

/// A factory whose clients all share one [`BrokenBackend`]; it has no fault controls.
#[derive(Debug, Default, Clone)]
pub struct BrokenFactory {
    backend: Arc<BrokenBackend>,
}

impl BrokenFactory {
    /// A factory over a fresh broken store.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl Factory for BrokenFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.backend.clone()
    }
}
