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

pub use caught::{Caught, run_each};

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

use crate::factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults, SessionFaults};
use crate::history::Invariant;

const NAME: &str = "broken";

/// One bug, each a way real lock backends have gone wrong.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum BrokenKind {
    /// Every grant carries token 1: the counter is never incremented.
    RepeatedToken,
    /// A restart resets the token counters, so tokens start again from 1.
    TokenDropsAfterRestart,
    /// A token is the store's wall clock in µs, read at the grant, and a release waits
    /// (a bounded spin) for the clock to pass the token; nothing else is kept: a clock
    /// stepped back hands out lower tokens.
    TokenFromClock,
    /// Acquire checks that the key is free, yields, then takes it: concurrent acquires
    /// of one free key all win.
    GrantedTwice,
    /// Renew checks owner and token but not expiry: a lease nobody took since it
    /// expired comes back.
    RenewRevivesExpired,
    /// Release frees the key whoever holds it.
    ReleaseWithoutOwnerCheck,
    /// Renew extends the key whoever holds it.
    RenewWithoutOwnerCheck,
    /// Grants and renewals count `valid_until` from the reply, not the send instant.
    ValidityFromReply,
    /// `release_many` releases correctly but reports `Released` for every lease.
    BatchDisagrees,
    /// Fence says `Current` for any lease of a key someone holds.
    FenceCurrentForStale,
    /// Renew reports `Renewed` when the store does not answer in a tenth of the TTL, so
    /// the watchdog never sees the loss.
    LostNeverFires,
    /// Acquire reports `Ok(None)` (held) when the reply is lost, though the request took
    /// the key.
    LostReplyReportedBusy,
    /// Claims to announce releases, but a release wakes no waiter.
    ReleaseWakesNoOne,
    /// `acquire_any` (a semaphore's permit), finding every slot held, takes the last one
    /// anyway: one permit too many.
    PermitGrantedWhenFull,
    /// A permit (a key granted by `acquire_any`) is released whoever asks.
    PermitReleaseWithoutOwnerCheck,
    /// `acquire_any` counts a slot whose holder expired as held: an expired permit is never
    /// freed for the semaphore.
    ExpiredPermitNeverFreed,
    /// The release of a permit wakes no waiter (locks still do).
    PermitReleaseWakesNoOne,
    /// The release of a permit says `Released` but leaves its slot held until its TTL
    /// runs out (locks are freed).
    PermitReleaseKeepsSlot,
    /// A restart keeps every lease (the store is durable: renewals of its leases are
    /// `Renewed`), but a grant takes a permit slot held across the restart as if it were
    /// free: the store forgot who holds the semaphore.
    PermitHoldersForgottenAfterRestart,
}

impl BrokenKind {
    /// Every variant.
    pub const ALL: [BrokenKind; 19] = [
        BrokenKind::RepeatedToken,
        BrokenKind::TokenDropsAfterRestart,
        BrokenKind::TokenFromClock,
        BrokenKind::GrantedTwice,
        BrokenKind::RenewRevivesExpired,
        BrokenKind::ReleaseWithoutOwnerCheck,
        BrokenKind::RenewWithoutOwnerCheck,
        BrokenKind::ValidityFromReply,
        BrokenKind::BatchDisagrees,
        BrokenKind::FenceCurrentForStale,
        BrokenKind::LostNeverFires,
        BrokenKind::LostReplyReportedBusy,
        BrokenKind::ReleaseWakesNoOne,
        BrokenKind::PermitGrantedWhenFull,
        BrokenKind::PermitReleaseWithoutOwnerCheck,
        BrokenKind::ExpiredPermitNeverFreed,
        BrokenKind::PermitReleaseWakesNoOne,
        BrokenKind::PermitReleaseKeepsSlot,
        BrokenKind::PermitHoldersForgottenAfterRestart,
    ];

    /// What must catch this variant: its row of [`CAUGHT_BY`].
    pub fn caught_by(self) -> &'static Catch {
        CAUGHT_BY
            .iter()
            .find(|c| c.kind == self)
            .unwrap_or_else(|| panic!("no row in CAUGHT_BY for {self:?}"))
    }
}

