//! Cases on semaphores ([`distlock_core::Semaphore`]): never more permits than it has,
//! whatever the contention, nor than the largest number processes name; a permit released only by its holder; an expired permit
//! freed; a freed permit waking a waiter. Each semaphore a case makes is declared to the
//! history checker, which counts its permits (I6).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::{Fence, LockError, Release, Renewal};
use tokio::time::{Instant, sleep};

use super::locker::locker;
use super::wake::{LONG_BACKOFF, WOKEN_WITHIN, waiting_locker};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing};

/// Permits of the semaphores the cases make: more than one, so a bug that counts one
/// permit as the whole semaphore shows.
const PERMITS: u32 = 3;

/// `try_acquire` from as many clients as there are permits takes every slot once; one
/// more is refused while they are held; then six workers on their own clients take and
/// give back permits in a loop, never more than three at once (counted in the process
/// and by the checker, I6).
pub async fn semaphore_never_grants_more_than_its_permits(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    const WORKERS: usize = 6;
    const ROUNDS: usize = 4;
    let ctx = Ctx::new("semaphore_never_grants_more_than_its_permits", factory);
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    let mut lockers = vec![locker(&ctx, first, &t)?];
    for _ in 1..=PERMITS {
        lockers.push(locker(&ctx, ctx.client().await, &t)?);
    }
    let mut permits = Vec::new();
    for locker in &lockers[..PERMITS as usize] {
        let semaphore = ctx.semaphore(locker, "limit", PERMITS)?;
        let permit = ctx.ok("try_acquire", semaphore.try_acquire().await)?;
        permits.push(permit.ok_or_else(|| {
            ctx.fail(
                format!(
                    "try_acquire to grant a permit while {} of {PERMITS} are held",
                    permits.len()
                ),
                "Ok(None)",
            )
        })?);
    }
    let mut slots: Vec<u32> = permits.iter().map(|p| p.slot()).collect();
    slots.sort_unstable();
    slots.dedup();
    ctx.ensure(
        slots.len() == PERMITS as usize,
        format!("{PERMITS} permits on {PERMITS} different slots"),
        || format!("slots {slots:?}"),
    )?;
    let full = ctx.semaphore(&lockers[PERMITS as usize], "limit", PERMITS)?;
    let extra = ctx.ok("try_acquire of a full semaphore", full.try_acquire().await)?;
    if let Some(extra) = extra {
        let got = format!(
            "a permit on slot {} with token {}",
            extra.slot(),
            extra.token()
        );
        drop(extra);
        return Err(ctx.fail(
            format!("try_acquire to find all {PERMITS} permits held and return Ok(None)"),
            got,
        ));
    }
    for permit in permits {
        super::guard_released(&ctx, permit.release().await)?;
    }

    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let semaphore = ctx.semaphore(&locker(&ctx, ctx.client().await, &t)?, "limit", PERMITS)?;
        let (holding, most) = (holding.clone(), most.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let permit = semaphore.acquire().await?;
                let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                sleep(Duration::from_millis(5)).await;
                holding.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, LockError>(())
        }));
    }
    for worker in workers {
        let ran = worker
            .await
            .map_err(|e| ctx.fail("a worker to finish", e))?;
        ctx.ok("a worker's acquire and release", ran)?;
    }
    let most = most.load(Ordering::SeqCst);
    ctx.ensure(
        most <= PERMITS as usize,
        format!("at most {PERMITS} workers holding a permit at once"),
        || format!("{most} at once"),
    )?;
    ctx.pass(&t)
}

