//! [`BrokenKind`]: the bugs, one per variant, and [`CAUGHT_BY`]: for each, the cases that
//! must fail on it and the invariants the history checker must report.

use crate::history::Invariant;

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
