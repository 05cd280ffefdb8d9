//! Cases on faults of the store's server: a restart (with or without the store's data),
//! a pause past the TTL, the clients' sessions ended by the server, and a node failed
//! over or switched over to its replica. Each checks what a holder caught by the fault
//! may still do: its late write is rejected once a newer holder wrote, its lease is never
//! renewed over the new holder, and tokens keep increasing.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Fence, Lease, LockBackend, LockError, LockKey, Renewal};
use tokio::time::{Instant, sleep, sleep_until};

use super::{late_write_rejected, release_held, stale_value, token_above};
use crate::factory::Factory;
use crate::history::FencedCounter;
use crate::support::{Ctx, Failure, Outcome, Timing, fit_ttl};

/// How long after a server fault ends a client may keep failing while it reconnects (and
/// a 3-member store elects a leader).
pub(super) const RECOVERY_GRACE: Duration = Duration::from_secs(10);

/// A holder whose server was killed and started again is fenced once another client
/// takes the key, whether the restart kept the store's data or lost it: the new grant
/// carries a higher token, the old holder's late write is rejected after the new
/// holder's, its renewal is Lost and its fence Stale.
pub async fn restart_leaves_old_holder_fenced(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new("restart_leaves_old_holder_fenced", factory);
    let server = ctx.server()?;
    // Calls that fail around the restart may have reached the store.
    ctx.with_faults();
    // The workload's store is not the one restarted: a store restarted without
    // persistence (as users run Redis for locks only) loses the values written to it, and
    // what this case shows is the lock's fencing across the restart.
    let counter = ctx.counter_in_memory();
    let h = holder_wrote(&ctx, counter, "the holder's write before the restart").await?;

    server.kill().await;
    server.restart().await;

    // A store that kept its data frees the key when the old lease runs out; one that lost
    // it frees the key at once.
    let deadline = Instant::now() + RECOVERY_GRACE + h.t.ttl;
    let new = take_after_fault(&ctx, &h.b, &h.key, &h.t, deadline, "after the restart").await?;
    h.fenced_by(&ctx, &new).await
}

/// A holder whose session the server ended (PostgreSQL's `pg_terminate_backend`, with
/// every session-level lock it held) is fenced once another client takes the key: the
/// new grant carries a higher token, the old holder's late write is rejected after the new
/// holder's, its renewal is Lost and its fence Stale.
pub async fn terminated_sessions_leave_old_holder_fenced(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new("terminated_sessions_leave_old_holder_fenced", factory);
    let sessions = ctx.sessions()?;
    // Calls that fail as their session ends may have reached the store.
    ctx.with_faults();
    let h = holder_wrote(
        &ctx,
        ctx.counter(),
        "the holder's write before the sessions end",
    )
    .await?;

    sessions.terminate().await;

    // A session-level lock is gone with its session; a lease row stays until it runs out.
    let deadline = Instant::now() + RECOVERY_GRACE + h.t.ttl;
    let new = take_after_fault(
        &ctx,
        &h.b,
        &h.key,
        &h.t,
        deadline,
        "after the sessions ended",
    )
    .await?;
    h.fenced_by(&ctx, &new).await
}

