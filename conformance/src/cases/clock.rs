//! The case on a wall clock that steps back under a live store: fencing tokens exist for
//! the moment timing assumptions fail, so they may not go back with the clock.

use std::time::Duration;

use distlock_core::{Fence, Release};

use super::{release_held, token_above};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome};

/// How far each step goes back: far more than any token leads the clock by, and less than
/// a day, so every TTL a store honours still counts from a clock that reads a real date.
const STEP: Duration = Duration::from_secs(60);

/// Tokens of a key keep rising when the wall clock the store's tokens may read steps
/// back: under a key held across the step (the next holder's token is above the one that
/// held it), and under a key released before a second step (a single and a batch grant
/// are above the last token), and a fence on the freed key reports at least its newest
/// token, never the clock's earlier reading.
pub async fn tokens_keep_rising_across_a_clock_step(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("tokens_keep_rising_across_a_clock_step", factory);
    let clock = ctx.clock()?;
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let other = ctx.key("other")?;

    let before = ctx.take(&a, &key, t.ttl).await?;
    release_held(&ctx, &a, &before).await?;
    // Held across the step, released after it.
    let held = ctx.take(&a, &key, t.ttl).await?;
    token_above(&ctx, &held, before.token(), "a token above the first one")?;
    clock.step_back(STEP).await;
    release_held(&ctx, &a, &held).await?;
    let next = ctx.take(&b, &key, t.ttl).await?;
    token_above(
        &ctx,
        &next,
        held.token(),
        format!(
            "after a {STEP:?} step back under a held key, a token above its holder's {}",
            held.token()
        ),
    )?;
    release_held(&ctx, &b, &next).await?;
    let fence = ctx.ok("fence of a released lease", b.fence(&next).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { current } if current >= next.token()),
        format!(
            "a fence on the freed key to be Stale with a current token >= its newest {}",
            next.token()
        ),
        || format!("{fence:?}"),
    )?;

    // Released before a second step: a single grant, then a batch, above it.
    clock.step_back(STEP).await;
    let single = ctx.take(&a, &key, t.ttl).await?;
    token_above(
        &ctx,
        &single,
        next.token(),
        format!(
            "after a second {STEP:?} step back under a free key, a token above its last {}",
            next.token()
        ),
    )?;
    release_held(&ctx, &a, &single).await?;
    let batch = ctx.ok(
        "acquire_many of two free keys",
        b.acquire_many(&[key.clone(), other.clone()], t.ttl).await,
    )?;
    let leases: Vec<_> = batch.into_iter().flatten().collect();
    ctx.ensure(leases.len() == 2, "both keys of the batch granted", || {
        format!("{} granted", leases.len())
    })?;
    token_above(
        &ctx,
        &leases[0],
        single.token(),
        format!(
            "a batch grant after the steps above the key's last token {}",
            single.token()
        ),
    )?;
    let released = ctx.ok("release_many", b.release_many(&leases).await)?;
    ctx.ensure(
        released.iter().all(|r| *r == Release::Released),
        "both leases of the batch released",
        || format!("{released:?}"),
    )?;
    ctx.pass(&t)
}
