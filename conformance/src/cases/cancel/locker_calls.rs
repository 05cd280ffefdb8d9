//! Cancellation cases on [`Locker`]: `lock`, `try_lock`, `with_lock` and the guard's
//! `release`, dropped after their 1st, 2nd, 3rd … poll; the watchdog must renew nothing
//! a dropped call took.

use std::sync::Arc;

use lock_api::{LockBackend, LockKey, Locker, Release};
use tokio::time::Instant;

use super::{MAX_POLLS, after_the_cut, cut_after, cut_keys, never_completed, record_given_up};
use crate::cases::locker::locker;
use crate::cases::release_held;
use crate::factory::Factory;
use crate::suite::{Ctx, Failure, Outcome, Timing};

/// The checks after a [`Locker`] call was dropped: its watchdog renews nothing (a lease
/// it renewed would stay held), then [`after_the_cut`].
#[allow(clippy::too_many_arguments)]
async fn after_the_locker_cut(
    ctx: &Ctx<'_>,
    t: &Timing,
    locker: &Locker,
    other: &Arc<dyn LockBackend>,
    probe: &LockKey,
    keys: &[LockKey],
    cut: Instant,
    what: &str,
) -> Result<(), Failure> {
    ctx.ensure(
        locker.held() == 0,
        format!("the watchdog to renew no lease after {what}"),
        || format!("{} renewed", locker.held()),
    )?;
    after_the_cut(ctx, t, locker.backend(), other, probe, keys, cut, what).await
}

/// `Locker::lock` on a free key dropped at any poll leaves no lease behind for longer
/// than its TTL, and its watchdog renews nothing.
pub async fn dropped_lock_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_lock_leaves_no_orphan", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let locker = locker(&ctx, first, &t)?;
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        match cut_after(locker.lock(&keys[0]), polls).await {
            Some(guard) => {
                let guard = ctx.ok("lock", guard)?;
                let released = ctx.ok("guard release", guard.release().await)?;
                ctx.ensure(
                    released == Release::Released,
                    "the guard's release to be Released",
                    || format!("{released:?}"),
                )?;
                return ctx.pass(&t);
            }
            None => {
                let what = format!("a lock dropped after {polls} poll(s)");
                after_the_locker_cut(
                    &ctx,
                    &t,
                    &locker,
                    &other,
                    &probe,
                    &keys,
                    Instant::now(),
                    &what,
                )
                .await?;
            }
        }
    }
    Err(never_completed(&ctx, "lock"))
}

/// `Locker::try_lock` dropped at any poll leaves no lease behind for longer than its
/// TTL, and its watchdog renews nothing.
pub async fn dropped_try_lock_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_try_lock_leaves_no_orphan", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let locker = locker(&ctx, first, &t)?;
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        match cut_after(locker.try_lock(&keys[0]), polls).await {
            Some(guard) => {
                let guard = ctx.ok("try_lock", guard)?.ok_or_else(|| {
                    ctx.fail("try_lock of a free key to grant a guard", "Ok(None)")
                })?;
                let released = ctx.ok("guard release", guard.release().await)?;
                ctx.ensure(
                    released == Release::Released,
                    "the guard's release to be Released",
                    || format!("{released:?}"),
                )?;
                return ctx.pass(&t);
            }
            None => {
                let what = format!("a try_lock dropped after {polls} poll(s)");
                after_the_locker_cut(
                    &ctx,
                    &t,
                    &locker,
                    &other,
                    &probe,
                    &keys,
                    Instant::now(),
                    &what,
                )
                .await?;
            }
        }
    }
    Err(never_completed(&ctx, "try_lock"))
}

/// `Locker::with_lock` dropped at any poll (waiting, in the job, releasing) frees the key
/// by its TTL at the latest; run to the end it returns the job's value and frees the key.
pub async fn dropped_with_lock_frees_the_key(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_with_lock_frees_the_key", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let locker = locker(&ctx, first, &t)?;
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let job = |_: &lock_api::LockGuard| async move {
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
                let next = ctx.take(&other, &keys[0], t.ttl).await?;
                release_held(&ctx, &other, &next).await?;
                return ctx.pass(&t);
            }
            None => {
                // The cut may fall inside the release that ends with_lock.
                record_given_up(&ctx, &keys[0], cut, "with_lock");
                after_the_locker_cut(&ctx, &t, &locker, &other, &probe, &keys, cut, &what).await?;
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
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let locker = locker(&ctx, first, &t)?;
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let guard = ctx.ok("lock", locker.lock(&keys[0]).await)?;
        let released = cut_after(guard.release(), polls).await;
        let completed = released.is_some();
        let cut = Instant::now();
        let what = format!("a guard release dropped after {polls} poll(s)");
        match released {
            Some(released) => {
                let released = ctx.ok("guard release", released)?;
                ctx.ensure(
                    released == Release::Released,
                    "the guard's release to be Released",
                    || format!("{released:?}"),
                )?;
            }
            None => record_given_up(&ctx, &keys[0], cut, "guard release"),
        }
        after_the_locker_cut(&ctx, &t, &locker, &other, &probe, &keys, cut, &what).await?;
        if completed {
            return ctx.pass(&t);
        }
    }
    Err(never_completed(&ctx, "guard release"))
}
