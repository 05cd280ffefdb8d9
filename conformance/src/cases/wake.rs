//! Cases on waiters woken by releases ([`distlock_core::Capabilities::wakes_waiters`]): a
//! release wakes a waiter long before its backoff would, and a resignation a campaigning
//! standby; a waiter whose wake is lost still takes the key by its backoff, and a
//! cancelled waiter leaves no subscription.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Election, Layered, LockBackend, LockError, Locker, Release, RetryPolicy};
use tokio::time::{Instant, sleep};

use super::locker::locker_on;
use crate::deaf::Deaf;
use crate::factory::Factory;
use crate::history::{Op, Reply};
use crate::support::{Ctx, Failure, Outcome};

/// A backoff far longer than a woken handoff takes, so a waiter that polls is obvious.
pub(super) const LONG_BACKOFF: Duration = Duration::from_secs(8);
/// How soon after the release a woken waiter must hold the key, on a loaded machine.
pub(super) const WOKEN_WITHIN: Duration = Duration::from_millis(1_500);
/// How long the waiter is given to start waiting before the holder lets go.
const SETTLE: Duration = Duration::from_millis(200);

/// A locker on `client` that waits `backoff` between attempts.
pub(super) fn waiting_locker(
    ctx: &Ctx<'_>,
    client: Arc<dyn LockBackend>,
    ttl: Duration,
    backoff: Duration,
) -> Result<Locker, Failure> {
    let retry = RetryPolicy {
        initial: backoff,
        max: backoff,
    };
    locker_on(ctx, client, ttl, retry, Some(backoff * 4))
}

/// A holder on one client, a waiter in `Locker::lock` on another with an 8 s backoff:
/// the holder's release wakes the waiter, which holds the key within 1.5 s.
pub async fn a_release_wakes_a_waiter(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("a_release_wakes_a_waiter", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    // The holder's lease outlives the wait, so only its release can free the key.
    let key = ctx.key("woken")?;
    let held = ctx.take(&holder, &key, t.long_ttl).await?;
    let client = ctx.client().await;
    // A wrapper that forwards the capabilities but not the watch claims to wake waiters
    // while they poll: say so plainly rather than by the slow handoff alone.
    ctx.ensure(
        client.watch_releases(&key).is_some(),
        "a backend whose capabilities say it wakes waiters to return a watch of the key",
        || "watch_releases returned None".to_owned(),
    )?;
    let waiter = waiting_locker(&ctx, client, t.ttl, LONG_BACKOFF)?;
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move {
            let guard = waiter.lock(&key).await?;
            let granted = Instant::now();
            guard.release().await?;
            Ok::<_, LockError>(granted)
        })
    };
    sleep(SETTLE).await;
    let released_at = Instant::now();
    super::release_held(&ctx, &holder, &held).await?;
    let granted = ctx.ok("the waiter's lock()", joined(&ctx, waiting).await?)?;
    let after = granted.saturating_duration_since(released_at);
    ctx.ensure(
        after <= WOKEN_WITHIN,
        format!("the waiter to hold the key within {WOKEN_WITHIN:?} of the release (its backoff is {LONG_BACKOFF:?})"),
        || format!("it took {after:?}"),
    )?;
    ctx.pass(&t)
}

/// A leader resigns while a standby on another client campaigns with an 8 s backoff: the
/// resignation's release wakes the standby, which leads within 1.5 s. A campaign that
/// polls would wait out its backoff.
pub async fn a_resignation_wakes_a_campaigning_standby(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("a_resignation_wakes_a_campaigning_standby", factory);
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    // The leader's lease outlives the wait, so only its resignation can free the role.
    let ttl = t.long_ttl;
    let key = ctx.key("role")?;
    let campaigner = |client: Arc<dyn LockBackend>| -> Result<Election, Failure> {
        let locker = waiting_locker(&ctx, client, ttl, LONG_BACKOFF)?;
        ctx.ok(
            "Election::builder(..).build()",
            Election::builder(locker, "conformance")
                .key(key.clone())
                .retry(RetryPolicy {
                    initial: LONG_BACKOFF,
                    max: LONG_BACKOFF,
                })
                .build(),
        )
    };
    let leader = campaigner(first)?;
    let standby = campaigner(ctx.client().await)?;
    let leading = ctx.ok("campaign of the only campaigner", leader.campaign().await)?;
    let waiting = tokio::spawn(async move {
        let leadership = standby.campaign().await?;
        let elected = Instant::now();
        leadership.resign().await?;
        Ok::<_, LockError>(elected)
    });
    sleep(SETTLE).await;
    let resigned_at = Instant::now();
    let resigned = ctx.ok("the leader's resign", leading.resign().await)?;
    ctx.ensure(
        resigned == Release::Released,
        "the leader to resign with Released",
        || format!("{resigned:?}"),
    )?;
    let elected = ctx.ok("the standby's campaign", joined(&ctx, waiting).await?)?;
    let after = elected.saturating_duration_since(resigned_at);
    ctx.ensure(
        after <= WOKEN_WITHIN,
        format!(
            "the standby to lead within {WOKEN_WITHIN:?} of the resignation (its backoff is \
             {LONG_BACKOFF:?})"
        ),
        || format!("it took {after:?}"),
    )?;
    ctx.pass(&t)
}