/// What must catch one broken variant.
#[derive(Debug)]
pub struct Catch {
    /// The variant.
    pub kind: BrokenKind,
    /// Cases that must fail on it (they guard the rule it breaks); others may fail too.
    pub cases: &'static [&'static str],
    /// Invariants the history checker must report in at least one failing case; empty
    /// where the bug is outside what a history can show (a reply, a signal).
    pub invariants: &'static [Invariant],
}

/// For each broken variant, the cases that must fail on it and the invariants the history
/// checker must report.
pub const CAUGHT_BY: &[Catch] = &[
    Catch {
        kind: BrokenKind::RepeatedToken,
        cases: &[
            "release_frees_the_key",
            "tokens_increase_across_releases",
            "tokens_increase_across_expiries",
            "renew_never_resurrects",
            "paused_holder_is_fenced",
            "contention_loses_no_update",
        ],
        invariants: &[Invariant::I1],
    },
    Catch {
        kind: BrokenKind::TokenDropsAfterRestart,
        cases: &[
            "tokens_increase_across_restarts",
            "a_full_semaphore_keeps_its_permits_across_a_restart",
        ],
        invariants: &[Invariant::I1],
    },
    Catch {
        kind: BrokenKind::TokenFromClock,
        cases: &["tokens_keep_rising_across_a_clock_step"],
        invariants: &[Invariant::I1],
    },
    Catch {
        kind: BrokenKind::GrantedTwice,
        cases: &["acquire_excludes_others", "contention_loses_no_update"],
        invariants: &[Invariant::I2, Invariant::I3],
    },
    Catch {
        kind: BrokenKind::RenewRevivesExpired,
        cases: &["renew_never_resurrects"],
        invariants: &[Invariant::I5],
    },
    Catch {
        kind: BrokenKind::ReleaseWithoutOwnerCheck,
        cases: &[
            "release_by_non_owner_is_not_held",
            "release_after_expiry_leaves_new_holder",
            "second_release_is_not_held",
            "release_many_agrees_with_release",
        ],
        invariants: &[Invariant::I4],
    },
    Catch {
        kind: BrokenKind::RenewWithoutOwnerCheck,
        cases: &[
            "renew_by_non_owner_is_lost",
            "renew_after_expiry_leaves_new_holder",
            "renew_many_agrees_with_renew",
            "a_full_semaphore_keeps_its_permits_across_a_restart",
        ],
        invariants: &[Invariant::I4],
    },
    Catch {
        kind: BrokenKind::ValidityFromReply,
        cases: &["validity_counts_from_the_send_instant"],
        // A history does not show when a request left, only that it left by its reply:
        // the case's delayed link does.
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::BatchDisagrees,
        cases: &["release_many_agrees_with_release"],
        invariants: &[Invariant::I4],
    },
    Catch {
        kind: BrokenKind::FenceCurrentForStale,
        cases: &[
            "renew_by_non_owner_is_lost",
            "fence_stale_after_takeover",
            "paused_holder_is_fenced",
        ],
        invariants: &[Invariant::I4],
    },
    Catch {
        kind: BrokenKind::LostNeverFires,
        cases: &["watchdog_reports_loss_by_valid_until"],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::LostReplyReportedBusy,
        cases: &["lost_reply_is_not_a_lease"],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::ReleaseWakesNoOne,
        cases: &[
            "a_release_wakes_a_waiter",
            "a_resignation_wakes_a_campaigning_standby",
        ],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::PermitGrantedWhenFull,
        cases: &[
            "semaphore_never_grants_more_than_its_permits",
            "semaphores_naming_different_permits_share_their_slots",
            "semaphore_expired_permit_is_freed",
            "a_full_semaphore_keeps_its_permits_across_a_restart",
        ],
        invariants: &[Invariant::I3, Invariant::I6],
    },
    Catch {
        kind: BrokenKind::PermitReleaseWithoutOwnerCheck,
        cases: &["semaphore_permit_release_is_owner_checked"],
        invariants: &[Invariant::I4],
    },
    Catch {
        kind: BrokenKind::ExpiredPermitNeverFreed,
        cases: &["semaphore_expired_permit_is_freed"],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::PermitReleaseWakesNoOne,
        cases: &["a_permit_release_wakes_a_waiter"],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::PermitReleaseKeepsSlot,
        cases: &[
            "semaphore_grants_many_permits_all_or_none",
            "a_permit_release_wakes_a_waiter",
            "dropped_permit_acquire_mid_wait_leaves_no_permit_held",
            "timed_out_permit_acquire_leaves_no_permit_held",
        ],
        invariants: &[],
    },
    Catch {
        kind: BrokenKind::PermitHoldersForgottenAfterRestart,
        cases: &["a_full_semaphore_keeps_its_permits_across_a_restart"],
        invariants: &[Invariant::I3, Invariant::I6],
    },
];

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

