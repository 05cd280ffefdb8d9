//! Cases on cancellation: every public async call of a backend and of [`Locker`] dropped
//! after its 1st, 2nd, 3rd … poll, until a run completes, and a backend shared by two
//! tokio runtimes, one of which shuts down in the middle of a call.
//!
//! A call is polled by hand with a pause between polls, so its I/O moves on between
//! them: the cut points fall before anything is sent, after a request went out, and
//! after its reply came back. After each cut ([`after_the_cut`]):
//! - no key is held by nobody for longer than its TTL: another client takes it by the
//!   TTL plus the suite's expiry slack, counted from the cut;
//! - the backend serves the next call: an acquire and release of another key works
//!   within a bound (a hang or an error fails);
//! - no connection still holds a lock behind the caller's back (a session lock left on a
//!   pooled connection): while another client holds the key the first client never gets
//!   it, and once that client releases it the first client gets it every time, round
//!   after round, whichever pooled connection serves it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use lock_api::{LockBackend, LockKey, Locker, Release, Renewal};
use tokio::time::{Instant, sleep, timeout};

use super::locker::locker;
use super::release_held;
use crate::factory::Factory;
use crate::history::{Op, Reply};
use crate::suite::{Ctx, Failure, Outcome, Timing};

/// The pause between two polls of a call: long enough for a reply to arrive.
const BETWEEN_POLLS: Duration = Duration::from_millis(2);

/// A call that needs more polls than this to complete is stuck.
const MAX_POLLS: usize = 500;

/// How many keys the batch forms are given: two, so a backend that pins a connection per
/// lease has room for the other client's leases and the probe in a small pool.
const BATCH: usize = 2;

/// How many rounds the first client tries a key another client holds, and then takes and
/// releases it: more than the connections of a small pool, so each of them serves one.
const ROUNDS: usize = 6;

/// The bound on the next call after a cut (an acquire and release of another key): far
/// above a round trip, to tell a backend that hangs or waits out a timeout.
fn served_within(t: &Timing) -> Duration {
    t.ttl * 2 + Duration::from_secs(2)
}

/// Polls `call` at most `polls` times, with [`BETWEEN_POLLS`] between polls, and drops it
/// there; its output if it completed by then.
async fn cut_after<F: Future>(call: F, polls: usize) -> Option<F::Output> {
    let mut call = std::pin::pin!(call);
    for polled in 0..polls {
        if polled > 0 {
            sleep(BETWEEN_POLLS).await;
        }
        if let Poll::Ready(output) = futures::poll!(call.as_mut()) {
            return Some(output);
        }
    }
    None
}

/// The failure of a call that never completed.
fn never_completed(ctx: &Ctx<'_>, what: &str) -> Failure {
    ctx.fail(
        format!("{what} to complete within {MAX_POLLS} polls"),
        "still pending",
    )
}

/// The keys of the cut after `polls` polls.
fn cut_keys(ctx: &Ctx<'_>, polls: usize, count: usize) -> Result<Vec<LockKey>, Failure> {
    (0..count)
        .map(|i| ctx.key(&format!("cut-{polls}-{i}")))
        .collect()
}

/// Records that the owner gave up the newest grant of `key` at `at` (a release that was
/// dropped, whose outcome nobody saw): its validity window ends there, so the checker
/// does not take a later holder for an overlap.
fn record_given_up(ctx: &Ctx<'_>, key: &LockKey, at: Instant, what: &str) {
    if let Some(grant) = ctx.history().grants(key).last() {
        ctx.history().record(
            Op::Release,
            key,
            grant.owner,
            grant.token,
            grant.ttl,
            at,
            None,
            Reply::Error(format!("{what} dropped before it completed")),
        );
    }
}

/// An acquire and release of `probe` on `client`, within [`served_within`].
async fn serves(
    ctx: &Ctx<'_>,
    t: &Timing,
    client: &Arc<dyn LockBackend>,
    probe: &LockKey,
    what: &str,
) -> Result<(), Failure> {
    let bound = served_within(t);
    let cycle = async {
        let lease = ctx.take(client, probe, t.ttl).await?;
        release_held(ctx, client, &lease).await
    };
    match timeout(bound, cycle).await {
        Ok(result) => result,
        Err(_) => Err(ctx.fail(
            format!("an acquire and release of another key within {bound:?} after {what}"),
            "still pending",
        )),
    }
}

