//! Cases on single leases: exclusion, tokens, expiry, owner checks, renewal and fencing.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Fence, Lease, LockBackend, LockKey, Release, Renewal};
use futures::future::join_all;
use tokio::time::{Instant, sleep, sleep_until};

use super::{forged, late_write_rejected, release_held, stale_value, token_above};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing};

/// Two clients, the timing, and a lease of key `k` granted to the first.
async fn held(
    ctx: &Ctx<'_>,
) -> Result<
    (
        Arc<dyn LockBackend>,
        Arc<dyn LockBackend>,
        Timing,
        LockKey,
        Lease,
    ),
    Failure,
> {
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let lease = ctx.take(&a, &key, t.ttl).await?;
    Ok((a, b, t, key, lease))
}

/// While a key is held, nobody else acquires it; of 16 concurrent acquires on a free
/// key exactly one wins.
pub async fn acquire_excludes_others(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("acquire_excludes_others", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    // Exclusion, not expiry, is checked here: the leases must outlast the case however
    // slow a loaded machine's round trips (a 500 ms grant once came back after 724 ms).
    let ttl = t.long_ttl;
    let key = ctx.key("held")?;
    let lease = ctx.take(&a, &key, ttl).await?;
    ctx.expect_held(&b, &key, t.ttl, "granted to another client a moment ago")
        .await?;
    ctx.expect_held(&a, &key, t.ttl, "granted to the same client a moment ago")
        .await?;

    let race = ctx.key("race")?;
    let results = join_all((0..16).map(|i| {
        let client = if i % 2 == 0 { a.clone() } else { b.clone() };
        let race = race.clone();
        async move { (client.clone(), client.acquire(&race, ttl).await) }
    }))
    .await;
    let mut winners = Vec::new();
    for (client, result) in results {
        if let Some(lease) = ctx.ok("a concurrent acquire", result)? {
            winners.push((client, lease));
        }
    }
    // Each winner is released through the client that was granted it.
    for (client, winner) in &winners {
        release_held(&ctx, client, winner).await?;
    }
    ctx.ensure(
        winners.len() == 1,
        "exactly one of 16 concurrent acquires of a free key to win",
        || format!("{} winners", winners.len()),
    )?;
    release_held(&ctx, &a, &lease).await?;
    ctx.pass(&t)
}

/// A released key can be acquired again at once, with a higher token.
pub async fn release_frees_the_key(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("release_frees_the_key", factory);
    let (a, b, t, key, first) = held(&ctx).await?;
    release_held(&ctx, &a, &first).await?;
    let second = ctx.take(&b, &key, t.ttl).await?;
    token_above(
        &ctx,
        &second,
        first.token(),
        format!("a token above {} after the release", first.token()),
    )?;
    release_held(&ctx, &b, &second).await?;
    ctx.pass(&t)
}

/// Holding one key does not block another.
pub async fn keys_are_independent(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("keys_are_independent", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let mut leases = Vec::new();
    for name in ["one", "two", "three"] {
        leases.push(ctx.take(&a, &ctx.key(name)?, t.ttl).await?);
    }
    for lease in &leases {
        release_held(&ctx, &a, lease).await?;
    }
    ctx.pass(&t)
}

/// Tokens strictly increase over acquire/release rounds, across clients.
pub async fn tokens_increase_across_releases(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("tokens_increase_across_releases", factory);
    let clients = [ctx.client().await, ctx.client().await];
    let t = ctx.timing(&clients[0]);
    let key = ctx.key("k")?;
    let mut last = None;
    for round in 0..6 {
        let client = &clients[round % 2];
        let lease = ctx.take(client, &key, t.ttl).await?;
        if let Some(previous) = last {
            token_above(
                &ctx,
                &lease,
                previous,
                format!("round {round}: a token above {previous}"),
            )?;
        }
        last = Some(lease.token());
        release_held(&ctx, client, &lease).await?;
    }
    ctx.pass(&t)
}

/// A grant after a lease expired (never released) carries a higher token.
pub async fn tokens_increase_across_expiries(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("tokens_increase_across_expiries", factory);
    let (_a, b, t, key, first) = held(&ctx).await?;
    let deadline = t.expired_by(Instant::now());
    let second = ctx
        .take_by(
            &b,
            &key,
            t.ttl,
            deadline,
            "once the first lease's TTL ran out",
        )
        .await?;
    token_above(
        &ctx,
        &second,
        first.token(),
        format!("a token above {} after the expiry", first.token()),
    )?;
    release_held(&ctx, &b, &second).await?;
    ctx.pass(&t)
}

/// How long after a server restart a client may keep failing while it reconnects.
const RESTART_GRACE: Duration = Duration::from_secs(10);

/// Tokens keep increasing across a server restart, also one that lost the store's data
/// (killed, then started again): the first grant after it carries a token above every
/// grant before it.
pub async fn tokens_increase_across_restarts(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new("tokens_increase_across_restarts", factory);
    let server = ctx.server()?;
    ctx.with_faults();
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let before = ctx.take(&a, &key, t.ttl).await?;
    let granted = Instant::now();
    release_held(&ctx, &a, &before).await?;
    server.kill().await;
    server.restart().await;
    let b = ctx.client().await;
    let deadline = Instant::now() + RESTART_GRACE;
    let after = loop {
        match b.acquire(&key, t.ttl).await {
            Ok(Some(lease)) => break lease,
            // A store whose persistence lags its replies (Redis's AOF `everysec` postpones
            // its write while an fsync is under way) may come back with the grant and
            // without the release: the key is then held until the lease's TTL runs out.
            Ok(None) if Instant::now() < t.expired_by(granted) => {
                sleep(Duration::from_millis(50)).await;
            }
            Ok(None) => {
                return Err(ctx.fail(
                    "the key released before the restart to be free after it, at the latest \
                     once the lease's TTL ran out",
                    "Ok(None): held",
                ));
            }
            // The first calls after a restart may fail while the client reconnects.
            Err(_) if Instant::now() < deadline => sleep(Duration::from_millis(50)).await,
            Err(e) => {
                return Err(ctx.fail(
                    format!("an acquire to succeed within {RESTART_GRACE:?} of the restart"),
                    format!("error: {e}"),
                ));
            }
        }
    };
    token_above(
        &ctx,
        &after,
        before.token(),
        format!("a token above {} after the restart", before.token()),
    )?;
    release_held(&ctx, &b, &after).await?;
    ctx.pass(&t)
}

/// An unrenewed lease frees its key once its TTL runs out in the store.
pub async fn ttl_expiry_frees_the_key(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("ttl_expiry_frees_the_key", factory);
    let (a, b, t, key, lease) = held(&ctx).await?;
    let granted = Instant::now();
    ctx.expect_held(&b, &key, t.ttl, "its TTL has not run out")
        .await?;
    let next = ctx
        .take_by(
            &b,
            &key,
            t.ttl,
            t.expired_by(granted),
            "after the TTL ran out",
        )
        .await?;
    let late = ctx.ok("release of an expired lease", a.release(&lease).await)?;
    ctx.ensure(
        late == Release::NotHeld,
        "release of the expired lease to be NotHeld",
        || format!("{late:?}"),
    )?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// A release by a non-owner (same key and token, another owner) is NotHeld and leaves
/// the holder's key and TTL untouched.
pub async fn release_by_non_owner_is_not_held(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("release_by_non_owner_is_not_held", factory);
    let (a, b, t, _, lease) = held(&ctx).await?;
    let fake = forged(&lease);
    let got = ctx.ok("release by a non-owner", a.release(&fake).await)?;
    ctx.ensure(
        got == Release::NotHeld,
        "a release by a non-owner to be NotHeld",
        || format!("{got:?}"),
    )?;
    holder_kept(
        &ctx,
        &b,
        &a,
        &lease,
        t.ttl,
        "only a non-owner tried to release it",
    )
    .await?;
    ctx.pass(&t)
}

/// Checks that `other` finds the key of `lease` held (`why`) and that the holder's lease is
/// untouched ([`holder_untouched`]); then the holder releases it.
async fn holder_kept(
    ctx: &Ctx<'_>,
    other: &Arc<dyn LockBackend>,
    holder: &Arc<dyn LockBackend>,
    lease: &Lease,
    ttl: Duration,
    why: &str,
) -> Result<(), Failure> {
    ctx.expect_held(other, lease.key(), ttl, why).await?;
    holder_untouched(ctx, holder, lease, ttl).await?;
    release_held(ctx, holder, lease).await
}

/// Checks, where the backend can inspect, that `lease` still holds its key with most of
/// its TTL left; and that its fence check is Current.
async fn holder_untouched(
    ctx: &Ctx<'_>,
    client: &std::sync::Arc<dyn distlock_core::LockBackend>,
    lease: &distlock_core::Lease,
    ttl: std::time::Duration,
) -> Result<(), Failure> {
    let fence = ctx.ok("fence of the holder's lease", client.fence(lease).await)?;
    ctx.ensure(
        fence == Fence::Current,
        "the holder's lease to stay Current",
        || format!("{fence:?}"),
    )?;
    if client.capabilities().inspect {
        let info = ctx.ok("inspect", client.inspect(lease.key()).await)?;
        ctx.ensure(
            info.owner == Some(lease.owner())
                && info.remaining.is_some_and(|r| r > ttl / 4 && r <= ttl),
            format!(
                "inspect to show the holder {} with most of its TTL {ttl:?} left",
                lease.owner()
            ),
            || format!("{info:?}"),
        )?;
    }
    Ok(())
}

/// A renewal or fence check by a non-owner fails and leaves the holder untouched.
pub async fn renew_by_non_owner_is_lost(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("renew_by_non_owner_is_lost", factory);
    let (a, b, t, _, lease) = held(&ctx).await?;
    let fake = forged(&lease);
    let got = ctx.ok("renew by a non-owner", a.renew(&fake).await)?;
    ctx.ensure(
        got == Renewal::Lost,
        "a renewal by a non-owner to be Lost",
        || format!("{got:?}"),
    )?;
    let fence = ctx.ok("fence by a non-owner", a.fence(&fake).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { .. }),
        "a fence check by a non-owner to be Stale",
        || format!("{fence:?}"),
    )?;
    holder_kept(
        &ctx,
        &b,
        &a,
        &lease,
        t.ttl,
        "only a non-owner tried to renew it",
    )
    .await?;
    ctx.pass(&t)
}

/// A: acquires and lets the lease expire; B: takes the key. Returns both clients and
/// leases. The token order is left to the callers' checks and to I1 on the history.
async fn takeover(
    ctx: &Ctx<'_>,
) -> Result<
    (
        std::sync::Arc<dyn distlock_core::LockBackend>,
        distlock_core::Lease,
        std::sync::Arc<dyn distlock_core::LockBackend>,
        distlock_core::Lease,
        crate::support::Timing,
    ),
    Failure,
> {
    let (a, b, t, key, old) = held(ctx).await?;
    let deadline = t.expired_by(Instant::now());
    let new = ctx
        .take_by(&b, &key, t.ttl, deadline, "after the first lease expired")
        .await?;
    Ok((a, old, b, new, t))
}

/// After a takeover, the old holder's release is NotHeld and the new holder keeps its
/// key and TTL.
pub async fn release_after_expiry_leaves_new_holder(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("release_after_expiry_leaves_new_holder", factory);
    let (a, old, b, new, t) = takeover(&ctx).await?;
    let got = ctx.ok("release of an expired lease", a.release(&old).await)?;
    ctx.ensure(
        got == Release::NotHeld,
        "the old holder's release after the takeover to be NotHeld",
        || format!("{got:?}"),
    )?;
    holder_kept(&ctx, &a, &b, &new, t.ttl, "the new holder's lease runs").await?;
    ctx.pass(&t)
}

/// After a takeover, the old holder's renewal is Lost and the new holder keeps its key
/// and TTL.
pub async fn renew_after_expiry_leaves_new_holder(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("renew_after_expiry_leaves_new_holder", factory);
    let (a, old, b, new, t) = takeover(&ctx).await?;
    let got = ctx.ok("renew of an expired lease", a.renew(&old).await)?;
    ctx.ensure(
        got == Renewal::Lost,
        "the old holder's renewal after the takeover to be Lost",
        || format!("{got:?}"),
    )?;
    holder_kept(&ctx, &a, &b, &new, t.ttl, "the new holder's lease runs").await?;
    ctx.pass(&t)
}

/// A second release is NotHeld (not an error), also once someone else holds the key.
pub async fn second_release_is_not_held(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("second_release_is_not_held", factory);
    let (a, b, t, key, lease) = held(&ctx).await?;
    release_held(&ctx, &a, &lease).await?;
    let again = ctx.ok("a second release", a.release(&lease).await)?;
    ctx.ensure(
        again == Release::NotHeld,
        "a second release to be NotHeld",
        || format!("{again:?}"),
    )?;
    let next = ctx.take(&b, &key, t.ttl).await?;
    let third = ctx.ok("a third release", a.release(&lease).await)?;
    ctx.ensure(
        third == Release::NotHeld,
        "a release of the old lease while another client holds the key to be NotHeld",
        || format!("{third:?}"),
    )?;
    holder_untouched(&ctx, &b, &next, t.ttl).await?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// Renewals extend the lease past its original TTL and keep its token.
pub async fn renew_extends_and_keeps_token(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("renew_extends_and_keeps_token", factory);
    let (a, b, t, key, lease) = held(&ctx).await?;
    // Past the instant the store would have freed the key without renewals.
    let past_original = t.expired_by(Instant::now());
    let mut valid = lease.valid_until();
    while Instant::now() < past_original {
        tokio::time::sleep(t.ttl / 3).await;
        let renewal = a.renew(&lease).await;
        let replied = Instant::now();
        match ctx.ok("renew of a held lease", renewal)? {
            Renewal::Renewed { valid_until } => {
                ctx.ensure(
                    valid_until > valid && valid_until <= replied + t.ttl,
                    "a renewal to move the validity forward, to at most its reply plus the TTL",
                    || format!("{valid_until:?} after {valid:?} (reply {replied:?})"),
                )?;
                valid = valid_until;
            }
            other => {
                return Err(ctx.fail("a held lease to renew", format!("{other:?}")));
            }
        }
    }
    ctx.expect_held(&b, &key, t.ttl, "renewed past its original TTL")
        .await?;
    holder_untouched(&ctx, &a, &lease, t.ttl).await?;
    if a.capabilities().inspect {
        let info = ctx.ok("inspect", a.inspect(&key).await)?;
        ctx.ensure(
            info.token == Some(lease.token()),
            format!("the key's newest token to still be {}", lease.token()),
            || format!("{:?}", info.token),
        )?;
    }
    release_held(&ctx, &a, &lease).await?;
    let next = ctx.take(&b, &key, t.ttl).await?;
    token_above(
        &ctx,
        &next,
        lease.token(),
        format!("the next grant's token above the renewed {}", lease.token()),
    )?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// A renewal of an expired lease nobody took is Lost and does not bring it back.
pub async fn renew_never_resurrects(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("renew_never_resurrects", factory);
    let (a, b, t, key, lease) = held(&ctx).await?;
    sleep_until(t.expired_by(Instant::now())).await;
    let got = ctx.ok("renew of an expired lease", a.renew(&lease).await)?;
    ctx.ensure(
        got == Renewal::Lost,
        "a renewal after the TTL ran out to be Lost",
        || format!("{got:?}"),
    )?;
    let fence = ctx.ok("fence of an expired lease", a.fence(&lease).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { .. }),
        "the expired lease to be Stale",
        || format!("{fence:?}"),
    )?;
    let next = ctx.take(&b, &key, t.ttl).await?;
    token_above(
        &ctx,
        &next,
        lease.token(),
        format!("a token above {}", lease.token()),
    )?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// A held lease is Current; once released it is Stale.
pub async fn fence_current_while_held(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("fence_current_while_held", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let lease = ctx.take(&a, &key, t.ttl).await?;
    for _ in 0..2 {
        let fence = ctx.ok("fence of a held lease", a.fence(&lease).await)?;
        ctx.ensure(
            fence == Fence::Current,
            "a held lease to be Current",
            || format!("{fence:?}"),
        )?;
    }
    release_held(&ctx, &a, &lease).await?;
    let fence = ctx.ok("fence of a released lease", a.fence(&lease).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { current } if current >= lease.token()),
        format!(
            "a released lease to be Stale with a current token >= {}",
            lease.token()
        ),
        || format!("{fence:?}"),
    )?;
    ctx.pass(&t)
}

/// An expired lease is Stale, even when nobody took the key.
pub async fn fence_stale_after_expiry(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("fence_stale_after_expiry", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let lease = ctx.take(&a, &key, t.ttl).await?;
    sleep_until(t.expired_by(Instant::now())).await;
    let fence = ctx.ok("fence of an expired lease", a.fence(&lease).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { current } if current >= lease.token()),
        format!(
            "an expired lease to be Stale with a current token >= {}",
            lease.token()
        ),
        || format!("{fence:?}"),
    )?;
    ctx.pass(&t)
}

/// After a takeover, the old lease is Stale and names a token at least the new one.
pub async fn fence_stale_after_takeover(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("fence_stale_after_takeover", factory);
    let (a, old, b, new, t) = takeover(&ctx).await?;
    let fence = ctx.ok("fence of a taken-over lease", a.fence(&old).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { current } if current >= new.token()),
        format!(
            "the old lease to be Stale with a current token >= the new holder's {}",
            new.token()
        ),
        || format!("{fence:?}"),
    )?;
    let fence = ctx.ok("fence of the new holder", b.fence(&new).await)?;
    ctx.ensure(
        fence == Fence::Current,
        "the new holder to be Current",
        || format!("{fence:?}"),
    )?;
    release_held(&ctx, &b, &new).await?;
    ctx.pass(&t)
}

/// A holder paused past its TTL is fenced: its late write is rejected, the new
/// holder's accepted.
pub async fn paused_holder_is_fenced(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("paused_holder_is_fenced", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let counter = ctx.counter();

    let old = ctx.take(&a, &key, t.ttl).await?;
    let first = ctx.ok("write", counter.write(&key, old.token(), 0, 1).await)?;
    ctx.ensure(
        first.is_admitted(),
        "the holder's first write to be admitted",
        || format!("{first:?}"),
    )?;
    // The holder reads, then stalls past its TTL without renewing (a GC pause).
    let read = ctx.ok("read the counter", counter.read(&key).await)?;
    let deadline = t.expired_by(Instant::now());
    let new = ctx
        .take_by(&b, &key, t.ttl, deadline, "while the old holder is paused")
        .await?;
    let read_new = ctx.ok("read the counter", counter.read(&key).await)?;
    let admitted = ctx.ok(
        "write",
        counter
            .write(&key, new.token(), read_new, read_new + 1)
            .await,
    )?;
    ctx.ensure(
        admitted.is_admitted(),
        "the new holder's write to be admitted",
        || format!("{admitted:?} for token {}", new.token()),
    )?;
    // The old holder wakes up and writes what it computed before the pause.
    let late = ctx.ok(
        "write",
        counter
            .write(&key, old.token(), read, stale_value(read))
            .await,
    )?;
    late_write_rejected(&ctx, &counter, late, "the paused holder", &old, &new).await?;
    let fence = ctx.ok("fence of the paused holder", a.fence(&old).await)?;
    ctx.ensure(
        matches!(fence, Fence::Stale { .. }),
        "the paused holder's lease to be Stale",
        || format!("{fence:?}"),
    )?;
    release_held(&ctx, &b, &new).await?;
    ctx.pass(&t)
}

/// `inspect` shows the holder, the newest token and the remaining TTL.
pub async fn inspect_reports_holder(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("inspect_reports_holder", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let empty = ctx.ok("inspect of an unused key", a.inspect(&key).await)?;
    ctx.ensure(
        empty.owner.is_none() && empty.remaining.is_none(),
        "an unused key to have no holder",
        || format!("{empty:?}"),
    )?;
    let lease = ctx.take(&a, &key, t.ttl).await?;
    let info = ctx.ok("inspect", a.inspect(&key).await)?;
    ctx.ensure(
        info.owner == Some(lease.owner())
            && info.token == Some(lease.token())
            && info.remaining.is_some_and(|r| r <= t.ttl && !r.is_zero()),
        format!(
            "owner {}, token {}, remaining at most {:?}",
            lease.owner(),
            lease.token(),
            t.ttl
        ),
        || format!("{info:?}"),
    )?;
    release_held(&ctx, &a, &lease).await?;
    // A store may keep the newest token of a free key (a counter) or nothing (Redis, whose
    // next token is its clock): either way, none below the one released.
    let after = ctx.ok("inspect after release", a.inspect(&key).await)?;
    ctx.ensure(
        after.owner.is_none() && after.token.is_none_or(|t| t >= lease.token()),
        format!(
            "no holder, and no newest token below {} after release",
            lease.token()
        ),
        || format!("{after:?}"),
    )?;
    ctx.pass(&t)
}
