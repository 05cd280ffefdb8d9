//! The Lua scripts, one file each in `src/scripts/`, wrapped in [`redis::Script`] so they
//! run with EVALSHA and are loaded again when the server has forgotten them.

use std::sync::LazyLock;

use redis::Script;

const ACQUIRE: &str = include_str!("scripts/acquire.lua");
const RENEW: &str = include_str!("scripts/renew.lua");
const RELEASE: &str = include_str!("scripts/release.lua");
const ABANDON: &str = include_str!("scripts/abandon.lua");
const FENCE: &str = include_str!("scripts/fence.lua");
const ADMIT: &str = include_str!("scripts/admit.lua");
const ADMIT_WRITE: &str = include_str!("scripts/admit_write.lua");
const ACQUIRE_MANY: &str = include_str!("scripts/acquire_many.lua");
const ACQUIRE_ANY: &str = include_str!("scripts/acquire_any.lua");
const RENEW_MANY: &str = include_str!("scripts/renew_many.lua");
const RELEASE_MANY: &str = include_str!("scripts/release_many.lua");

/// `SET NX PX` of `<owner id>:<token>`, the token being the server's µs clock.
pub(crate) static ACQUIRE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE));
/// Owner-checked `PEXPIRE` (the owner id is unique per acquisition).
pub(crate) static RENEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW));
/// Owner-checked `DEL`, `PUBLISH` (or `SPUBLISH`) to waiters (best effort), and the clock
/// past the token.
pub(crate) static RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE));
/// Owner-checked `DEL` for an acquire whose reply was lost.
pub(crate) static ABANDON_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON));
/// Owner and token check; a stale lease learns the holder's token or the clock.
pub(crate) static FENCE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(FENCE));
/// Highest admitted token of a fenced resource.
pub(crate) static ADMIT_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ADMIT));
/// [`ADMIT_SCRIPT`] and, when admitted (or let through in shadow mode), the caller's `HSET`.
pub(crate) static ADMIT_WRITE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ADMIT_WRITE));

/// [`ACQUIRE_SCRIPT`] for many locks of one hash slot: one call, one reply per lock.
pub(crate) static ACQUIRE_MANY_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(ACQUIRE_MANY));
/// One free lock of several (a semaphore's permit slots), as [`ACQUIRE_SCRIPT`] takes one.
pub(crate) static ACQUIRE_ANY_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_ANY));
/// [`RENEW_SCRIPT`] for many leases of one hash slot.
pub(crate) static RENEW_MANY_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_MANY));
/// [`RELEASE_SCRIPT`] for many leases of one hash slot.
pub(crate) static RELEASE_MANY_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(RELEASE_MANY));

/// True for the scripts whose second run reports something else than their first, so a
/// client must never send them again after a connection error: a release sent again after
/// it ran says "not held" (a second release is `NotHeld` by contract), and a fenced write
/// sent again after a newer token was admitted says `Stale` ("wrote nothing") for a write
/// that landed. The others are safe to resend: an acquire (single, batch or any-of) sent again
/// with its owner id returns its token; renew, fence and abandon report the same thing twice; an `admit`
/// (check only) that meets a newer token is stale by then.
pub(crate) fn runs_once(script: &Script) -> bool {
    [
        &*RELEASE_SCRIPT,
        &*RELEASE_MANY_SCRIPT,
        &*ADMIT_WRITE_SCRIPT,
    ]
    .iter()
    .any(|s| s.get_hash() == script.get_hash())
}

/// Every script, for loading them all when connecting.
pub(crate) fn all() -> [&'static Script; 11] {
    [
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
    ]
}

/// The source of one of the scripts above, for `SCRIPT LOAD` before a pipeline is resent
/// (`redis::Script` keeps its source private).
pub(crate) fn source(script: &Script) -> &'static str {
    [
        (&*ACQUIRE_SCRIPT, ACQUIRE),
        (&*RENEW_SCRIPT, RENEW),
        (&*RELEASE_SCRIPT, RELEASE),
        (&*ABANDON_SCRIPT, ABANDON),
        (&*FENCE_SCRIPT, FENCE),
        (&*ADMIT_SCRIPT, ADMIT),
        (&*ADMIT_WRITE_SCRIPT, ADMIT_WRITE),
        (&*ACQUIRE_MANY_SCRIPT, ACQUIRE_MANY),
        (&*ACQUIRE_ANY_SCRIPT, ACQUIRE_ANY),
        (&*RENEW_MANY_SCRIPT, RENEW_MANY),
        (&*RELEASE_MANY_SCRIPT, RELEASE_MANY),
    ]
    .into_iter()
    .find(|(s, _)| s.get_hash() == script.get_hash())
    .map_or("", |(_, src)| src)
}