/// The checks after `what` was dropped at `cut`, having touched `keys`: `other` takes
/// every key by the TTL plus slack while `first` keeps serving an acquire and release of
/// `probe`; then `first` never gets a key `other` holds, and gets each one every round
/// after `other` released it.
#[allow(clippy::too_many_arguments)]
async fn after_the_cut(
    ctx: &Ctx<'_>,
    t: &Timing,
    first: &Arc<dyn LockBackend>,
    other: &Arc<dyn LockBackend>,
    probe: &LockKey,
    keys: &[LockKey],
    cut: Instant,
    what: &str,
) -> Result<(), Failure> {
    let deadline = t.expired_by(cut);
    // All keys are taken in one round, so none of the other client's leases runs out
    // while it waits for the rest.
    let taken = loop {
        serves(ctx, t, first, probe, what).await?;
        let mut taken = Vec::with_capacity(keys.len());
        for key in keys {
            match ctx.ok("acquire", other.acquire(key, t.ttl).await)? {
                Some(lease) => taken.push(lease),
                None => break,
            }
        }
        if taken.len() == keys.len() {
            break taken;
        }
        let key = &keys[taken.len()];
        for lease in &taken {
            release_held(ctx, other, lease).await?;
        }
        if Instant::now() >= deadline {
            return Err(ctx.fail(
                format!(
                    "{key} free by its TTL plus {:?} after {what} (nobody holds it longer)",
                    t.expiry_slack
                ),
                format!("still held {:?} after the cut", cut.elapsed()),
            ));
        }
        sleep(Duration::from_millis(10)).await;
    };
    for _ in 0..ROUNDS {
        for key in keys {
            ctx.expect_held(first, key, t.ttl, "another client took it after the cut")
                .await?;
        }
        // Renewed each round, so the other client holds them however slow the rounds are.
        for lease in &taken {
            let renewed = ctx.ok("renew", other.renew(lease).await)?;
            ctx.ensure(
                matches!(renewed, Renewal::Renewed { .. }),
                "the other client's renewal of its lease to be Renewed",
                || format!("{renewed:?}"),
            )?;
        }
    }
    for lease in &taken {
        release_held(ctx, other, lease).await?;
    }
    for _ in 0..ROUNDS {
        for key in keys {
            let lease = ctx.take(first, key, t.ttl).await?;
            release_held(ctx, first, &lease).await?;
        }
    }
    Ok(())
}

/// An acquire dropped at any poll leaves no lease behind for longer than its TTL, and
/// the backend serves the next call.
pub async fn dropped_acquire_leaves_no_orphan(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_acquire_leaves_no_orphan", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        match cut_after(first.acquire(&keys[0], t.ttl), polls).await {
            Some(granted) => {
                let lease = ctx.ok("acquire", granted)?.ok_or_else(|| {
                    ctx.fail("the acquire of a free key to grant a lease", "Ok(None)")
                })?;
                release_held(&ctx, &first, &lease).await?;
                return ctx.pass(&t);
            }
            None => {
                let what = format!("an acquire dropped after {polls} poll(s)");
                after_the_cut(
                    &ctx,
                    &t,
                    &first,
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
    Err(never_completed(&ctx, "acquire"))
}

/// A renew dropped at any poll leaves the lease with its owner: releasing it is the next
/// call, and it frees the key.
pub async fn dropped_renew_keeps_the_lease(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_renew_keeps_the_lease", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let lease = ctx.take(&first, &keys[0], t.ttl).await?;
        let renewed = cut_after(first.renew(&lease), polls).await;
        let completed = renewed.is_some();
        if let Some(renewed) = renewed {
            let renewed = ctx.ok("renew", renewed)?;
            ctx.ensure(
                matches!(renewed, Renewal::Renewed { .. }),
                "the renewal of a held lease to be Renewed",
                || format!("{renewed:?}"),
            )?;
        }
        release_held(&ctx, &first, &lease).await?;
        let what = format!("a renew dropped after {polls} poll(s)");
        after_the_cut(
            &ctx,
            &t,
            &first,
            &other,
            &probe,
            &keys,
            Instant::now(),
            &what,
        )
        .await?;
        if completed {
            return ctx.pass(&t);
        }
    }
    Err(never_completed(&ctx, "renew"))
}

/// A release dropped at any poll, its lease then given up, leaves the key held no longer
/// than its TTL.
pub async fn dropped_release_frees_the_key_by_its_ttl(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_release_frees_the_key_by_its_ttl", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, 1)?;
        let lease = ctx.take(&first, &keys[0], t.ttl).await?;
        let released = cut_after(first.release(&lease), polls).await;
        let completed = released.is_some();
        let cut = Instant::now();
        drop(lease);
        let what = format!("a release dropped after {polls} poll(s)");
        match released {
            Some(released) => {
                let released = ctx.ok("release", released)?;
                ctx.ensure(
                    released == Release::Released,
                    "the release of a held lease to be Released",
                    || format!("{released:?}"),
                )?;
            }
            None => record_given_up(&ctx, &keys[0], cut, "release"),
        }
        after_the_cut(&ctx, &t, &first, &other, &probe, &keys, cut, &what).await?;
        if completed {
            return ctx.pass(&t);
        }
    }
    Err(never_completed(&ctx, "release"))
}

