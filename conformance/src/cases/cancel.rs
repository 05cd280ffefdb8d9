//! Cases on cancellation: every public async call of a backend and of [`Locker`] dropped
//! after its 1st, 2nd, 3rd … poll, until a run completes, and a backend shared by two
//! tokio runtimes, one of which shuts down in the middle of a call.
//!
//! A call is polled by hand with a pause between polls, so its I/O moves on between
//! them: the cut points fall before anything is sent, after a request went out, and
//! after its reply came back. After each cut ([`after_the_cut`]):
//! - no key is held by nobody for longer than its TTL: another client takes it by the
//!   TTL plus the suite's expiry slack, counted from the cut;
//! - the backend serves the next call: an acquire and release of another key works
//!   within a bound (a hang or an error fails);
//! - no connection still holds a lock behind the caller's back (a session lock left on a
//!   pooled connection): while another client holds the key the first client never gets
//!   it, and once that client releases it the first client gets it every time, round
//!   after round, whichever pooled connection serves it.
//!
//! Here: the cut and the checks after it. The cases: `backend_calls` (the
//! [`LockBackend`] calls), `locker_calls` (the [`Locker`] calls) and `two_runtimes`.
//!
//! [`Locker`]: distlock_core::Locker

mod backend_calls;
mod locker_calls;
mod two_runtimes;

pub use backend_calls::*;
pub use locker_calls::*;
pub use two_runtimes::*;

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockKey, Renewal};
use tokio::time::{Instant, sleep, timeout};

use super::release_held;
use crate::history::{Op, Reply};
use crate::support::{Ctx, Failure, Outcome, Timing};

/// The pause between two polls of a call: long enough for a reply to arrive.
pub(super) const BETWEEN_POLLS: Duration = Duration::from_millis(2);

/// A call that needs more polls than this to complete is stuck.
pub(super) const MAX_POLLS: usize = 500;

/// How many keys the batch forms are given: two, so a backend that pins a connection per
/// lease has room for the other client's leases and the probe in a small pool.
const BATCH: usize = 2;

/// How many rounds the first client tries a key another client holds, and then takes and
/// releases it: more than the connections of a small pool, so each of them serves one.
const ROUNDS: usize = 6;

/// The bound on the next call after a cut (an acquire and release of another key): far
/// above a round trip, to tell a backend that hangs or waits out a timeout.
fn served_within(t: &Timing) -> Duration {
    t.ttl * 2 + Duration::from_secs(2)
}

/// Polls `call` at most `polls` times, with [`BETWEEN_POLLS`] between polls, and drops it
/// there; its output if it completed by then.
pub(super) async fn cut_after<F: Future>(call: F, polls: usize) -> Option<F::Output> {
    let mut call = std::pin::pin!(call);
    for polled in 0..polls {
        if polled > 0 {
            sleep(BETWEEN_POLLS).await;
        }
        if let Poll::Ready(output) = futures::poll!(call.as_mut()) {
            return Some(output);
        }
    }
    None
}

/// The failure of a call that never completed.
pub(super) fn never_completed(ctx: &Ctx<'_>, what: &str) -> Failure {
    ctx.fail(
        format!("{what} to complete within {MAX_POLLS} polls"),
        "still pending",
    )
}

/// Runs `round` on `count` fresh keys with the call `what` dropped after 1, 2, 3 …
/// polls, until a round's call completed (`round` says so): then the case checks its
/// history and passes. A call still pending after [`MAX_POLLS`] fails the case.
async fn each_cut<Round>(
    ctx: &Ctx<'_>,
    t: &Timing,
    what: &str,
    count: usize,
    mut round: impl FnMut(usize, Vec<LockKey>) -> Round,
) -> Result<Outcome, Failure>
where
    Round: Future<Output = Result<bool, Failure>>,
{
    for polls in 1..=MAX_POLLS {
        if round(polls, cut_keys(ctx, polls, count)?).await? {
            return ctx.pass(t);
        }
    }
    Err(never_completed(ctx, what))
}

/// What every cut case starts from: `first`, whose calls are cut, `other`, which takes
/// the keys after a cut, the timing and the probe key.
struct Clients {
    t: Timing,
    first: Arc<dyn LockBackend>,
    other: Arc<dyn LockBackend>,
    probe: LockKey,
}

impl Clients {
    async fn new(ctx: &Ctx<'_>) -> Result<Self, Failure> {
        let (first, other) = (ctx.client().await, ctx.client().await);
        let t = ctx.timing(&first);
        let probe = ctx.key("probe")?;
        Ok(Clients {
            t,
            first,
            other,
            probe,
        })
    }

    /// [`after_the_cut`] of `what`, dropped at `cut`, on `first`.
    async fn after_the_cut(
        &self,
        ctx: &Ctx<'_>,
        keys: &[LockKey],
        cut: Instant,
        what: &str,
    ) -> Result<(), Failure> {
        after_the_cut(
            ctx,
            &self.t,
            &self.first,
            &self.other,
            &self.probe,
            keys,
            cut,
            what,
        )
        .await
    }