/// A holder frozen together with its server past its TTL (the server SIGSTOPped, the
/// holder making no call) never overlaps the next holder: a client that asks for the key
/// during the pause is granted it only after the old lease ran out, with a higher token,
/// and the old holder's late write, renewal and fence check all fail.
///
/// The history is checked without the fault allowance: no call of the old holder was in
/// flight during the pause, so nothing can have extended its lease unseen.
pub async fn server_paused_past_ttl_keeps_holders_apart(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("server_paused_past_ttl_keeps_holders_apart", factory);
    let server = ctx.server()?;
    let h = holder_wrote(&ctx, ctx.counter(), "the holder's write before the pause").await?;

    server.pause().await;
    // The contender asks while the server is frozen and the old lease is still valid.
    let contender = {
        let (b, key, ttl) = (h.b.clone(), h.key.clone(), h.t.ttl);
        tokio::spawn(async move { b.acquire(&key, ttl).await })
    };
    sleep_until(h.t.expired_by(h.granted)).await;
    server.resume().await;
    let asked_in_pause = contender
        .await
        .map_err(|e| ctx.fail("the contender's acquire to finish", e))?;

    let new = match asked_in_pause {
        Ok(Some(lease)) => lease,
        // Busy (the store had not expired the old lease yet) or an error (the call timed
        // out in the pause): ask again.
        Ok(None) | Err(_) => {
            let deadline = Instant::now() + RECOVERY_GRACE;
            take_after_fault(&ctx, &h.b, &h.key, &h.t, deadline, "after the pause").await?
        }
    };
    h.fenced_by(&ctx, &new).await
}

/// What the fault cases start from: two clients, the timing, a fenced counter, and the
/// lease `old` of key `k` granted to `a` at `granted`, whose write through the counter
/// was admitted; `read` is the counter read after that write.
struct Holder {
    a: Arc<dyn LockBackend>,
    b: Arc<dyn LockBackend>,
    t: Timing,
    key: LockKey,
    counter: FencedCounter,
    old: Lease,
    granted: Instant,
    read: u64,
}

/// [`Holder`]: `a` takes key `k` and writes through `counter` (`what`).
async fn holder_wrote(
    ctx: &Ctx<'_>,
    counter: FencedCounter,
    what: &str,
) -> Result<Holder, Failure> {
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let old = ctx.take(&a, &key, t.ttl).await?;
    let granted = Instant::now();
    write_admitted(ctx, &counter, &key, &old, what).await?;
    let read = ctx.ok("read the counter", counter.read(&key).await)?;
    Ok(Holder {
        a,
        b,
        t,
        key,
        counter,
        old,
        granted,
        read,
    })
}

impl Holder {
    /// After `new` was granted to `b` over the faulted holder: [`old_holder_fenced`];
    /// then `b` releases it and the case passes.
    async fn fenced_by(&self, ctx: &Ctx<'_>, new: &Lease) -> Result<Outcome, Failure> {
        old_holder_fenced(
            ctx,
            &self.counter,
            &self.a,
            &self.old,
            &self.b,
            new,
            self.read,
        )
        .await?;
        release_held(ctx, &self.b, new).await?;
        ctx.pass(&self.t)
    }
}

/// The TTL of the fail-over and switchover cases: longer than the store takes to notice a
/// dead node and promote its replica, so the lease outlives the hand-over.
const FAILOVER_TTL: Duration = Duration::from_secs(20);

/// A lease whose node is failed over to its replica (the node killed, the map of which
/// node serves the key changing under the live lease) is renewed again, single and
/// batched, before its validity runs out; meanwhile it excludes other clients, and after
/// its release the next grant carries a higher token.
pub async fn failover_keeps_live_leases(factory: &dyn Factory) -> Result<Outcome, Failure> {
    keeps_live_leases(factory, Handover::FailOver).await
}

/// As [`failover_keeps_live_leases`], for a switchover: the node hands the key over to
/// its replica and runs on as a replica of it, so a client still connected to it reaches
/// a live node that no longer takes writes (and must follow the new one, not fail there).
pub async fn switchover_keeps_live_leases(factory: &dyn Factory) -> Result<Outcome, Failure> {
    keeps_live_leases(factory, Handover::SwitchOver).await
}

/// How the node of the key is handed over to its replica.
#[derive(Clone, Copy)]
enum Handover {
    /// [`Failover::fail_over`](crate::factory::Failover::fail_over): the node killed.
    FailOver,
    /// [`Failover::switch_over`](crate::factory::Failover::switch_over): the node demoted.
    SwitchOver,
}

impl Handover {
    fn case(self) -> &'static str {
        match self {
            Handover::FailOver => "failover_keeps_live_leases",
            Handover::SwitchOver => "switchover_keeps_live_leases",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Handover::FailOver => "fail-over",
            Handover::SwitchOver => "switchover",
        }
    }
}