/// An `acquire_many` dropped at any poll leaves no lease behind for longer than its TTL.
pub async fn dropped_acquire_many_leaves_no_orphan(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_acquire_many_leaves_no_orphan", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, BATCH)?;
        match cut_after(first.acquire_many(&keys, t.ttl), polls).await {
            Some(granted) => {
                let granted = ctx.ok("acquire_many", granted)?;
                let leases: Vec<_> = granted.into_iter().flatten().collect();
                ctx.ensure(
                    leases.len() == BATCH,
                    format!("acquire_many of {BATCH} free keys to grant them all"),
                    || format!("{} granted", leases.len()),
                )?;
                for lease in &leases {
                    release_held(&ctx, &first, lease).await?;
                }
                return ctx.pass(&t);
            }
            None => {
                let what = format!("an acquire_many dropped after {polls} poll(s)");
                after_the_cut(
                    &ctx,
                    &t,
                    &first,
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
    Err(never_completed(&ctx, "acquire_many"))
}

/// A `renew_many` dropped at any poll leaves the leases with their owner: releasing them
/// is the next call, and it frees the keys.
pub async fn dropped_renew_many_keeps_the_leases(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_renew_many_keeps_the_leases", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, BATCH)?;
        let mut leases = Vec::with_capacity(BATCH);
        for key in &keys {
            leases.push(ctx.take(&first, key, t.ttl).await?);
        }
        let renewed = cut_after(first.renew_many(&leases), polls).await;
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
            release_held(&ctx, &first, lease).await?;
        }
        let what = format!("a renew_many dropped after {polls} poll(s)");
        after_the_cut(
            &ctx,
            &t,
            &first,
            &other,
            &probe,
            &keys,
            Instant::now(),
            &what,
        )
        .await?;
        if completed {
            return ctx.pass(&t);
        }
    }
    Err(never_completed(&ctx, "renew_many"))
}

/// A `release_many` dropped at any poll, its leases then given up, leaves no key held
/// longer than its TTL.
pub async fn dropped_release_many_frees_the_keys_by_their_ttl(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("dropped_release_many_frees_the_keys_by_their_ttl", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let probe = ctx.key("probe")?;
    for polls in 1..=MAX_POLLS {
        let keys = cut_keys(&ctx, polls, BATCH)?;
        let mut leases = Vec::with_capacity(BATCH);
        for key in &keys {
            leases.push(ctx.take(&first, key, t.ttl).await?);
        }
        let released = cut_after(first.release_many(&leases), polls).await;
        let completed = released.is_some();
        let cut = Instant::now();
        drop(leases);
        let what = format!("a release_many dropped after {polls} poll(s)");
        match released {
            Some(released) => {
                let released = ctx.ok("release_many", released)?;
                ctx.ensure(
                    released.iter().all(|r| *r == Release::Released),
                    "release_many of held leases to release them all",
                    || format!("{released:?}"),
                )?;
            }
            None => {
                for key in &keys {
                    record_given_up(&ctx, key, cut, "release_many");
                }
            }
        }
        after_the_cut(&ctx, &t, &first, &other, &probe, &keys, cut, &what).await?;
        if completed {
            return ctx.pass(&t);
        }
    }
    Err(never_completed(&ctx, "release_many"))
}

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

/// A client and a [`Locker`] used from two tokio runtimes: the first use of both is on
/// runtime A, a guard is taken on B, and A shuts down while it is running calls. The
/// watchdog starts again on B by itself: both guards stay renewed for two TTLs with no new
/// lock taken. Then calls on B work at once (the guard taken on B is released, the key A
/// was using is free by its TTL), and the guard taken on A stays renewed on B for three
/// TTLs more.
pub async fn runtime_shutdown_spares_the_other_runtime(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("runtime_shutdown_spares_the_other_runtime", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let locker = locker(&ctx, first.clone(), &t)?;
    let (on_a, on_b, busy, after) = (
        ctx.key("guard-on-a")?,
        ctx.key("guard-on-b")?,
        ctx.key("busy-on-a")?,
        ctx.key("guard-after")?,
    );
    let runtime_a = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| ctx.fail("a second tokio runtime", e))?;

    let (l, key) = (locker.clone(), on_a.clone());
    let taken_on_a = runtime_a.spawn(async move { l.lock(&key).await }).await;
    let taken_on_a = taken_on_a.map_err(|e| ctx.fail("the lock on runtime A to finish", e))?;
    let guard_a = ctx.ok("lock on runtime A", taken_on_a)?;
    let guard_b = ctx.ok("lock on runtime B", locker.lock(&on_b).await)?;

    // Runtime A keeps a call in flight nearly all the time; it shuts down after two
    // cycles, so in the middle of one.
    let cycles = Arc::new(AtomicUsize::new(0));
    let (client, key, count) = (first.clone(), busy.clone(), cycles.clone());
    let ttl = t.ttl;
    runtime_a.spawn(async move {
        loop {
            if let Ok(Some(lease)) = client.acquire(&key, ttl).await {
                let _ = client.release(&lease).await;
            }
            count.fetch_add(1, Ordering::SeqCst);
            // A store that answers at once (in memory) must still let the runtime stop.
            tokio::task::yield_now().await;
        }
    });
    let started = Instant::now();
    while cycles.load(Ordering::SeqCst) < 2 {
        if started.elapsed() > served_within(&t) {
            return Err(ctx.fail(
                "two acquire and release cycles on runtime A",
                format!(
                    "{} after {:?}",
                    cycles.load(Ordering::SeqCst),
                    started.elapsed()
                ),
            ));
        }
        sleep(Duration::from_millis(1)).await;
    }
    // Shut down from a blocking thread, which waits until A's workers dropped its tasks
    // (the watchdog's task among them): only then is A gone for good.
    let bound = served_within(&t);
    tokio::task::spawn_blocking(move || runtime_a.shutdown_timeout(bound))
        .await
        .map_err(|e| ctx.fail("runtime A to shut down", e))?;
    let cut = Instant::now();
    let what = "runtime A shut down in the middle of a call";
    record_given_up(&ctx, &busy, cut, "the call on runtime A");

    // Nothing new is locked yet: only a watchdog that started again on B by itself keeps
    // these guards.
    let until = Instant::now() + t.ttl * 2;
    while Instant::now() < until {
        sleep(t.ttl / 4).await;
        for guard in [&guard_a, &guard_b] {
            ctx.ensure(
                guard.is_held(),
                format!(
                    "the guard of {} to stay held after runtime A shut down, with no new lock",
                    guard.key()
                ),
                || "is_held() == false".to_owned(),
            )?;
            ctx.expect_held(&other, guard.key(), t.ttl, "renewed on B with no new lock")
                .await?;
        }
    }

    let guard_after = ctx.ok("lock on runtime B", locker.lock(&after).await)?;
    // Released on B at once: fewer leases held leaves room in a backend with a small
    // bound on held leases for the checks after the cut.
    let released = ctx.ok("guard release", guard_b.release().await)?;
    ctx.ensure(
        released == Release::Released,
        "the release on B of the guard taken on B to be Released",
        || format!("{released:?}"),
    )?;
    let probe = ctx.key("probe")?;
    after_the_cut(&ctx, &t, &first, &other, &probe, &[busy], cut, what).await?;
    let guards = [guard_a, guard_after];
    let until = Instant::now() + t.ttl * 3;
    while Instant::now() < until {
        sleep(t.ttl / 4).await;
        for guard in &guards {
            ctx.ensure(
                guard.is_held(),
                format!(
                    "the guard of {} to stay held, renewed on runtime B",
                    guard.key()
                ),
                || "is_held() == false".to_owned(),
            )?;
            ctx.expect_held(&other, guard.key(), t.ttl, "the watchdog renews it on B")
                .await?;
        }
    }
    for guard in guards {
        let key = guard.key().clone();
        let released = ctx.ok("guard release", guard.release().await)?;
        ctx.ensure(
            released == Release::Released,
            format!("the release of the guard of {key} to be Released"),
            || format!("{released:?}"),
        )?;
    }
    ctx.pass(&t)
}
