//! Cases on the semaphore calls beyond one permit at a time: a permit wait dropped or
//! timed out while its attempt is in flight gives back what it took, on every backend,
//! and k permits are granted all or none, never more than the semaphore has in total.
//!
//! The waiters here hold their permits with the long TTL (20 TTLs, at least 10 s): a slot
//! an abandoned attempt left held would stay held that long, where one given back is free
//! again after a release's round trip; the cases allow [`given_back_within`] for that,
//! far less. Where the factory can delay the link ([`Factory::link`]), the waiter's
//! attempt runs with every request and reply delayed by [`ON_ITS_WAY`], so that many cut
//! points fall after the store granted a slot and before its reply came back (on a
//! loopback link that window is a fraction of a poll); the delay is lifted before the
//! checks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockError, Locker, RetryPolicy, Semaphore};
use tokio::time::{Instant, sleep};

use super::cancel::{BETWEEN_POLLS, MAX_POLLS, cut_after, never_completed};
use super::locker::{GENEROUS_WAIT, locker, locker_on};
use super::release_held;
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing, fit_ttl};

/// The link delay each way while the waiter's attempt is cut, where the factory has one.
const ON_ITS_WAY: Duration = Duration::from_millis(20);

/// The waiters' retries: a wait polls every 5 ms at first, growing to 20 ms.
const WAITER_RETRIES: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(5),
    max: Duration::from_millis(20),
};

/// Delays the link by [`ON_ITS_WAY`], where the factory can.
async fn slow_link(ctx: &Ctx<'_>) {
    if let Some(link) = ctx.factory().link() {
        link.delay(ON_ITS_WAY).await;
    }
}

/// Lifts [`slow_link`]'s delay.
async fn heal_link(ctx: &Ctx<'_>) {
    if let Some(link) = ctx.factory().link() {
        link.heal().await;
    }
}

/// How long after an attempt was abandoned a slot it took may stay held: its release's
/// round trips, with room for a loaded machine (2 TTLs plus 2 s), and well under the
/// long TTL the waiters hold with (at least 20 TTLs and 10 s).
fn given_back_within(t: &Timing) -> Duration {
    t.ttl * 2 + Duration::from_secs(2)
}

/// A locker on `client` whose leases last the long TTL, with [`WAITER_RETRIES`] and the
/// suite's 60 s wait timeout.
fn long_lease_locker(
    ctx: &Ctx<'_>,
    client: Arc<dyn LockBackend>,
    t: &Timing,
) -> Result<Locker, Failure> {
    locker_on(ctx, client, t.long_ttl, WAITER_RETRIES, Some(GENEROUS_WAIT))
}

/// `holder` takes every slot of `semaphore`, for longer than any case lasts.
///
/// The holder keeps its leases through the whole case, however long the load makes it:
/// with the long TTL (20 s on etcd) `timed_out_permit_acquire_leaves_no_permit_held`
/// took 50 s on a three-member etcd cluster beside two CPU-bound processes (its cut
/// waits, up to [`MAX_POLLS`], each check the freed slot), and the release of a held lease
/// at its end found it `NotHeld`: run out, 20 s after it was taken. So they last 30 long
/// TTLs.
async fn fill(
    ctx: &Ctx<'_>,
    holder: &Arc<dyn LockBackend>,
    semaphore: &Semaphore,
    t: &Timing,
) -> Result<Vec<Lease>, Failure> {
    let ttl = fit_ttl(&holder.capabilities(), t.long_ttl * 30);
    let mut held = Vec::new();
    for _ in semaphore.slots() {
        let lease = ctx.ok(
            "acquire_any",
            holder.acquire_any(semaphore.slots(), ttl).await,
        )?;
        held.push(
            lease.ok_or_else(|| {
                ctx.fail("acquire_any of a free slot to grant a lease", "Ok(None)")
            })?,
        );
    }
    Ok(held)
}

/// After a permit wait was abandoned at `cut`: its locker renews nothing, and the slot
/// `freed` (the one the holder released for it) is free again by
/// [`given_back_within`], taken and released by `other`.
async fn nothing_left_held(
    ctx: &Ctx<'_>,
    t: &Timing,
    waiter: &Locker,
    other: &Arc<dyn LockBackend>,
    freed: &Lease,
    cut: Instant,
    what: &str,
) -> Result<(), Failure> {
    ctx.ensure(
        waiter.held() == 0,
        format!("the waiter's watchdog to renew no permit after {what}"),
        || format!("{} renewed", waiter.held()),
    )?;
    let bound = given_back_within(t);
    let why = format!(
        "within {bound:?} after {what} (the waiter holds permits for {:?})",
        t.long_ttl
    );
    let lease = ctx
        .take_by(other, freed.key(), t.long_ttl, cut + bound, &why)
        .await?;
    release_held(ctx, other, &lease).await
}

