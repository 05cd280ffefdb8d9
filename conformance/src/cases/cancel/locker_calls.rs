//! Cancellation cases on [`Locker`]: `lock`, `try_lock`, `with_lock`, the guard's
//! `release` and a semaphore's `acquire`, dropped after their 1st, 2nd, 3rd … poll; the
//! watchdog must renew nothing a dropped call took.

use distlock_core::{LockKey, Locker};
use tokio::time::Instant;

use super::{
    Clients, MAX_POLLS, after_the_cut, cut_after, cut_keys, never_completed, record_given_up,
};
use crate::cases::locker::locker;
use crate::cases::{guard_released, release_held};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome};

/// The checks after a [`Locker`] call was dropped: its watchdog renews nothing (a lease
/// it renewed would stay held), then [`after_the_cut`] on the locker's backend.
async fn after_the_locker_cut(
    ctx: &Ctx<'_>,
    c: &Clients,
    locker: &Locker,
    keys: &[LockKey],
    cut: Instant,
    what: &str,
) -> Result<(), Failure> {
    ctx.ensure(
        locker.held() == 0,
        format!("the watchdog to renew no lease after {what}"),
        || format!("{} renewed", locker.held()),
    )?;
    after_the_cut(
        ctx,
        &c.t,
        locker.backend(),
        &c.other,
        &c.probe,
        keys,
        cut,
        what,
    )
    .await
}

/// `Locker::lock` on a free key dropped at any poll leaves no lease behind for longer
/// than its TTL, and its watchdog renews nothing.
pub async fn dropped_lock_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_lock_leaves_no_orphan", factory);
    let c = Clients::new(&ctx).await?;
    let locker = locker(&ctx, c.first.clone(), &c.t)?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        match cut_after(locker.lock(&keys[0]), polls).await {
            Some(guard) => {
                let guard = ctx.ok("lock", guard)?;
                guard_released(&ctx, guard.release().await)?;
                return ctx.pass(&c.t);
            }
            None => {
                let what = format!("a lock dropped after {polls} poll(s)");
                after_the_locker_cut(&ctx, &c, &locker, &keys, Instant::now(), &what).await?;
            }
        }
    }
    Err(never_completed(&ctx, "lock"))
}

/// `Locker::try_lock` dropped at any poll leaves no lease behind for longer than its
/// TTL, and its watchdog renews nothing.
pub async fn dropped_try_lock_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_try_lock_leaves_no_orphan", factory);
    let c = Clients::new(&ctx).await?;
    let locker = locker(&ctx, c.first.clone(), &c.t)?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        match cut_after(locker.try_lock(&keys[0]), polls).await {
            Some(guard) => {
                let guard = ctx.ok("try_lock", guard)?.ok_or_else(|| {
                    ctx.fail("try_lock of a free key to grant a guard", "Ok(None)")
                })?;
                guard_released(&ctx, guard.release().await)?;
                return ctx.pass(&c.t);
            }
            None => {
                let what = format!("a try_lock dropped after {polls} poll(s)");
                after_the_locker_cut(&ctx, &c, &locker, &keys, Instant::now(), &what).await?;
            }
        }
    }
    Err(never_completed(&ctx, "try_lock"))
}

/// `Locker::with_lock` dropped at any poll (waiting, in the job, releasing) frees the key
/// by its TTL at the latest; run to the end it returns the job's value and frees the key.
pub async fn dropped_with_lock_frees_the_key(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_with_lock_frees_the_key", factory);
    let c = Clients::new(&ctx).await?;
    let locker = locker(&ctx, c.first.clone(), &c.t)?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let job = |_: &distlock_core::LockGuard| async move {
            // A few suspensions, so some cuts fall inside the job.
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            polls
        };
        let ran = cut_after(locker.with_lock(&keys[0], job), polls).await;
        let cut = Instant::now();
        let what = format!("a with_lock dropped after {polls} poll(s)");
        match ran {
            Some(ran) => {
                let ran = ctx.ok("with_lock", ran)?;
                ctx.ensure(ran == polls, "with_lock to return the job's value", || ran)?;
                let next = ctx.take(&c.other, &keys[0], c.t.long_ttl).await?;
                release_held(&ctx, &c.other, &next).await?;
                return ctx.pass(&c.t);
            }
            None => {
                // The cut may fall inside the release that ends with_lock.
                record_given_up(&ctx, &keys[0], cut, "with_lock");
                after_the_locker_cut(&ctx, &c, &locker, &keys, cut, &what).await?;
            }
        }
    }
    Err(never_completed(&ctx, "with_lock"))
}

/// `LockGuard::release` dropped at any poll stops renewal at once and leaves the key
/// held no longer than its TTL.
pub async fn dropped_guard_release_frees_the_key_by_its_ttl(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_guard_release_frees_the_key_by_its_ttl", factory);
    let c = Clients::new(&ctx).await?;
    let locker = locker(&ctx, c.first.clone(), &c.t)?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let guard = ctx.ok("lock", locker.lock(&keys[0]).await)?;
        let released = cut_after(guard.release(), polls).await;
        let completed = released.is_some();
        let cut = Instant::now();
        let what = format!("a guard release dropped after {polls} poll(s)");
        match released {
            Some(released) => guard_released(&ctx, released)?,
            None => record_given_up(&ctx, &keys[0], cut, "guard release"),
        }
        after_the_locker_cut(&ctx, &c, &locker, &keys, cut, &what).await?;
        if completed {
            return ctx.pass(&c.t);
        }
    }
    Err(never_completed(&ctx, "guard release"))
}

/// `Semaphore::acquire` of a free permit dropped at any poll leaves no slot held for
/// longer than its TTL, and its watchdog renews nothing.
pub async fn dropped_permit_acquire_leaves_no_orphan(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_permit_acquire_leaves_no_orphan", factory);
    let c = Clients::new(&ctx).await?;
    let locker = locker(&ctx, c.first.clone(), &c.t)?;
    for polls in 1..=MAX_POLLS {
        let semaphore = ctx.semaphore(&locker, &format!("cut-{polls}"), 2)?;
        match cut_after(semaphore.acquire(), polls).await {
            Some(permit) => {
                let permit = ctx.ok("Semaphore::acquire", permit)?;
                guard_released(&ctx, permit.release().await)?;
                return ctx.pass(&c.t);
            }
            None => {
                let what = format!("a semaphore acquire dropped after {polls} poll(s)");
                let slots = semaphore.slots().to_vec();
                after_the_locker_cut(&ctx, &c, &locker, &slots, Instant::now(), &what).await?;
            }
        }
    }
    Err(never_completed(&ctx, "Semaphore::acquire"))
}
