//! One key of an in-memory store: who holds it until when, and the last token granted.
//!
//! The memory backend's, and the conformance suite's broken backend's, which is the same
//! store with one bug (hence public, hidden from the docs: not part of the API).

use tokio::time::Instant;

use crate::backend::lease::Lease;
use crate::key::{FencingToken, OwnerId};

/// One key in the store.
#[derive(Debug, Default)]
pub struct KeyState {
    /// The last grant, which may have run out.
    pub holder: Option<Holder>,
    /// The highest token granted on the key (0: never granted).
    pub last_token: u64,
}

/// A grant of a key.
#[derive(Debug, Clone, Copy)]
pub struct Holder {
    /// The owner id of the lease.
    pub owner: OwnerId,
    /// The token of the lease.
    pub token: FencingToken,
    /// When its TTL runs out, on the store's clock.
    pub expires_at: Instant,
}

impl KeyState {
    /// The holder whose TTL has not run out at `now`.
    pub fn live_holder(&self, now: Instant) -> Option<&Holder> {
        self.holder.as_ref().filter(|h| h.expires_at > now)
    }

    /// Whether `lease` (its owner and token) is the live holder at `now`.
    pub fn is_held_by(&self, lease: &Lease, now: Instant) -> bool {
        self.live_holder(now)
            .is_some_and(|h| h.owner == lease.owner() && h.token == lease.token())
    }
}