/// The same wait with the wake lost on the way (the waiter's watch never fires): the
/// waiter still takes the key, at its next attempt after the backoff.
pub async fn a_waiter_whose_wake_is_lost_still_acquires(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    const BACKOFF: Duration = Duration::from_millis(300);
    let ctx = Ctx::new("a_waiter_whose_wake_is_lost_still_acquires", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let key = ctx.key("wake-lost")?;
    let held = ctx.take(&holder, &key, t.long_ttl).await?;
    let deaf = Arc::new(Layered::new(ctx.client().await, Deaf::default()));
    let waiter = waiting_locker(&ctx, deaf, t.ttl, BACKOFF)?;
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move {
            let guard = waiter.lock(&key).await?;
            guard.release().await?;
            Ok::<_, LockError>(())
        })
    };
    sleep(SETTLE).await;
    super::release_held(&ctx, &holder, &held).await?;
    ctx.ok("the deaf waiter's lock()", joined(&ctx, waiting).await?)?;
    ctx.pass(&t)
}

/// A waiter cancelled while it waits: the backend watched the key while it waited, and
/// watches nothing once it is gone.
pub async fn a_cancelled_waiter_leaves_no_subscription(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("a_cancelled_waiter_leaves_no_subscription", factory);
    let holder = ctx.client().await;
    let t = ctx.timing(&holder);
    let key = ctx.key("cancelled")?;
    let held = ctx.take(&holder, &key, t.long_ttl).await?;
    let client = ctx.client().await;
    let waiter = waiting_locker(&ctx, client.clone(), t.ttl, LONG_BACKOFF)?;
    let waiting = {
        let key = key.clone();
        tokio::spawn(async move { waiter.lock(&key).await.map(drop) })
    };
    // The waiter watches the key from before its first attempt (`Locker::lock`'s
    // contract): once the history shows that attempt refused, the watch is there, however
    // late a loaded machine ran the waiting task. A fixed pause was not always enough.
    refused_once(&ctx, &key).await?;
    let watched = client.watched_keys();
    ctx.ensure(
        watched.contains(&key),
        format!("the waiting client to watch {key}"),
        || format!("it watches {watched:?}"),
    )?;
    waiting.abort();
    let _ = waiting.await;
    let watched = client.watched_keys();
    ctx.ensure(
        !watched.contains(&key),
        format!("no watch of {key} once its waiter was cancelled"),
        || format!("it still watches {watched:?}"),
    )?;
    super::release_held(&ctx, &holder, &held).await?;
    ctx.pass(&t)
}

/// Waits until the history shows an acquire of `key` refused (the key held by another):
/// a waiter's first attempt. It goes out at once and the next not before
/// [`LONG_BACKOFF`], so none within that time is a waiter that never tried.
async fn refused_once(ctx: &Ctx<'_>, key: &distlock_core::LockKey) -> Result<(), Failure> {
    let started = Instant::now();
    let refused = || {
        ctx.history()
            .events()
            .iter()
            .any(|e| e.op == Op::Acquire && &e.key == key && e.reply == Reply::Busy)
    };
    while !refused() {
        if started.elapsed() >= LONG_BACKOFF {
            return Err(ctx.fail(
                format!("the waiter's first attempt on {key} within {LONG_BACKOFF:?}"),
                "no refused acquire recorded",
            ));
        }
        sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

async fn joined<T>(ctx: &Ctx<'_>, task: tokio::task::JoinHandle<T>) -> Result<T, Failure> {
    task.await
        .map_err(|e| ctx.fail("the waiting task to finish", e))
}
