//! Cases on the batch forms: each result equals what the single form returns, in order.

use distlock_core::{Fence, Release, Renewal};

use super::{forged, release_held};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing};

/// The TTL of the leases these cases take: they compare answers about held leases, so
/// none may run out between the calls compared, however slowly a loaded machine runs
/// them ([`Timing::long_ttl`]); expiry is the lease cases' subject.
fn held_ttl(t: &Timing) -> std::time::Duration {
    t.long_ttl
}

/// `acquire_many` over free and held keys grants exactly the free ones, in order, with
/// increasing tokens, like `acquire` would.
pub async fn acquire_many_agrees_with_acquire(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("acquire_many_agrees_with_acquire", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let ttl = held_ttl(&t);
    let keys = [ctx.key("free-0")?, ctx.key("held")?, ctx.key("free-1")?];
    let held = ctx.take(&b, &keys[1], ttl).await?;
    let none = ctx.ok("acquire_many of no keys", a.acquire_many(&[], ttl).await)?;
    ctx.ensure(
        none.is_empty(),
        "acquire_many(&[]) to return no results",
        || format!("{} results", none.len()),
    )?;
    let got = ctx.ok("acquire_many", a.acquire_many(&keys, ttl).await)?;
    let shape: Vec<bool> = got.iter().map(Option::is_some).collect();
    ctx.ensure(
        shape == [true, false, true],
        "[granted, held, granted] for [free, held, free]",
        || format!("{shape:?}"),
    )?;
    for (key, lease) in keys.iter().zip(&got) {
        if let Some(lease) = lease {
            ctx.ensure(
                lease.key() == key,
                format!("the lease for {key} in its slot"),
                || lease.key().clone(),
            )?;
        }
    }
    let single = ctx.ok("acquire", a.acquire(&keys[1], ttl).await)?;
    ctx.ensure(single.is_none(), "the single form to agree: held", || {
        format!("{single:?}")
    })?;
    let taken: Vec<_> = got.into_iter().flatten().collect();
    // Release one, then a second batch: a fresh grant with a higher token, and a held key.
    release_held(&ctx, &a, &taken[0]).await?;
    let again = ctx.ok(
        "acquire_many",
        a.acquire_many(&[keys[0].clone(), keys[2].clone()], ttl)
            .await,
    )?;
    let regrant = match again.as_slice() {
        [Some(lease), None] => lease.clone(),
        other => {
            return Err(ctx.fail(
                "[granted, held] for [released, still held]",
                format!(
                    "{:?}",
                    other.iter().map(Option::is_some).collect::<Vec<_>>()
                ),
            ));
        }
    };
    ctx.ensure(
        regrant.token() > taken[0].token(),
        format!("a token above {}", taken[0].token()),
        || regrant.token(),
    )?;
    for lease in [&regrant, &taken[1]] {
        release_held(&ctx, &a, lease).await?;
    }
    release_held(&ctx, &b, &held).await?;
    ctx.pass(&t)
}

/// `renew_many` over held, released and forged leases agrees with `renew`, in order.
pub async fn renew_many_agrees_with_renew(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("renew_many_agrees_with_renew", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let ttl = held_ttl(&t);
    let held = ctx.take(&a, &ctx.key("held")?, ttl).await?;
    let released = ctx.take(&a, &ctx.key("released")?, ttl).await?;
    release_held(&ctx, &a, &released).await?;
    let other = ctx.take(&a, &ctx.key("other")?, ttl).await?;
    let fake = forged(&other);
    let batch = [held.clone(), released.clone(), fake.clone()];
    let got = ctx.ok("renew_many", a.renew_many(&batch).await)?;
    let shape: Vec<bool> = got
        .iter()
        .map(|r| matches!(r, Renewal::Renewed { .. }))
        .collect();
    ctx.ensure(
        shape == [true, false, false],
        "[Renewed, Lost, Lost] for [held, released, forged]",
        || format!("{got:?}"),
    )?;
    for (lease, batched) in batch.iter().zip(&got) {
        let single = ctx.ok("renew", a.renew(lease).await)?;
        ctx.ensure(
            std::mem::discriminant(&single) == std::mem::discriminant(batched),
            format!("renew of token {} to agree with renew_many", lease.token()),
            || format!("{single:?} vs {batched:?}"),
        )?;
    }
    for lease in [&held, &other] {
        ctx.expect_held(&b, lease.key(), t.ttl, "its owner renewed it")
            .await?;
        let fence = ctx.ok("fence", a.fence(lease).await)?;
        ctx.ensure(
            fence == Fence::Current,
            "the renewed lease to be Current",
            || format!("{fence:?}"),
        )?;
        release_held(&ctx, &a, lease).await?;
    }
    ctx.pass(&t)
}

/// `release_many` over held, repeated and forged leases agrees with `release`, in order,
/// and leaves a forged lease's holder untouched.
pub async fn release_many_agrees_with_release(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("release_many_agrees_with_release", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let ttl = held_ttl(&t);
    let first = ctx.take(&a, &ctx.key("first")?, ttl).await?;
    let second = ctx.take(&a, &ctx.key("second")?, ttl).await?;
    let kept = ctx.take(&a, &ctx.key("kept")?, ttl).await?;
    let batch = [first.clone(), second.clone(), first.clone(), forged(&kept)];
    let got = ctx.ok("release_many", a.release_many(&batch).await)?;
    use Release::{NotHeld, Released};
    ctx.ensure(
        got == [Released, Released, NotHeld, NotHeld],
        "[Released, Released, NotHeld, NotHeld] for [held, held, repeated, forged]",
        || format!("{got:?}"),
    )?;
    for lease in [&first, &second] {
        let single = ctx.ok("release", a.release(lease).await)?;
        ctx.ensure(
            single == NotHeld,
            "the single form to agree: NotHeld",
            || format!("{single:?}"),
        )?;
    }
    ctx.expect_held(&b, kept.key(), t.ttl, "only a forged copy was released")
        .await?;
    let freed = ctx.take(&b, first.key(), t.ttl).await?;
    release_held(&ctx, &b, &freed).await?;
    release_held(&ctx, &a, &kept).await?;
    ctx.pass(&t)
}
