//! A backend and a [`Locker`] shared by two tokio runtimes, one of which shuts down in the
//! middle of a call.
//!
//! [`Locker`]: distlock_core::Locker

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::Release;
use tokio::time::{Instant, sleep};

use super::{after_the_cut, record_given_up, served_within};
use crate::cases::locker::locker;
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing};

/// A client and a [`Locker`] used from two tokio runtimes: the first use of both is on
/// runtime A, a guard is taken on B, and A shuts down while it is running calls. The
/// watchdog starts again on B by itself: both guards stay renewed for two TTLs with no new
/// lock taken. Then calls on B work at once (the guard taken on B is released, the key A
/// was using is free by its TTL), and the guard taken on A stays renewed on B for three
/// TTLs more. The guards' TTL is [`Timing::renewed_ttl`](crate::suite::Timing::renewed_ttl):
/// only a watchdog that stops renewing loses them.
///
/// [`Locker`]: distlock_core::Locker
pub async fn runtime_shutdown_spares_the_other_runtime(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("runtime_shutdown_spares_the_other_runtime", factory);
    let (first, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&first);
    let renewed = Timing {
        ttl: t.renewed_ttl,
        ..t.clone()
    };
    let locker = locker(&ctx, first.clone(), &renewed)?;
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
    let until = Instant::now() + renewed.ttl * 2;
    while Instant::now() < until {
        sleep(renewed.ttl / 4).await;
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
    let until = Instant::now() + renewed.ttl * 3;
    while Instant::now() < until {
        sleep(renewed.ttl / 4).await;
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