/// A waiter in `Semaphore::acquire` on a full semaphore; one permit is released, and the
/// wait is dropped after 1, 2, 3 … more polls, until a run completes: whatever its
/// attempt in flight took is given back at once (by `given_back_within`, not by its
/// long TTL), and its watchdog renews nothing.
pub async fn dropped_permit_acquire_mid_wait_leaves_no_permit_held(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new(
        "dropped_permit_acquire_mid_wait_leaves_no_permit_held",
        factory,
    );
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let other = ctx.client().await;
    let waiter = long_lease_locker(&ctx, ctx.client().await, &t)?;
    for polls in 1..=MAX_POLLS {
        let semaphore = ctx.semaphore(&waiter, &format!("mid-wait-{polls}"), 2)?;
        let held = fill(&ctx, &holder, &semaphore, &t).await?;
        // Boxed, so that the cut drops the wait itself, not a pin of it.
        let mut acquire = Box::pin(semaphore.acquire());
        // Mid-wait: its first attempt was refused (the semaphore is full).
        let started = Instant::now();
        while !refused(&ctx, &semaphore) {
            if futures::poll!(acquire.as_mut()).is_ready() {
                return Err(ctx.fail("acquire of a full semaphore to wait", "it returned"));
            }
            if started.elapsed() >= given_back_within(&t) {
                return Err(ctx.fail(
                    "the waiter's first attempt to be refused",
                    "no refused attempt recorded",
                ));
            }
            sleep(BETWEEN_POLLS).await;
        }
        release_held(&ctx, &holder, &held[1]).await?;
        slow_link(&ctx).await;
        let outcome = cut_after(acquire, polls).await;
        let cut = Instant::now();
        heal_link(&ctx).await;
        let what = format!("a permit wait dropped {polls} poll(s) after a permit was freed");
        match outcome {
            Some(permit) => {
                let permit = ctx.ok("Semaphore::acquire", permit)?;
                super::guard_released(&ctx, permit.release().await)?;
                release_held(&ctx, &holder, &held[0]).await?;
                return ctx.pass(&t);
            }
            None => {
                nothing_left_held(&ctx, &t, &waiter, &other, &held[1], cut, &what).await?;
                release_held(&ctx, &holder, &held[0]).await?;
            }
        }
    }
    Err(never_completed(&ctx, "Semaphore::acquire"))
}

