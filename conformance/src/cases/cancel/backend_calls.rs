//! Cancellation cases on the [`LockBackend`] calls: `acquire`, `renew` and `release`, and
//! their batch forms, dropped after their 1st, 2nd, 3rd … poll.
//!
//! [`LockBackend`]: distlock_core::LockBackend

use distlock_core::{Release, Renewal};
use tokio::time::Instant;

use super::{BATCH, Clients, cut_after, each_cut};
use crate::cases::release_held;
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome};

/// An acquire dropped at any poll leaves no lease behind for longer than its TTL, and
/// the backend serves the next call.
pub async fn dropped_acquire_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_acquire_leaves_no_orphan", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(ctx, &c.t, "acquire", 1, move |polls, keys| async move {
        match cut_after(c.first.acquire(&keys[0], c.t.ttl), polls).await {
            Some(granted) => {
                let lease = ctx.ok("acquire", granted)?.ok_or_else(|| {
                    ctx.fail("the acquire of a free key to grant a lease", "Ok(None)")
                })?;
                release_held(ctx, &c.first, &lease).await?;
                Ok(true)
            }
            None => {
                let what = format!("an acquire dropped after {polls} poll(s)");
                c.after_the_cut(ctx, &keys, Instant::now(), &what).await?;
                Ok(false)
            }
        }
    })
    .await
}

/// A renew dropped at any poll leaves the lease with its owner: releasing it is the next
/// call, and it frees the key.
pub async fn dropped_renew_keeps_the_lease(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_renew_keeps_the_lease", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(ctx, &c.t, "renew", 1, move |polls, keys| async move {
        let lease = ctx.take(&c.first, &keys[0], c.t.ttl).await?;
        let renewed = cut_after(c.first.renew(&lease), polls).await;
        let completed = renewed.is_some();
        if let Some(renewed) = renewed {
            let renewed = ctx.ok("renew", renewed)?;
            ctx.ensure(
                matches!(renewed, Renewal::Renewed { .. }),
                "the renewal of a held lease to be Renewed",
                || format!("{renewed:?}"),
            )?;
        }
        release_held(ctx, &c.first, &lease).await?;
        let what = format!("a renew dropped after {polls} poll(s)");
        c.after_the_cut(ctx, &keys, Instant::now(), &what).await?;
        Ok(completed)
    })
    .await
}

/// A release dropped at any poll, its lease then given up, leaves the key held no longer
/// than its TTL.
pub async fn dropped_release_frees_the_key_by_its_ttl(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_release_frees_the_key_by_its_ttl", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(ctx, &c.t, "release", 1, move |polls, keys| async move {
        let lease = ctx.take(&c.first, &keys[0], c.t.ttl).await?;
        let released = cut_after(c.first.release(&lease), polls).await;
        let completed = released.is_some();
        let cut = Instant::now();
        drop(lease);
        let what = format!("a release dropped after {polls} poll(s)");
        // A release made and dropped stays in the history as unfinished, which ends the
        // lease's window where it was made.
        if let Some(released) = released {
            let released = ctx.ok("release", released)?;
            ctx.ensure(
                released == Release::Released,
                "the release of a held lease to be Released",
                || format!("{released:?}"),
            )?;
        }
        c.after_the_cut(ctx, &keys, cut, &what).await?;
        Ok(completed)
    })
    .await
}

/// An `acquire_many` dropped at any poll leaves no lease behind for longer than its TTL.
pub async fn dropped_acquire_many_leaves_no_orphan(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_acquire_many_leaves_no_orphan", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(
        ctx,
        &c.t,
        "acquire_many",
        BATCH,
        move |polls, keys| async move {
            match cut_after(c.first.acquire_many(&keys, c.t.ttl), polls).await {
                Some(granted) => {
                    let granted = ctx.ok("acquire_many", granted)?;
                    let leases: Vec<_> = granted.into_iter().flatten().collect();
                    ctx.ensure(
                        leases.len() == BATCH,
                        format!("acquire_many of {BATCH} free keys to grant them all"),
                        || format!("{} granted", leases.len()),
                    )?;
                    for lease in &leases {
                        release_held(ctx, &c.first, lease).await?;
                    }
                    Ok(true)
                }
                None => {
                    let what = format!("an acquire_many dropped after {polls} poll(s)");
                    c.after_the_cut(ctx, &keys, Instant::now(), &what).await?;
                    Ok(false)
                }
            }
        },
    )
    .await
}

/// A `renew_many` dropped at any poll leaves the leases with their owner: releasing them
/// is the next call, and it frees the keys.
pub async fn dropped_renew_many_keeps_the_leases(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_renew_many_keeps_the_leases", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(
        ctx,
        &c.t,
        "renew_many",
        BATCH,
        move |polls, keys| async move {
            let leases = c.take_all(ctx, &keys).await?;
            let renewed = cut_after(c.first.renew_many(&leases), polls).await;
            let completed = renewed.is_some();
            if let Some(renewed) = renewed {
                let renewed = ctx.ok("renew_many", renewed)?;
                ctx.ensure(
                    renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })),
                    "renew_many of held leases to renew them all",
                    || format!("{renewed:?}"),
                )?;
            }
            for lease in &leases {
                release_held(ctx, &c.first, lease).await?;
            }
            let what = format!("a renew_many dropped after {polls} poll(s)");
            c.after_the_cut(ctx, &keys, Instant::now(), &what).await?;
            Ok(completed)
        },
    )
    .await
}

/// A `release_many` dropped at any poll, its leases then given up, leaves no key held
/// longer than its TTL.
pub async fn dropped_release_many_frees_the_keys_by_their_ttl(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = &Ctx::new("dropped_release_many_frees_the_keys_by_their_ttl", factory);
    let c = &Clients::new(ctx).await?;
    each_cut(
        ctx,
        &c.t,
        "release_many",
        BATCH,
        move |polls, keys| async move {
            let leases = c.take_all(ctx, &keys).await?;
            let released = cut_after(c.first.release_many(&leases), polls).await;
            let completed = released.is_some();
            let cut = Instant::now();
            drop(leases);
            let what = format!("a release_many dropped after {polls} poll(s)");
            if let Some(released) = released {
                let released = ctx.ok("release_many", released)?;
                ctx.ensure(
                    released.iter().all(|r| *r == Release::Released),
                    "release_many of held leases to release them all",
                    || format!("{released:?}"),
                )?;
            }
            c.after_the_cut(ctx, &keys, cut, &what).await?;
            Ok(completed)
        },
    )
    .await
}