    /// `first` takes each of `keys`.
    async fn take_all(&self, ctx: &Ctx<'_>, keys: &[LockKey]) -> Result<Vec<Lease>, Failure> {
        let mut leases = Vec::with_capacity(keys.len());
        for key in keys {
            leases.push(ctx.take(&self.first, key, self.t.ttl).await?);
        }
        Ok(leases)
    }
}

/// The keys of the cut after `polls` polls.
fn cut_keys(ctx: &Ctx<'_>, polls: usize, count: usize) -> Result<Vec<LockKey>, Failure> {
    (0..count)
        .map(|i| ctx.key(&format!("cut-{polls}-{i}")))
        .collect()
}

/// Records that the owner gave up the newest grant of `key` at `at` without a release the
/// history shows (a `with_lock` or guard release dropped before its release call was
/// made, a runtime shut down mid-call): its validity window ends there, so the checker
/// does not take a later holder for an overlap. A release call that was made and then
/// dropped needs none: the history keeps it as unfinished.
fn record_given_up(ctx: &Ctx<'_>, key: &LockKey, at: Instant, what: &str) {
    if let Some(grant) = ctx.history().grants(key).last() {
        ctx.history().record(
            Op::Release,
            key,
            grant.owner,
            grant.token,
            grant.ttl,
            at,
            None,
            Reply::Error(format!("{what} dropped before it completed")),
        );
    }
}

/// An acquire and release of `probe` on `client`, within [`served_within`].
async fn serves(
    ctx: &Ctx<'_>,
    t: &Timing,
    client: &Arc<dyn LockBackend>,
    probe: &LockKey,
    what: &str,
) -> Result<(), Failure> {
    let bound = served_within(t);
    let cycle = async {
        // Held past any slow reply, so the release finds it: whether a lease runs out is
        // not what this checks.
        let lease = ctx.take(client, probe, t.long_ttl).await?;
        release_held(ctx, client, &lease).await
    };
    match timeout(bound, cycle).await {
        Ok(result) => result,
        Err(_) => Err(ctx.fail(
            format!("an acquire and release of another key within {bound:?} after {what}"),
            "still pending",
        )),
    }
}

/// The checks after `what` was dropped at `cut`, having touched `keys`: `other` takes
/// every key by the TTL plus slack while `first` keeps serving an acquire and release of
/// `probe`; then `first` never gets a key `other` holds, and gets each one every round
/// after `other` released it.
#[allow(clippy::too_many_arguments)]
async fn after_the_cut(
    ctx: &Ctx<'_>,
    t: &Timing,
    first: &Arc<dyn LockBackend>,
    other: &Arc<dyn LockBackend>,
    probe: &LockKey,
    keys: &[LockKey],
    cut: Instant,
    what: &str,
) -> Result<(), Failure> {
    let deadline = t.expired_by(cut);
    // The other client holds for long, so its leases never run out during the checks on a
    // slow machine (an advisory lock's session ends after a TTL idle, and the first
    // client's next acquire may open a new connection first). What it waits for is still
    // bounded by the TTL of whatever the cut left.
    let long_ttl = t.long_ttl;
    // All keys are taken in one round, so none of the other client's leases runs out
    // while it waits for the rest.
    let taken = loop {
        serves(ctx, t, first, probe, what).await?;
        let mut taken = Vec::with_capacity(keys.len());
        // When the refused acquire was sent: a refusal only shows the key held past the
        // deadline if the store was asked after it. A reply that a loaded machine
        // delivered after the deadline to a question asked before it shows nothing.
        let mut refused_at = None;
        for key in keys {
            let sent = Instant::now();
            match ctx.ok("acquire", other.acquire(key, long_ttl).await)? {
                Some(lease) => taken.push(lease),
                None => {
                    refused_at = Some(sent);
                    break;
                }
            }
        }
        let Some(refused_at) = refused_at else {
            break taken;
        };
        let key = &keys[taken.len()];
        for lease in &taken {
            release_held(ctx, other, lease).await?;
        }
        if refused_at >= deadline {
            return Err(ctx.fail(
                format!(
                    "{key} free by its TTL plus {:?} after {what} (nobody holds it longer)",
                    t.expiry_slack
                ),
                format!(
                    "still held when asked {:?} after the cut",
                    refused_at.saturating_duration_since(cut)
                ),
            ));
        }
        sleep(Duration::from_millis(10)).await;
    };
    for _ in 0..ROUNDS {
        for key in keys {
            ctx.expect_held(first, key, t.ttl, "another client took it after the cut")
                .await?;
        }
        // Renewed each round, so the other client holds them however slow the rounds are.
        for lease in &taken {
            let renewed = ctx.ok("renew", other.renew(lease).await)?;
            ctx.ensure(
                matches!(renewed, Renewal::Renewed { .. }),
                "the other client's renewal of its lease to be Renewed",
                || format!("{renewed:?}"),
            )?;
        }
    }
    for lease in &taken {
        release_held(ctx, other, lease).await?;
    }
    for _ in 0..ROUNDS {
        for key in keys {
            // The long TTL: at load 17 a grant of the short one came back 724 ms after it
            // was asked for, past its validity, and its release was rightly NotHeld.
            let lease = ctx.take(first, key, long_ttl).await?;
            release_held(ctx, first, &lease).await?;
        }
    }
    Ok(())
}