/// Two processes that name different numbers of permits for one semaphore share the
/// slots both name (`Locker::semaphore` says so): one that names 1 takes slot 0 only, and
/// is refused while it is held though slots 1 and 2 are free; one that names 3 then takes
/// those two, and is refused. Then workers of both sizes take and give back permits in a
/// loop: never more than 3 held at once (in the process and by the checker, I6), and
/// never a slot past 0 for the one that names 1.
///
/// The permits last [`Timing::renewed_ttl`]: the refusals are checked while the permits
/// taken before them are held, after a client is made for each attempt, and with the
/// short TTL a loaded machine let the first permit run out before its renewal came (a
/// `lockctl check` on PostgreSQL beside the workspace's tests: the semaphore naming 1
/// was given slot 0 again, and the history showed no overlap).
pub async fn semaphores_naming_different_permits_share_their_slots(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    // At most 3 held at once: a PostgreSQL advisory client of the suite has 4 pooled
    // connections, one pinned per held lock, and an attempt needs one more.
    const SMALL: u32 = 1;
    const LARGE: u32 = 3;
    const WORKERS: usize = 3;
    const ROUNDS: usize = 3;
    let ctx = Ctx::new(
        "semaphores_naming_different_permits_share_their_slots",
        factory,
    );
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    let t = Timing {
        ttl: t.renewed_ttl,
        ..t
    };
    // Declared with the larger number: at most that many are ever held.
    let large = ctx.semaphore(&locker(&ctx, first, &t)?, "sized", LARGE)?;
    let name = large.name().clone();
    // One client per permit held, as in processes of their own.
    let mut held = Vec::new();
    for permits in [SMALL, LARGE] {
        while held.len() < permits as usize {
            let locker = locker(&ctx, ctx.client().await, &t)?;
            let semaphore = ctx.ok("Locker::semaphore", locker.semaphore(&name, permits))?;
            let permit = ctx.ok("try_acquire", semaphore.try_acquire().await)?;
            let permit = permit.ok_or_else(|| {
                ctx.fail(
                    format!(
                        "a permit of the semaphore naming {permits} while {} are held",
                        held.len()
                    ),
                    "Ok(None)",
                )
            })?;
            let slot = permit.slot();
            held.push(permit);
            ctx.ensure(
                slot < permits && (permits == SMALL || slot >= SMALL),
                format!("the semaphore naming {permits} to take a free slot of its own"),
                || format!("slot {slot}"),
            )?;
        }
        let locker = locker(&ctx, ctx.client().await, &t)?;
        let semaphore = ctx.ok("Locker::semaphore", locker.semaphore(&name, permits))?;
        let extra = ctx.ok("try_acquire", semaphore.try_acquire().await)?;
        if let Some(extra) = extra {
            let got = format!("a permit on slot {}", extra.slot());
            drop(extra);
            return Err(ctx.fail(
                format!("the semaphore naming {permits} to be refused while its slots are held"),
                got,
            ));
        }
    }
    for permit in held {
        super::guard_released(&ctx, permit.release().await)?;
    }

    let holding = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for worker in 0..2 * WORKERS {
        let locker = locker(&ctx, ctx.client().await, &t)?;
        let permits = if worker % 2 == 0 { SMALL } else { LARGE };
        let semaphore = ctx.ok("Locker::semaphore", locker.semaphore(&name, permits))?;
        let (holding, most) = (holding.clone(), most.clone());
        workers.push(tokio::spawn(async move {
            let mut outside = Vec::new();
            for _ in 0..ROUNDS {
                let permit = semaphore.acquire().await?;
                if permit.slot() >= permits {
                    outside.push(permit.slot());
                }
                let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                sleep(Duration::from_millis(5)).await;
                holding.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, LockError>((permits, outside))
        }));
    }
    for worker in workers {
        let ran = worker
            .await
            .map_err(|e| ctx.fail("a worker to finish", e))?;
        let (permits, outside) = ctx.ok("a worker's acquire and release", ran)?;
        ctx.ensure(
            outside.is_empty(),
            format!("a worker naming {permits} permits to hold slots below {permits} only"),
            || format!("slots {outside:?}"),
        )?;
    }
    let most = most.load(Ordering::SeqCst);
    ctx.ensure(
        most <= LARGE as usize,
        format!("at most {LARGE} workers holding a permit at once"),
        || format!("{most} at once"),
    )?;
    ctx.pass(&t)
}

/// A release that names a held permit's slot and token with another owner id cannot
/// release it:
/// `NotHeld`, and the permit stays held (its fence is current, the semaphore stays full).
pub async fn semaphore_permit_release_is_owner_checked(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("semaphore_permit_release_is_owner_checked", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let other = ctx.client().await;
    let mine = ctx.semaphore(&locker(&ctx, holder.clone(), &t)?, "owned", 1)?;
    let theirs = ctx.semaphore(&locker(&ctx, other.clone(), &t)?, "owned", 1)?;
    let permit = ctx
        .ok("try_acquire", mine.try_acquire().await)?
        .ok_or_else(|| {
            ctx.fail(
                "try_acquire of a free semaphore to grant a permit",
                "Ok(None)",
            )
        })?;
    let forged = super::forged(permit.guard().lease());
    let released = ctx.ok("release of a forged permit", holder.release(&forged).await)?;
    ctx.ensure(
        released == Release::NotHeld,
        "the release of another client's permit to be NotHeld",
        || format!("{released:?}"),
    )?;
    let taken = ctx.ok("try_acquire", theirs.try_acquire().await)?;
    if let Some(taken) = taken {
        let got = format!("a permit with token {}", taken.token());
        drop(taken);
        return Err(ctx.fail(
            "the semaphore to stay full after a forged release (try_acquire returns Ok(None))",
            got,
        ));
    }
    let fence = ctx.ok("fence", holder.fence(permit.guard().lease()).await)?;
    ctx.ensure(
        fence == Fence::Current,
        "the holder's permit to stay current",
        || format!("{fence:?}"),
    )?;
    super::guard_released(&ctx, permit.release().await)?;
    ctx.pass(&t)
}

/// A holder that takes every permit and dies (its leases never renewed): by the TTL plus
/// the store's expiry slack another client takes a permit, and the dead holder's renewal
/// of that slot is `Lost`.
pub async fn semaphore_expired_permit_is_freed(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("semaphore_expired_permit_is_freed", factory);
    let dead = ctx.client().await;
    let t = ctx.timing(&dead);
    let other = ctx.client().await;
    let semaphore = ctx.semaphore(&locker(&ctx, other.clone(), &t)?, "expiring", 2)?;
    let mut taken = Vec::new();
    for _ in 0..2 {
        let lease = ctx.ok(
            "acquire_any",
            dead.acquire_any(semaphore.slots(), t.ttl).await,
        )?;
        taken.push(
            lease.ok_or_else(|| {
                ctx.fail("acquire_any of a free slot to grant a lease", "Ok(None)")
            })?,
        );
    }
    let completed = Instant::now();
    let full = ctx.ok("try_acquire", semaphore.try_acquire().await)?;
    ctx.ensure(
        full.is_none(),
        "try_acquire of a semaphore whose permits are all held to return Ok(None)",
        || "a permit".to_owned(),
    )?;
    let deadline = t.expired_by(completed);
    let permit = loop {
        if let Some(permit) = ctx.ok("try_acquire", semaphore.try_acquire().await)? {
            break permit;
        }
        if Instant::now() >= deadline {
            return Err(ctx.fail(
                "a permit to be free once the dead holder's TTL ran out",
                format!("none free {:?} after the grants", completed.elapsed()),
            ));
        }
        sleep(Duration::from_millis(10)).await;
    };
    let dead_lease = taken
        .iter()
        .find(|l| l.key() == permit.key())
        .ok_or_else(|| {
            ctx.fail(
                "the freed permit to be one of the dead holder's slots",
                permit.key(),
            )
        })?;
    let renewed = ctx.ok("renew of the expired permit", dead.renew(dead_lease).await)?;
    ctx.ensure(
        renewed == Renewal::Lost,
        "the dead holder's renewal of a slot taken by another to be Lost",
        || format!("{renewed:?}"),
    )?;
    super::guard_released(&ctx, permit.release().await)?;
    ctx.pass(&t)
}

/// Every permit held by one client, a waiter in `Semaphore::acquire` on another with an
/// 8 s backoff: releasing one permit wakes the waiter, which holds it within 1.5 s.
pub async fn a_permit_release_wakes_a_waiter(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("a_permit_release_wakes_a_waiter", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    // The holder's leases outlive the wait, so only a release can free a permit.
    let hold = t.long_ttl;
    let waiter = waiting_locker(&ctx, ctx.client().await, t.ttl, LONG_BACKOFF)?;
    let semaphore = ctx.semaphore(&waiter, "woken", 2)?;
    let mut held = Vec::new();
    for _ in 0..2 {
        let lease = ctx.ok(
            "acquire_any",
            holder.acquire_any(semaphore.slots(), hold).await,
        )?;
        held.push(
            lease.ok_or_else(|| {
                ctx.fail("acquire_any of a free slot to grant a lease", "Ok(None)")
            })?,
        );
    }
    let waiting = tokio::spawn(async move {
        let permit = semaphore.acquire().await?;
        let granted = Instant::now();
        let slot = permit.key().clone();
        permit.release().await?;
        Ok::<_, LockError>((granted, slot))
    });
    sleep(Duration::from_millis(200)).await;
    let released_at = Instant::now();
    super::release_held(&ctx, &holder, &held[1]).await?;
    let (granted, slot) = ctx.ok(
        "the waiter's acquire()",
        waiting
            .await
            .map_err(|e| ctx.fail("the waiting task to finish", e))?,
    )?;
    let after = granted.saturating_duration_since(released_at);
    ctx.ensure(
        after <= WOKEN_WITHIN,
        format!(
            "the waiter to hold a permit within {WOKEN_WITHIN:?} of the release (its backoff is {LONG_BACKOFF:?})"
        ),
        || format!("it took {after:?}"),
    )?;
    ctx.ensure(
        &slot == held[1].key(),
        format!("the waiter to get the released slot {}", held[1].key()),
        || slot,
    )?;
    super::release_held(&ctx, &holder, &held[0]).await?;
    ctx.pass(&t)
}