/// [`failover_keeps_live_leases`] or [`switchover_keeps_live_leases`], by `how`.
async fn keeps_live_leases(factory: &dyn Factory, how: Handover) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new(how.case(), factory);
    let failover = ctx.failover()?;
    // Renewals sent while the node is down or handing over may have reached it.
    ctx.with_faults();
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let ttl = fit_ttl(&a.capabilities(), FAILOVER_TTL);
    let key = ctx.key("k")?;
    let lease = ctx.take(&a, &key, ttl).await?;
    let what = how.what();
    // The clients learn where the key lives before the hand-over, on every path: the
    // single calls and the batches (a client may route them by a map of its own, which
    // the hand-over makes wrong).
    ctx.expect_held(&b, &key, ttl, "just granted").await?;
    let before = ctx.ok(
        &format!("renew_many before the {what}"),
        a.renew_many(std::slice::from_ref(&lease)).await,
    )?;
    ctx.ensure(
        matches!(before.as_slice(), [Renewal::Renewed { .. }]),
        format!("the lease to renew in a batch before the {what}"),
        || format!("{before:?}"),
    )?;

    match how {
        Handover::FailOver => failover.fail_over(&key).await,
        Handover::SwitchOver => failover.switch_over(&key).await,
    }

    // Until the clients learn the new map, a call may fail or find the part of the
    // store that keeps the lease unreachable; each form must renew it again before its
    // validity runs out.
    let valid_until = lease.valid_until();
    let single = || async { a.renew(&lease).await };
    renewed_again(&ctx, "renew", what, valid_until, single).await?;
    let batched = || async {
        let batch = a.renew_many(std::slice::from_ref(&lease)).await?;
        match batch.as_slice() {
            [renewal] => Ok(*renewal),
            _ => Ok(Renewal::Lost),
        }
    };
    renewed_again(&ctx, "renew_many", what, valid_until, batched).await?;
    ctx.expect_held(&b, &key, ttl, &format!("renewed after the {what}"))
        .await?;
    release_held(&ctx, &a, &lease).await?;
    let next = ctx.take(&b, &key, t.ttl).await?;
    token_above(
        &ctx,
        &next,
        lease.token(),
        format!("a token above {} after the {what}", lease.token()),
    )?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// Retries `renew` (a single or a one-lease batch renewal) while it fails or finds the
