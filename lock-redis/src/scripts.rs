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
const ACQUIRE_MANY: &str = include_str!("scripts/acquire_many.lua");
const RENEW_MANY: &str = include_str!("scripts/renew_many.lua");
const RELEASE_MANY: &str = include_str!("scripts/release_many.lua");

/// `SET NX PX` and, on success, the new token: `INCR` of the counter, or the server's µs
/// clock when the counter is new (made with the fence retention as TTL).
pub(crate) static ACQUIRE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE));
/// Owner-checked `PEXPIRE` (the owner id is unique per acquisition).
pub(crate) static RENEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW));
/// Owner-checked `DEL` and `PUBLISH` to waiters.
pub(crate) static RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE));
/// Owner-checked `DEL` for an acquire whose reply was lost.
pub(crate) static ABANDON_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON));
/// Owner check, and token check while the counter is kept.
pub(crate) static FENCE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(FENCE));
/// Highest admitted token of a fenced resource.
pub(crate) static ADMIT_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(ADMIT));
/// [`ADMIT_SCRIPT`] and, when admitted (or let through in shadow mode), the caller's `HSET`.
pub(crate) static ADMIT_WRITE_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/admit_write.lua")));

/// [`ACQUIRE_SCRIPT`] for many locks of one hash slot: one call, one reply per lock.
pub(crate) static ACQUIRE_MANY_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(ACQUIRE_MANY));
/// [`RENEW_SCRIPT`] for many leases of one hash slot.
pub(crate) static RENEW_MANY_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_MANY));
/// [`RELEASE_SCRIPT`] for many leases of one hash slot.
pub(crate) static RELEASE_MANY_SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(RELEASE_MANY));

/// True for the scripts whose second run reports something else than their first, so a
/// client must never send them again after a connection error: a release sent again after
/// it ran says "not held" (a second release is `NotHeld` by contract). The others are
/// safe to resend: an acquire sent again with its owner id returns its token; renew,
/// fence and abandon report the same thing twice.
pub(crate) fn runs_once(script: &Script) -> bool {
    [&*RELEASE_SCRIPT, &*RELEASE_MANY_SCRIPT]
        .iter()
        .any(|s| s.get_hash() == script.get_hash())
}

/// Every script, for loading them all when connecting.
pub(crate) fn all() -> [&'static Script; 9] {
    [
        &ACQUIRE_SCRIPT,
        &RENEW_SCRIPT,
        &RELEASE_SCRIPT,
        &ABANDON_SCRIPT,
        &FENCE_SCRIPT,
        &ADMIT_SCRIPT,
        &ACQUIRE_MANY_SCRIPT,
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
        (&*ACQUIRE_MANY_SCRIPT, ACQUIRE_MANY),
        (&*RENEW_MANY_SCRIPT, RENEW_MANY),
        (&*RELEASE_MANY_SCRIPT, RELEASE_MANY),
    ]
    .into_iter()
    .find(|(s, _)| s.get_hash() == script.get_hash())
    .map_or("", |(_, src)| src)
}