/// A factory whose clients are separate [`BrokenBackend`] instances on one shared store,
/// with link and server faults.
#[derive(Debug, Clone)]
pub struct BrokenFactory {
    kind: Option<BrokenKind>,
    store: Arc<Store>,
}

impl Default for BrokenFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl BrokenFactory {
    /// A factory with the [`BrokenKind::ReleaseWithoutOwnerCheck`] bug, for tests that
    /// need some broken backend.
    pub fn new() -> Self {
        Self::with_kind(BrokenKind::ReleaseWithoutOwnerCheck)
    }

    /// A factory over a fresh store with the bug `kind`.
    pub fn with_kind(kind: BrokenKind) -> Self {
        Self {
            kind: Some(kind),
            store: Arc::default(),
        }
    }

    /// A factory over a fresh store with no bug: the control that passes the suite.
    pub fn control() -> Self {
        Self {
            kind: None,
            store: Arc::default(),
        }
    }

    /// The bug its backends have, if any.
    pub fn kind(&self) -> Option<BrokenKind> {
        self.kind
    }
}

#[async_trait]
impl Factory for BrokenFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(BrokenBackend {
            id: BackendId::next(),
            kind: self.kind,
            store: self.store.clone(),
        })
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn sessions(&self) -> Option<Arc<dyn SessionFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn failover(&self) -> Option<Arc<dyn Failover>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }
}

/// The fault controls of a [`BrokenFactory`]'s store.
#[derive(Debug)]
struct BrokenFaults(BrokenFactory);

#[async_trait]
impl LinkFaults for BrokenFaults {
    async fn cut(&self) {
        self.0.store.set(&self.0.store.cut, true);
    }

    async fn delay(&self, by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0.store.delay_micros.store(micros, Ordering::SeqCst);
    }

    async fn heal(&self) {
        self.0.store.delay_micros.store(0, Ordering::SeqCst);
        self.0.store.set(&self.0.store.cut, false);
    }
}

#[async_trait]
impl ServerFaults for BrokenFaults {
    async fn pause(&self) {
        self.0.store.set(&self.0.store.paused, true);
    }

    async fn resume(&self) {
        self.0.store.set(&self.0.store.paused, false);
    }

    async fn kill(&self) {
        self.0.store.set(&self.0.store.killed, true);
    }

    async fn restart(&self) {
        let store = &self.0.store;
        if self.0.kind == Some(BrokenKind::PermitHoldersForgottenAfterRestart) {
            // The bug: the leases were durable, who holds the permit slots was not.
            *store.forgotten.lock() = store.permits.lock().clone();
            store.set(&store.killed, false);
            return;
        }
        for state in store.keys.lock().values_mut() {
            state.holder = None;
            if self.0.kind == Some(BrokenKind::TokenDropsAfterRestart) {
                // The bug: the counters were not durable.
                state.last_token = 0;
            }
        }
        store.set(&store.killed, false);
    }
}

#[async_trait]
impl SessionFaults for BrokenFaults {
    /// Every holder's session ends: the locks go with them, the counters stay.
    async fn terminate(&self) {
        for state in self.0.store.keys.lock().values_mut() {
            state.holder = None;
        }
    }
}

#[async_trait]
impl ClockFaults for BrokenFaults {
    async fn step_back(&self, by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0
            .store
            .clock_behind_micros
            .fetch_add(micros, Ordering::SeqCst);
    }
}

#[async_trait]
impl Failover for BrokenFaults {
    /// The store is one node whose replica has every write: a fail-over changes nothing
    /// the clients see.
    async fn fail_over(&self, _key: &LockKey) {}

    /// As [`Failover::fail_over`]: nothing the clients see changes.
    async fn switch_over(&self, _key: &LockKey) {}
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