/// `Semaphore::acquire_timeout` on a full semaphore times out with `Timeout` naming it
/// after its own wait (the locker's is 60 s); then, with one permit free, waits of 1, 2,
/// 3 … ms time out with their attempt in flight until one is granted: each that timed
/// out gives back what it took (by `given_back_within`, not by its long TTL).
pub async fn timed_out_permit_acquire_leaves_no_permit_held(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    const WAIT: Duration = Duration::from_millis(300);
    let ctx = Ctx::new("timed_out_permit_acquire_leaves_no_permit_held", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let other = ctx.client().await;
    let waiter = long_lease_locker(&ctx, ctx.client().await, &t)?;
    let semaphore = ctx.semaphore(&waiter, "timed-out", 2)?;
    let held = fill(&ctx, &holder, &semaphore, &t).await?;
    let started = Instant::now();
    let waited = semaphore.acquire_timeout(WAIT).await;
    let took = started.elapsed();
    match waited {
        Err(LockError::Timeout { key, .. }) if &key == semaphore.name() && took >= WAIT => {}
        got => {
            return Err(ctx.fail(
                format!(
                    "acquire_timeout({WAIT:?}) of a full semaphore to fail with Timeout naming it, \
                     no sooner than {WAIT:?}"
                ),
                format!("{got:?} after {took:?}"),
            ));
        }
    }
    release_held(&ctx, &holder, &held[1]).await?;
    for ms in 1..=u64::try_from(MAX_POLLS).unwrap_or(u64::MAX) {
        let wait = Duration::from_millis(ms);
        slow_link(&ctx).await;
        let waited = semaphore.acquire_timeout(wait).await;
        let cut = Instant::now();
        heal_link(&ctx).await;
        match waited {
            Ok(permit) => {
                super::guard_released(&ctx, permit.release().await)?;
                release_held(&ctx, &holder, &held[0]).await?;
                return ctx.pass(&t);
            }
            Err(LockError::Timeout { .. }) => {
                let what = format!("a permit wait that timed out after {wait:?}");
                nothing_left_held(&ctx, &t, &waiter, &other, &held[1], cut, &what).await?;
            }
            Err(error) => {
                return Err(ctx.fail(
                    format!(
                        "acquire_timeout({wait:?}) with a permit free to end in a permit or Timeout"
                    ),
                    error,
                ));
            }
        }
    }
    Err(never_completed(&ctx, "Semaphore::acquire_timeout"))
}

/// Whether the history shows an acquire of one of `semaphore`'s slots refused.
fn refused(ctx: &Ctx<'_>, semaphore: &Semaphore) -> bool {
    use crate::history::{Op, Reply};
    ctx.history().events().iter().any(|e| {
        e.op == Op::Acquire && e.reply == Reply::Busy && semaphore.slots().contains(&e.key)
    })
}

/// k permits at once, all or none: `try_acquire_many` of more than are free is `None` and
/// leaves the free ones free; then workers on their own clients take 1 or 2 of 3
/// permits at a time with `acquire_many`, in a loop: every grant is k permits on k
/// different slots, and never more than 3 are held at once (counted in the process and
/// by the checker, I6).
pub async fn semaphore_grants_many_permits_all_or_none(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    const PERMITS: u32 = 3;
    const WORKERS: usize = 4;
    const ROUNDS: usize = 4;
    let ctx = Ctx::new("semaphore_grants_many_permits_all_or_none", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let asker = locker(&ctx, ctx.client().await, &t)?;
    let semaphore = ctx.semaphore(&asker, "many", PERMITS)?;
    let held = ctx.ok(
        "acquire_any",
        holder.acquire_any(semaphore.slots(), t.long_ttl).await,
    )?;
    let held = held.ok_or_else(|| ctx.fail("acquire_any of a free slot", "Ok(None)"))?;
    let refused = ctx.ok("try_acquire_many(3)", semaphore.try_acquire_many(3).await)?;
    if let Some(permits) = refused {
        let got = format!("permits on slots {:?}", permits.slots());
        drop(permits);
        return Err(ctx.fail(
            "try_acquire_many(3) with 2 of 3 free to return Ok(None)",
            got,
        ));
    }
    // All or none: the two free permits are still free, both of them.
    let two = ctx.ok("try_acquire_many(2)", semaphore.try_acquire_many(2).await)?;
    let two = two.ok_or_else(|| {
        ctx.fail(
            "try_acquire_many(2) right after a refused try_acquire_many(3) to find the 2 free permits",
            "Ok(None): the refused attempt left one held",
        )
    })?;
    ctx.ensure(
        two.len() == 2 && !two.iter().any(|p| p.key() == held.key()),
        "2 permits on the 2 slots the holder does not hold",
        || format!("{two:?}"),
    )?;
    for released in ctx.ok("Permits::release", two.release().await)? {
        super::guard_released(&ctx, Ok(released))?;
    }
    release_held(&ctx, &holder, &held).await?;

    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let semaphore = ctx.semaphore(&locker(&ctx, ctx.client().await, &t)?, "many", PERMITS)?;
        let (holding, most) = (holding.clone(), most.clone());
        workers.push(tokio::spawn(async move {
            let mut partial = Vec::new();
            for round in 0..ROUNDS {
                let k = 1 + u32::try_from((worker + round) % 2).unwrap_or_default();
                let permits = semaphore.acquire_many(k).await?;
                let now = holding.fetch_add(permits.len(), Ordering::SeqCst) + permits.len();
                most.fetch_max(now, Ordering::SeqCst);
                let mut slots = permits.slots();
                slots.sort_unstable();
                slots.dedup();
                if slots.len() != k as usize {
                    partial.push(format!("{k} asked, slots {:?}", permits.slots()));
                }
                sleep(Duration::from_millis(5)).await;
                holding.fetch_sub(permits.len(), Ordering::SeqCst);
                permits.release().await?;
                // Room between rounds, so that two permits come free together.
                sleep(Duration::from_millis(rand::random_range(0..20))).await;
            }
            Ok::<_, LockError>(partial)
        }));
    }
    let mut partial = Vec::new();
    for worker in workers {
        let ran = worker
            .await
            .map_err(|e| ctx.fail("a worker to finish", e))?;
        partial.extend(ctx.ok("a worker's acquire_many and release", ran)?);
    }
    ctx.ensure(
        partial.is_empty(),
        "every grant of acquire_many(k) to be k permits on k different slots",
        || partial.join("; "),
    )?;
    let most = most.load(Ordering::SeqCst);
    ctx.ensure(
        most <= PERMITS as usize,
        format!("at most {PERMITS} permits held at once"),
        || format!("{most} at once"),
    )?;
    ctx.pass(&t)
}
