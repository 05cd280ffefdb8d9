//! Deliberately wrong backends that prove the suite can fail: one [`BrokenKind`] per bug.
//!
//! [`BrokenBackend`] is an in-memory store that meets the [`LockBackend`] contract except
//! for the one bug its kind names; [`BrokenFactory::control`] makes the same store with no
//! bug, which passes the whole suite, so every failure on a variant is its bug's.
//! [`CAUGHT_BY`] names, for each variant, the cases that must fail on it and the
//! invariants the history checker must report; `tests/broken.rs` runs the suite against
//! every variant with [`run_each`] and checks both with [`Caught`], which a backend
//! outside the workspace uses the same way to show the suite catches a bug in it. Never
//! use these backends for anything else.
//!
//! The factory has the fault controls the cases need: link faults (a delay before each
//! request reaches the store; a cut that lets requests through and holds every reply
//! until healed, as when the network fails after the send) and server faults (a pause, a
//! kill, and a restart that loses every lease but, except in
//! [`BrokenKind::TokenDropsAfterRestart`], keeps the token counters, as Redis's
//! clock-floored tokens and etcd's revisions do; in
//! [`BrokenKind::PermitHoldersForgottenAfterRestart`] it keeps the leases too).

mod caught;
mod factory;
mod kind;

pub use caught::{Caught, run_each};
pub use factory::BrokenFactory;
pub use kind::{BrokenKind, CAUGHT_BY, Catch};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::memory::{Holder, KeyState};
use distlock_core::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use distlock_core::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal, valid_until,
};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

const NAME: &str = "broken";

/// The release hub the clients of one store share.
#[derive(Debug)]
struct Releases(ReleaseHub);

impl Default for Releases {
    fn default() -> Self {
        Self(ReleaseHub::new(AllKeys))
    }
}

/// The state every client of a [`BrokenFactory`] shares: the keys, and the faults.
#[derive(Debug, Default)]
struct Store {
    keys: Mutex<HashMap<LockKey, KeyState>>,
    /// Wakes the waiters of every client when a key is released.
    releases: Releases,
    /// The keys `acquire_any` granted: a semaphore's permit slots, where the permit bugs
    /// live.
    permits: Mutex<std::collections::HashSet<LockKey>>,
    /// The permit slots whose holders a restart forgot, until their next grant
    /// ([`BrokenKind::PermitHoldersForgottenAfterRestart`]).
    forgotten: Mutex<std::collections::HashSet<LockKey>>,
    delay_micros: AtomicU64,
    /// Replies are held until healed.
    cut: AtomicBool,
    /// Requests are held until resumed.
    paused: AtomicBool,
    /// Requests fail until restarted.
    killed: AtomicBool,
    /// How far the store's wall clock is behind the real one, in µs.
    clock_behind_micros: AtomicU64,
    changed: Notify,
}

impl Store {
    /// Waits until `flag` is false.
    async fn wait_clear(&self, flag: &AtomicBool) {
        loop {
            let changed = self.changed.notified();
            if !flag.load(Ordering::SeqCst) {
                return;
            }
            changed.await;
        }
    }

    /// The request's way to the store: the link delay, a paused or killed server.
    async fn reach(&self) -> Result<(), LockError> {
        let delay = self.delay_micros.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        self.wait_clear(&self.paused).await;
        if self.killed.load(Ordering::SeqCst) {
            return Err(LockError::unavailable(
                NAME,
                "server killed (injected fault)",
            ));
        }
        Ok(())
    }

    /// The reply's way back: held while the link is cut.
    async fn reply(&self) {
        self.wait_clear(&self.cut).await;
    }

    /// The store's wall clock in µs since the Unix epoch.
    fn clock_micros(&self) -> u64 {
        let real = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        real.saturating_sub(self.clock_behind_micros.load(Ordering::SeqCst))
    }

