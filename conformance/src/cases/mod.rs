//! One `pub async fn` per conformance case.
//!
//! Every case takes a [`crate::Factory`], works under its own random key prefix,
//! records its calls in a [`crate::history::History`], checks what the contract in
//! [`distlock_core::LockBackend`] requires at each step, checks the history against I1–I6 at
//! the end, and releases what it took. TTLs come from the backend's capabilities
//! ([`crate::suite::Timing`]), and every wait on the store is a deadline with slack,
//! never a speed assertion. A case never returns early: what it needs beyond a store
//! (link or server faults, inspection, distinct clients) is declared beside its name in
//! the case list and checked before it runs ([`crate::suite::Need`]).

mod batch;
mod cancel;
mod clock;
mod election;
mod input;
mod lease;
mod locker;
mod permits;
mod semaphore;
mod semaphore_restart;
mod server_faults;
mod wake;

pub use batch::*;
pub use cancel::*;
pub use clock::*;
pub use election::*;
pub use input::*;
pub use lease::*;
pub use locker::*;
pub use permits::*;
pub use semaphore::*;
pub use semaphore_restart::*;
pub use server_faults::*;
pub use wake::*;

use std::sync::Arc;

use distlock_core::{Admission, FencingToken, Lease, LockBackend, LockError, OwnerId, Release};

use crate::history::FencedCounter;
use crate::support::{Ctx, Failure};

/// Releases `lease`, which must still be held.
async fn release_held(
    ctx: &Ctx<'_>,
    client: &Arc<dyn LockBackend>,
    lease: &Lease,
) -> Result<(), Failure> {
    let got = ctx.ok("release of a held lease", client.release(lease).await)?;
    ctx.ensure(
        got == Release::Released,
        format!(
            "release of the held lease with token {} to be Released",
            lease.token()
        ),
        || format!("{got:?}"),
    )
}

/// Checks that a guard's release, which completed, was Released.
fn guard_released(ctx: &Ctx<'_>, released: Result<Release, LockError>) -> Result<(), Failure> {
    let released = ctx.ok("guard release", released)?;
    ctx.ensure(
        released == Release::Released,
        "the guard's release to be Released",
        || format!("{released:?}"),
    )
}

/// Checks that `next` carries a token above `previous`; `expected` says so in a failure.
fn token_above(
    ctx: &Ctx<'_>,
    next: &Lease,
    previous: FencingToken,
    expected: impl std::fmt::Display,
) -> Result<(), Failure> {
    ctx.ensure(next.token() > previous, expected, || {
        format!("token {}", next.token())
    })
}

/// What a stale holder writes after reading `read` (before the new holder wrote): a value
/// no admitted write carries (the workload's writes add one), so a store that refuses the
/// write but keeps its value shows in the counter.
fn stale_value(read: u64) -> u64 {
    read + 100
}

/// Checks that the late write of `who` (the holder of `old`, its value from
/// [`stale_value`]) was rejected after the new holder of `new` wrote, and that `counter`
/// holds the new holder's value 2.
async fn late_write_rejected(
    ctx: &Ctx<'_>,
    counter: &FencedCounter,
    late: Admission,
    who: &str,
    old: &Lease,
    new: &Lease,
) -> Result<(), Failure> {
    ctx.ensure(
        !late.is_admitted(),
        format!(
            "{who}'s late write (token {}) to be rejected after token {} wrote",
            old.token(),
            new.token()
        ),
        || format!("{late:?}"),
    )?;
    let value = ctx.ok("read the counter", counter.read(new.key()).await)?;
    ctx.ensure(
        value == 2,
        "the counter to hold the new holder's value 2",
        || value,
    )
}

/// A copy of `lease` with another owner: what a non-owner that guessed the key and
/// token would send.
fn forged(lease: &Lease) -> Lease {
    Lease::new(
        lease.backend_id(),
        lease.key().clone(),
        OwnerId::random(),
        lease.token(),
        lease.ttl(),
        lease.valid_until(),
    )
}
