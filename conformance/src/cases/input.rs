//! Cases on bad input (typed errors that change nothing) and on unknown outcomes.

use std::time::Duration;

use distlock_core::{
    BackendId, Capabilities, Lease, LockError, LockKey, MAX_KEY_BYTES, Release, Renewal,
    VALIDITY_MARGIN,
};
use tokio::time::{Instant, timeout};

use super::release_held;
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome};

/// TTLs a backend with `caps` must refuse: zero, one a lease would be trusted for no
/// time at all (the validity margin itself), below the minimum, above the maximum, and
/// finer than the granularity (`ok` is a TTL it accepts).
pub(crate) fn bad_ttls(caps: &Capabilities, ok: Duration) -> Vec<Duration> {
    let mut bad = vec![Duration::ZERO, VALIDITY_MARGIN];
    let grain = caps.ttl_granularity;
    if let Some(below) = caps.min_ttl.checked_sub(grain.max(Duration::from_nanos(1)))
        && !below.is_zero()
    {
        bad.push(below);
    }
    if let Some(above) = caps.max_ttl.checked_add(grain.max(Duration::from_nanos(1))) {
        bad.push(above);
    }
    if grain > Duration::from_nanos(1) {
        bad.push(ok + grain / 2);
    }
    bad
}

/// `LockKey::new` refuses an empty key, one over 512 bytes and one with a control
/// character; a key of exactly 512 bytes works on the backend.
pub async fn invalid_keys_are_rejected(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("invalid_keys_are_rejected", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let too_long = "k".repeat(MAX_KEY_BYTES + 1);
    for (bad, what) in [
        ("", "an empty key"),
        (too_long.as_str(), "a key over 512 bytes"),
        ("job\n1", "a key with a newline"),
        ("job\u{7f}", "a key with DEL"),
    ] {
        let got = LockKey::new(bad);
        ctx.ensure(
            matches!(got, Err(LockError::InvalidKey { .. })),
            format!("{what} to be refused with InvalidKey"),
            || format!("{got:?}"),
        )?;
    }
    let base = ctx.key("max")?;
    let longest = format!(
        "{base}:{}",
        "x".repeat(MAX_KEY_BYTES - base.as_str().len() - 1)
    );
    let longest = ctx.ok("LockKey::new of 512 bytes", LockKey::new(longest))?;
    let lease = ctx.take(&a, &longest, t.ttl).await?;
    release_held(&ctx, &a, &lease).await?;
    ctx.pass(&t)
}

/// TTLs of zero, below the minimum, above the maximum or finer than the granularity are
/// InvalidTtl, for `acquire` and `acquire_many`, and leave the key free.
pub async fn invalid_ttls_change_nothing(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("invalid_ttls_change_nothing", factory);
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    for bad in bad_ttls(&a.capabilities(), t.ttl) {
        let got = a.acquire(&key, bad).await;
        ctx.ensure(
            matches!(got, Err(LockError::InvalidTtl { ttl, .. }) if ttl == bad),
            format!("acquire with TTL {bad:?} to fail with InvalidTtl"),
            || format!("{got:?}"),
        )?;
        let many = a.acquire_many(std::slice::from_ref(&key), bad).await;
        ctx.ensure(
            matches!(many, Err(LockError::InvalidTtl { .. })),
            format!("acquire_many with TTL {bad:?} to fail with InvalidTtl"),
            || format!("{many:?}"),
        )?;
    }
    let lease = ctx.take(&a, &key, t.ttl).await?;
    release_held(&ctx, &a, &lease).await?;
    ctx.pass(&t)
}

/// A lease from another backend instance is ForeignLease for release, renew and fence
/// (single and batch), and changes nothing.
pub async fn foreign_lease_is_refused(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("foreign_lease_is_refused", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    let lease = ctx.take(&a, &key, t.ttl).await?;
    // What a lease granted by another instance looks like: everything equal but the
    // instance that granted it.
    let foreign = Lease::new(
        BackendId::next(),
        key.clone(),
        lease.owner(),
        lease.token(),
        lease.ttl(),
        lease.valid_until(),
    );
    let refused = |what: &str, e: Option<&LockError>| {
        ctx.ensure(
            matches!(e, Some(LockError::ForeignLease { .. })),
            format!("{what} of a foreign lease to fail with ForeignLease"),
            || format!("{e:?}"),
        )
    };
    refused("release", a.release(&foreign).await.err().as_ref())?;
    refused("renew", a.renew(&foreign).await.err().as_ref())?;
    refused("fence", a.fence(&foreign).await.err().as_ref())?;
    let batch = std::slice::from_ref(&foreign);
    refused("release_many", a.release_many(batch).await.err().as_ref())?;
    refused("renew_many", a.renew_many(batch).await.err().as_ref())?;
    // A batch is checked whole before anything is done: the own lease before the foreign
    // one is neither released nor renewed.
    let mixed = [lease.clone(), foreign.clone()];
    refused(
        "release_many of [own, foreign]",
        a.release_many(&mixed).await.err().as_ref(),
    )?;
    refused(
        "renew_many of [own, foreign]",
        a.renew_many(&mixed).await.err().as_ref(),
    )?;
    ctx.expect_held(
        &b,
        &key,
        t.ttl,
        "only batches holding a foreign lease were sent",
    )
    .await?;

    release_held(&ctx, &a, &lease).await?;
    ctx.pass(&t)
}

/// Where every client is its own backend instance, a real lease of one is ForeignLease
/// to another, and the instance that granted it still renews and releases it.
pub async fn leases_stay_with_their_client(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("leases_stay_with_their_client", factory);
    let (a, b) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&a);
    let theirs = ctx.take(&b, &ctx.key("k")?, t.ttl).await?;
    for (what, got) in [
        ("release", a.release(&theirs).await.err()),
        ("renew", a.renew(&theirs).await.err()),
        ("fence", a.fence(&theirs).await.err()),
    ] {
        ctx.ensure(
            matches!(got, Some(LockError::ForeignLease { .. })),
            format!("{what} of another client's lease to fail with ForeignLease"),
            || format!("{got:?}"),
        )?;
    }
    let renewal = ctx.ok("renew by the granting client", b.renew(&theirs).await)?;
    ctx.ensure(
        matches!(renewal, Renewal::Renewed { .. }),
        "the instance that granted it to renew it",
        || format!("{renewal:?}"),
    )?;
    release_held(&ctx, &b, &theirs).await?;
    ctx.pass(&t)
}

/// With the link cut, an acquire of a free key neither reports a lease it cannot prove
/// nor says the key is held (`Ok(None)`: nobody else asked for it); it hangs or fails.
/// The key is free again within the TTL after the link heals.
pub async fn lost_reply_is_not_a_lease(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new("lost_reply_is_not_a_lease", factory);
    let link = ctx.link()?;
    ctx.with_faults();
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let key = ctx.key("k")?;
    link.cut().await;
    let got = timeout(t.ttl * 2, a.acquire(&key, t.ttl)).await;
    link.heal().await;
    let healed = Instant::now();
    match &got {
        Ok(Ok(Some(lease))) => {
            let _ = a.release(lease).await;
            return Err(ctx.fail(
                "no lease from an acquire whose request or reply was cut off",
                format!("a lease with token {}", lease.token()),
            ));
        }
        Ok(Ok(None)) => {
            return Err(ctx.fail(
                "an error or no answer from an acquire of a free key whose request or reply \
                 was cut off",
                "Ok(None): the key reported held by someone else",
            ));
        }
        Ok(Err(_)) | Err(_) => {}
    }
    let b = ctx.client().await;
    let next = ctx
        .take_by(
            &b,
            &key,
            t.ttl,
            t.expired_by(healed),
            "within the TTL after the heal",
        )
        .await?;
    release_held(&ctx, &b, &next).await?;
    ctx.pass(&t)
}

/// With a slow link, a grant's and a renewal's validity count from the instant the
/// request was sent, not from when the reply arrived.
///
/// The renewed lease is taken before the link slows down, with a long TTL: a backend that
/// needs several round trips for one call (a pool's liveness check, a statement prepared
/// on first use) still renews it while it is held.
pub async fn validity_counts_from_the_send_instant(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("validity_counts_from_the_send_instant", factory);
    let link = ctx.link()?;
    let a = ctx.client().await;
    let t = ctx.timing(&a);
    let long_ttl = t.long_ttl;
    let renewed_key = ctx.key("renewed")?;
    let held = ctx.take(&a, &renewed_key, long_ttl).await?;
    let key = ctx.key("k")?;
    let delay = t.ttl / 5;
    link.delay(delay).await;
    let renewal = a.renew(&held).await;
    let renew_replied = Instant::now();
    let granted = a.acquire(&key, t.ttl).await;
    let replied = Instant::now();
    link.heal().await;
    let lease = match ctx.ok("acquire over a slow link", granted)? {
        Some(lease) => lease,
        None => return Err(ctx.fail("a grant of a free key", "Ok(None)")),
    };
    // The request reached the store at least `delay` before its reply came back, so a
    // validity counted from the send instant ends by `reply - delay + TTL` whatever the
    // machine's load; counted from the reply, it overshoots that by the delay.
    ctx.ensure(
        lease.valid_until() <= replied - delay + t.ttl,
        "the grant's valid_until at most its reply, less the link's delay, plus the TTL",
        || {
            format!(
                "{:?} past it",
                lease.valid_until() - (replied - delay + t.ttl)
            )
        },
    )?;
    match ctx.ok("renew over a slow link", renewal)? {
        Renewal::Renewed { valid_until } => ctx.ensure(
            valid_until <= renew_replied - delay + long_ttl,
            "the renewal's valid_until at most its reply, less the link's delay, plus the TTL",
            || {
                format!(
                    "{:?} past it",
                    valid_until - (renew_replied - delay + long_ttl)
                )
            },
        )?,
        other => return Err(ctx.fail("a held lease to renew", format!("{other:?}"))),
    }
    let released = ctx.ok("release", a.release(&lease).await)?;
    ctx.ensure(
        released == Release::Released,
        "the lease to be released",
        || format!("{released:?}"),
    )?;
    release_held(&ctx, &a, &held).await?;
    ctx.pass(&t)
}