    fn set(&self, flag: &AtomicBool, on: bool) {
        flag.store(on, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// An in-memory lock backend with at most one bug; see [`BrokenKind`].
#[derive(Debug)]
pub struct BrokenBackend {
    id: BackendId,
    kind: Option<BrokenKind>,
    store: Arc<Store>,
}

impl BrokenBackend {
    fn has(&self, kind: BrokenKind) -> bool {
        self.kind == Some(kind)
    }

    /// The deadline given to a call sent at `sent`: from the reply instead, in
    /// [`BrokenKind::ValidityFromReply`].
    fn valid_until(&self, sent: Instant, ttl: Duration) -> Instant {
        if self.has(BrokenKind::ValidityFromReply) {
            valid_until(Instant::now(), ttl)
        } else {
            valid_until(sent, ttl)
        }
    }

    /// Takes `key` for `owner` if it is free at `now` (whatever holds it, if `force`); the
    /// grant's token.
    fn take(
        &self,
        key: &LockKey,
        ttl: Duration,
        owner: OwnerId,
        force: bool,
    ) -> Option<FencingToken> {
        let now = Instant::now();
        let mut keys = self.store.keys.lock();
        let state = keys.entry(key.clone()).or_default();
        let held = if self.has(BrokenKind::ExpiredPermitNeverFreed)
            && self.store.permits.lock().contains(key)
        {
            // The bug: a permit's holder is not checked for expiry.
            state.holder.is_some()
        } else if self.store.forgotten.lock().remove(key) {
            // The bug of PermitHoldersForgottenAfterRestart: the holder is not counted.
            false
        } else {
            state.live_holder(now).is_some()
        };
        if held && !self.has(BrokenKind::GrantedTwice) && !force {
            return None;
        }
        if self.has(BrokenKind::TokenFromClock) {
            // The bug: the clock alone, which a step back sends below earlier tokens.
            state.last_token = self.store.clock_micros();
        } else if !self.has(BrokenKind::RepeatedToken) || state.last_token == 0 {
            state.last_token += 1;
        }
        let token = FencingToken(state.last_token);
        state.holder = Some(Holder {
            owner,
            token,
            expires_at: now + ttl,
        });
        Some(token)
    }

    fn is_free(&self, key: &LockKey) -> bool {
        let now = Instant::now();
        self.store
            .keys
            .lock()
            .get(key)
            .is_none_or(|s| s.live_holder(now).is_none())
    }

    /// The renewal in the store, reply included.
    async fn renew_in_store(&self, lease: &Lease, sent: Instant) -> Result<Renewal, LockError> {
        self.store.reach().await?;
        let renewed = {
            let now = Instant::now();
            let mut keys = self.store.keys.lock();
            let state = keys.get_mut(lease.key());
            let holder = state.and_then(|s| {
                let live = s.live_holder(now).is_some();
                let h = s.holder.as_mut()?;
                let owned = h.owner == lease.owner() && h.token == lease.token();
                let renewable = match self.kind {
                    Some(BrokenKind::RenewWithoutOwnerCheck) => live,
                    Some(BrokenKind::RenewRevivesExpired) => owned,
                    _ => live && owned,
                };
                renewable.then_some(h)
            });
            match holder {
                Some(h) => {
                    h.expires_at = now + lease.ttl();
                    true
                }
                None => false,
            }
        };
        self.store.reply().await;
        Ok(if renewed {
            Renewal::Renewed {
                valid_until: self.valid_until(sent, lease.ttl()),
            }
        } else {
            Renewal::Lost
        })
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
        .inspect(true)
        .wakes_waiters(true)
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        let sent = Instant::now();
        self.store.reach().await?;
        let owner = OwnerId::random();
        let token = if self.has(BrokenKind::GrantedTwice) {
            // The bug: the check and the take are two steps.
            if !self.is_free(key) {
                return Ok(None);
            }
            tokio::task::yield_now().await;
            self.take(key, ttl, owner, false)
        } else {
            self.take(key, ttl, owner, false)
        };
        if self.has(BrokenKind::LostReplyReportedBusy) && self.store.cut.load(Ordering::SeqCst) {
            // The bug: a reply that does not come is taken for "held".
            return Ok(None);
        }
        self.store.reply().await;
        Ok(token.map(|token| {
            Lease::new(
                self.id,
                key.clone(),
                owner,
                token,
                ttl,
                self.valid_until(sent, ttl),
            )
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        lease.check_backend(self.id, NAME)?;
        let sent = Instant::now();
        if self.has(BrokenKind::LostNeverFires) {
            // The bug: no answer in time is taken for success.
            let answer = tokio::time::timeout(lease.ttl() / 10, self.renew_in_store(lease, sent));
            return match answer.await {
                Ok(result) => result,
                Err(_) => Ok(Renewal::Renewed {
                    valid_until: valid_until(sent, lease.ttl()),
                }),
            };
        }
        self.renew_in_store(lease, sent).await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        lease.check_backend(self.id, NAME)?;
        self.store.reach().await?;
        let permit = self.store.permits.lock().contains(lease.key());
        let unchecked = self.has(BrokenKind::ReleaseWithoutOwnerCheck)
            || (permit && self.has(BrokenKind::PermitReleaseWithoutOwnerCheck));
        let released = {
            let now = Instant::now();
            let mut keys = self.store.keys.lock();
            match keys.get_mut(lease.key()) {
                Some(state)
                    if state.is_held_by(lease, now)
                        || (unchecked && state.live_holder(now).is_some()) =>
                {
                    // The bug: a permit's slot stays held.
                    if !(permit && self.has(BrokenKind::PermitReleaseKeepsSlot)) {
                        state.holder = None;
                    }
                    Release::Released
                }
                _ => Release::NotHeld,
            }
        };
        if released == Release::Released && self.has(BrokenKind::TokenFromClock) {
            // The next grant reads a later clock, unless it stands still or went back.
            let token = lease.token().get();
            for _ in 0..1000 {
                if self.store.clock_micros() > token {
                    break;
                }
            }
        }
        let silent = self.has(BrokenKind::ReleaseWakesNoOne)
            || (permit && self.has(BrokenKind::PermitReleaseWakesNoOne));
        if released == Release::Released && !silent {
            self.store.releases.0.notify(lease.key());
        }
        self.store.reply().await;
        Ok(released)
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        Some(self.store.releases.0.watch(key))
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.store.releases.0.watched_keys()
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        lease.check_backend(self.id, NAME)?;
        self.store.reach().await?;
        let fence = {
            let now = Instant::now();
            let keys = self.store.keys.lock();
            let state = keys.get(lease.key());
            let current = state.is_some_and(|s| {
                s.is_held_by(lease, now)
                    || (self.has(BrokenKind::FenceCurrentForStale) && s.live_holder(now).is_some())
            });
            if current {
                Fence::Current
            } else {
                Fence::Stale {
                    current: FencingToken(state.map_or(lease.token().0, |s| s.last_token)),
                }
            }
        };
        self.store.reply().await;
        Ok(fence)
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.store.reach().await?;
        let info = {
            let now = Instant::now();
            let keys = self.store.keys.lock();
            let state = keys.get(key);
            let holder = state.and_then(|s| s.live_holder(now));
            LockInfo {
                owner: holder.map(|h| h.owner),
                token: state
                    .filter(|s| s.last_token > 0)
                    .map(|s| FencingToken(s.last_token)),
                remaining: holder.map(|h| h.expires_at - now),
            }
        };
        self.store.reply().await;
        Ok(info)
    }

    /// Marks every key it is given as a permit slot, then takes the first free one as
    /// `acquire` does, or in [`BrokenKind::PermitGrantedWhenFull`] the last one when none
    /// is free.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.store.permits.lock().extend(keys.iter().cloned());
        if let Some(lease) =
            distlock_core::acquire_first_free(keys, |key| self.acquire(key, ttl)).await?
        {
            return Ok(Some(lease));
        }
        let Some(last) = keys.last() else {
            return Ok(None);
        };
        if !self.has(BrokenKind::PermitGrantedWhenFull) {
            return Ok(None);
        }
        // The bug: a full semaphore grants one more.
        let sent = Instant::now();
        self.store.reach().await?;
        let owner = OwnerId::random();
        let token = self.take(last, ttl, owner, true);
        self.store.reply().await;
        Ok(token.map(|token| {
            Lease::new(
                self.id,
                last.clone(),
                owner,
                token,
                ttl,
                self.valid_until(sent, ttl),
            )
        }))
    }

    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        for lease in leases {
            lease.check_backend(self.id, NAME)?;
        }
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(self.release(lease).await?);
        }
        if self.has(BrokenKind::BatchDisagrees) {
            // The bug: the batch reports what it was asked to do, not what it did.
            out.fill(Release::Released);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_one_row_naming_cases_that_exist() {
        for kind in BrokenKind::ALL {
            let rows = CAUGHT_BY.iter().filter(|c| c.kind == kind).count();
            assert_eq!(rows, 1, "{kind:?}");
            let catch = kind.caught_by();
            assert!(!catch.cases.is_empty(), "{kind:?}");
            for case in catch.cases {
                assert!(
                    crate::suite::case(case).is_some(),
                    "{kind:?}: no case {case}"
                );
            }
        }
        assert_eq!(CAUGHT_BY.len(), BrokenKind::ALL.len());
    }
}