/// lease's node unreachable, until it renews; fails if it says `Lost` (or the batch
/// answered for other than one lease), or if `valid_until` passes first. `after` names
/// the hand-over in messages.
async fn renewed_again<F, Fut>(
    ctx: &Ctx<'_>,
    what: &str,
    after: &str,
    valid_until: Instant,
    mut renew: F,
) -> Result<(), Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Renewal, LockError>>,
{
    loop {
        let failing = match renew().await {
            Ok(Renewal::Renewed { .. }) => return Ok(()),
            Ok(Renewal::Unreachable) => "its node unreachable".to_owned(),
            Ok(other) => {
                return Err(ctx.fail(
                    format!("the live lease to {what} after the {after}"),
                    format!("{other:?}"),
                ));
            }
            Err(e) => format!("error: {e}"),
        };
        if Instant::now() >= valid_until {
            return Err(ctx.fail(
                format!("the live lease to {what} after the {after}, within its validity"),
                format!("still failing at its end: {failing}"),
            ));
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// The first answer of `call`, retried while it fails with an error until `deadline`
/// (clients reconnect after a server fault).
pub(super) async fn until_answered<T, F, Fut>(
    ctx: &Ctx<'_>,
    what: &str,
    deadline: Instant,
    mut call: F,
) -> Result<T, Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    loop {
        match call().await {
            Ok(answer) => return Ok(answer),
            Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(50)).await,
            Err(e) => {
                return Err(ctx.fail(
                    format!("{what} to be answered by {deadline:?}"),
                    format!("error: {e}"),
                ));
            }
        }
    }
}

/// How many of the case's TTLs the holder taken after a fault asks for.
const NEW_HOLDER_TTL_FACTOR: u32 = 4;

/// Polls until `client` is granted `key`, tolerating errors, failing at `deadline`.
async fn take_after_fault(
    ctx: &Ctx<'_>,
    client: &Arc<dyn LockBackend>,
    key: &LockKey,
    t: &Timing,
    deadline: Instant,
    why: &str,
) -> Result<Lease, Failure> {
    let what = format!("an acquire of {key} {why}");
    // The new holder outlives the checks that follow (the old holder's late write, renewal
    // and fence, each retried while the store recovers) even on a slow machine: the case
    // is about the old lease, and the new one must still be Current at its end.
    let ttl = NEW_HOLDER_TTL_FACTOR * t.ttl;
    loop {
        let got = until_answered(ctx, &what, deadline, || client.acquire(key, ttl)).await?;
        if let Some(lease) = got {
            return Ok(lease);
        }
        if Instant::now() >= deadline {
            return Err(ctx.fail(
                format!("{key} to be free {why} by {deadline:?}"),
                "still held",
            ));
        }
        sleep(Duration::from_millis(20)).await;
    }
}

/// Writes through `counter` with `lease`'s token what it read plus one; the write must be
/// admitted. Errors are retried: the resource may be reconnecting after a fault.
async fn write_admitted(
    ctx: &Ctx<'_>,
    counter: &FencedCounter,
    key: &LockKey,
    lease: &Lease,
    what: &str,
) -> Result<(), Failure> {
    let deadline = Instant::now() + RECOVERY_GRACE;
    let read = until_answered(ctx, "read the counter", deadline, || counter.read(key)).await?;
    let admission = until_answered(ctx, what, deadline, || {
        counter.write(key, lease.token(), read, read + 1)
    })
    .await?;
    ctx.ensure(
        admission.is_admitted(),
        format!("{what} (token {}) to be admitted", lease.token()),
        || format!("{admission:?}"),
    )
}

/// After `new` was granted to `b` over the faulted holder `old` of `a` (which read `read`
/// before the fault): tokens increased, the new holder's write is admitted and the old
/// holder's late one rejected, the old lease renews as Lost and fences as Stale, and the
/// new holder is untouched.
async fn old_holder_fenced(
    ctx: &Ctx<'_>,
    counter: &FencedCounter,
    a: &Arc<dyn LockBackend>,
    old: &Lease,
    b: &Arc<dyn LockBackend>,
    new: &Lease,
    read: u64,
) -> Result<(), Failure> {
    token_above(
        ctx,
        new,
        old.token(),
        format!("the new holder's token above the old {}", old.token()),
    )?;
    write_admitted(ctx, counter, new.key(), new, "the new holder's write").await?;
    let deadline = Instant::now() + RECOVERY_GRACE;
    let late = until_answered(ctx, "the old holder's late write", deadline, || {
        counter.write(old.key(), old.token(), read, stale_value(read))
    })
    .await?;
    late_write_rejected(ctx, counter, late, "the old holder", old, new).await?;
    let renewal =
        until_answered(ctx, "the old holder's renewal", deadline, || a.renew(old)).await?;
    ctx.ensure(
        renewal == Renewal::Lost,
        "the old holder's renewal to be Lost",
        || format!("{renewal:?}"),
    )?;
    let fence = until_answered(ctx, "the old holder's fence", deadline, || a.fence(old)).await?;
    ctx.ensure(
        matches!(fence, Fence::Stale { current } if current >= new.token()),
        format!(
            "the old holder's lease to be Stale with a current token >= {}",
            new.token()
        ),
        || format!("{fence:?}"),
    )?;
    let fence = ctx.ok("fence of the new holder", b.fence(new).await)?;
    ctx.ensure(
        fence == Fence::Current,
        "the new holder to stay Current",
        || format!("{fence:?}"),
    )
}
