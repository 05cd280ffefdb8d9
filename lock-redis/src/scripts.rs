//! The Lua scripts, one file each in `src/scripts/`, wrapped in [`redis::Script`] so they
//! run with EVALSHA and are loaded again when the server has forgotten them.

use std::ops::Deref;
use std::sync::OnceLock;

use redis::Script;

/// One script: its source, whether it may be sent again, and its [`redis::Script`] (the
/// SHA1 that EVALSHA sends), made on first use.
pub(crate) struct Lua {
    source: &'static str,
    runs_once: bool,
    script: OnceLock<Script>,
}

impl Lua {
    /// A script whose second run reports the same as its first.
    const fn resendable(source: &'static str) -> Self {
        Self {
            source,
            runs_once: false,
            script: OnceLock::new(),
        }
    }

    /// A script whose second run reports something else than its first (see
    /// [`Lua::runs_once`]).
    const fn once(source: &'static str) -> Self {
        Self {
            source,
            runs_once: true,
            script: OnceLock::new(),
        }
    }
}

impl Deref for Lua {
    type Target = Script;
    fn deref(&self) -> &Script {
        self.script.get_or_init(|| Script::new(self.source))
    }
}

/// The source of `src/scripts/<name>`, after `token.lua`: the one place that says how a
/// token is issued and the clock read (Lua scripts share no code on the server).
macro_rules! with_tokens {
    ($name:literal) => {
        concat!(
            include_str!("scripts/token.lua"),
            include_str!(concat!("scripts/", $name))
        )
    };
}

/// The source of `src/scripts/<name>`, after `permits.lua`: how a semaphore's permit index
/// is found from a slot key and kept (see that file), for the scripts that take, free or
/// give back a permit slot.
macro_rules! with_permits {
    ($name:literal) => {
        concat!(
            include_str!("scripts/permits.lua"),
            include_str!(concat!("scripts/", $name))
        )
    };
}

/// `SET NX PX` of `<owner id>:<token>`, the token one above the high-water key (raised to
/// it) or the server's µs clock when that is higher.
pub(crate) static ACQUIRE_SCRIPT: Lua = Lua::resendable(with_tokens!("acquire.lua"));
/// Owner-checked `PEXPIRE` (the owner id is unique per acquisition).
pub(crate) static RENEW_SCRIPT: Lua = Lua::resendable(include_str!("scripts/renew.lua"));
/// Owner-checked `DEL`, and `PUBLISH` (or `SPUBLISH`) to waiters (best effort). A release
/// sent again after it ran says "not held".
pub(crate) static RELEASE_SCRIPT: Lua = Lua::once(with_permits!("release.lua"));
/// Owner-checked `DEL` for an acquire whose reply was lost.
pub(crate) static ABANDON_SCRIPT: Lua = Lua::resendable(with_permits!("abandon.lua"));
/// Owner and token check; a stale lease learns the holder's token or the clock.
pub(crate) static FENCE_SCRIPT: Lua = Lua::resendable(with_tokens!("fence.lua"));
/// Highest admitted token of a fenced resource (check only: one that meets a newer token
/// is stale by then).
pub(crate) static ADMIT_SCRIPT: Lua = Lua::resendable(include_str!("scripts/admit.lua"));
/// [`ADMIT_SCRIPT`] and, when admitted (or let through in shadow mode), the caller's `HSET`.
/// Sent again after a newer token was admitted, it would say `Stale` ("wrote nothing") for
/// a write that landed.
pub(crate) static ADMIT_WRITE_SCRIPT: Lua = Lua::once(include_str!("scripts/admit_write.lua"));
/// [`ACQUIRE_SCRIPT`] for many locks of one hash slot: one call, one reply per lock.
pub(crate) static ACQUIRE_MANY_SCRIPT: Lua = Lua::resendable(with_tokens!("acquire_many.lua"));
/// One free lock of several (a semaphore's permit slots), as [`ACQUIRE_SCRIPT`] takes one.
/// Sent again as it was, after it ran, it would take a second lock where one has come
/// free meanwhile: only its caller sends it again, flagged `R` (see `acquire_any.lua`).
pub(crate) static ACQUIRE_ANY_SCRIPT: Lua = Lua::once(with_tokens!("acquire_any.lua"));
/// [`RENEW_SCRIPT`] for many leases of one hash slot.
pub(crate) static RENEW_MANY_SCRIPT: Lua = Lua::resendable(include_str!("scripts/renew_many.lua"));
/// [`RELEASE_SCRIPT`] for many leases of one hash slot.
pub(crate) static RELEASE_MANY_SCRIPT: Lua = Lua::once(with_permits!("release_many.lua"));
/// [`ACQUIRE_ANY_SCRIPT`] for a run of one semaphore's permit slots, through the
/// semaphore's index: a grant and a refusal cost the same whatever the number of permits.
/// Only its caller sends it again, flagged `R`, as [`ACQUIRE_ANY_SCRIPT`].
pub(crate) static ACQUIRE_PERMIT_SCRIPT: Lua = Lua::once(concat!(
    include_str!("scripts/token.lua"),
    include_str!("scripts/permits.lua"),
    include_str!("scripts/acquire_permit.lua")
));
/// [`ABANDON_SCRIPT`] for an [`ACQUIRE_PERMIT_SCRIPT`] attempt: finds the slot by owner id
/// among the held ones.
pub(crate) static ABANDON_PERMIT_SCRIPT: Lua = Lua::resendable(with_permits!("abandon_permit.lua"));

/// Every script, for loading them all when connecting.
pub(crate) static ALL: [&Lua; 13] = [
    &ACQUIRE_SCRIPT,
    &RENEW_SCRIPT,
    &RELEASE_SCRIPT,
    &ABANDON_SCRIPT,
    &FENCE_SCRIPT,
    &ADMIT_SCRIPT,
    &ADMIT_WRITE_SCRIPT,
    &ACQUIRE_MANY_SCRIPT,
    &ACQUIRE_ANY_SCRIPT,
    &RENEW_MANY_SCRIPT,
    &RELEASE_MANY_SCRIPT,
    &ACQUIRE_PERMIT_SCRIPT,
    &ABANDON_PERMIT_SCRIPT,
];

impl Lua {
    /// True for the scripts whose second run reports something else than their first, so
    /// a client must never send them again after a connection error: a release sent again
    /// after it ran says "not held" (a second release is `NotHeld` by contract), and a
    /// fenced write sent again after a newer token was admitted says `Stale` for a write
    /// that landed, and an any-of acquire sent again unflagged may take a second lock (its
    /// caller sends it again flagged instead). The others are safe to resend: an acquire
    /// (single or batch) sent again with its owner id returns its token; renew, fence and
    /// abandon report the same thing twice.
    pub(crate) fn runs_once(&self) -> bool {
        self.runs_once
    }

    /// Its source, for `SCRIPT LOAD` (`redis::Script` keeps its source private).
    pub(crate) fn source(&self) -> &'static str {
        self.source
    }
}
