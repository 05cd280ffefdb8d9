//! Cases on [`Locker`] and [`distlock_core::LockGuard`] over the backend: contention, the
//! watchdog, loss handling and builder validation.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    BackendLayer, Fence, FencingToken, Layered, Lease, LockBackend, LockError, LockKey, Locker,
    Renewal, RetryPolicy,
};
use futures::future::join_all;
use tokio::time::{Instant, sleep, timeout_at};

use super::{guard_released, release_held};
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, Timing};

/// How long a case waits past a deadline for a local event (a timer firing, a task
/// being scheduled), beyond how late a [`ControlTimer`] for that deadline fired.
const LOCAL_SLACK: Duration = Duration::from_millis(150);

/// A timer set on the case's runtime for a deadline, beside the local event the case
/// waits for. How late it fires is how late the runtime ran anything at that moment (a
/// loaded machine delays every timer alike: one run saw 178 ms), so the case bounds the
/// event by when the control timer fired plus [`LOCAL_SLACK`], not by a fixed slack
/// alone; an event that waits for something else (a renewal's timeout, a store's reply)
/// still comes far later than the control.
struct ControlTimer {
    deadline: Instant,
    fired: tokio::task::JoinHandle<Instant>,
}

impl ControlTimer {
    fn at(deadline: Instant) -> Self {
        let fired = tokio::spawn(async move {
            tokio::time::sleep_until(deadline).await;
            Instant::now()
        });
        Self { deadline, fired }
    }

    /// The latest a local event due at the deadline may come.
    async fn bound(self) -> Instant {
        let fired = self.fired.await.unwrap_or(self.deadline);
        fired.max(self.deadline) + LOCAL_SLACK
    }
}

/// How long a suite locker waits for a key before it gives up: far beyond any case's
/// deadline, so that only a wait that never ends hits it.
pub(super) const GENEROUS_WAIT: Duration = Duration::from_secs(60);

/// Fast retries: a wait polls every 1 ms at first, growing to 20 ms.
const FAST_RETRIES: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(1),
    max: Duration::from_millis(20),
};

/// A locker on `client` with the case TTL, fast retries and a generous wait.
pub(super) fn locker(
    ctx: &Ctx<'_>,
    client: Arc<dyn LockBackend>,
    t: &Timing,
) -> Result<Locker, Failure> {
    locker_on(ctx, client, t.ttl, FAST_RETRIES, Some(GENEROUS_WAIT))
}

/// A locker on `client` whose leases last `ttl`, whose waits back off by `retry` and give
/// up after `wait` (`None`: never); a builder error fails the case.
pub(super) fn locker_on(
    ctx: &Ctx<'_>,
    client: Arc<dyn LockBackend>,
    ttl: Duration,
    retry: RetryPolicy,
    wait: Option<Duration>,
) -> Result<Locker, Failure> {
    ctx.ok(
        "Locker::builder(..).build()",
        Locker::builder(client)
            .ttl(ttl)
            .retry(retry)
            .wait_timeout(wait)
            .build(),
    )
}

/// `other` takes `key`, which was just released, with a token above `token`, and releases it.
async fn next_token_above(
    ctx: &Ctx<'_>,
    other: &Arc<dyn LockBackend>,
    key: &LockKey,
    t: &Timing,
    token: FencingToken,
) -> Result<(), Failure> {
    // The long TTL, so a grant slow to come back is still held when released.
    let next = ctx.take(other, key, t.long_ttl).await?;
    ctx.ensure(
        next.token() > token,
        format!("a token above {token}"),
        || next.token(),
    )?;
    release_held(ctx, other, &next).await
}

/// `other` takes `key` by its TTL (plus slack) from now (`why`), and releases it.
async fn free_by_ttl(
    ctx: &Ctx<'_>,
    other: &Arc<dyn LockBackend>,
    key: &LockKey,
    t: &Timing,
    why: &str,
) -> Result<(), Failure> {
    let next = ctx
        .take_by(other, key, t.long_ttl, t.expired_by(Instant::now()), why)
        .await?;
    release_held(ctx, other, &next).await
}

/// 32 tasks on one key through `Locker::with_lock` run a read-modify-write on a fenced
/// counter: no update is lost, every write is admitted, and no two grants' validity
/// windows overlap (checked on the history).
pub async fn contention_loses_no_update(factory: &dyn Factory) -> Result<Outcome, Failure> {
    const TASKS: usize = 32;
    const ROUNDS: usize = 2;
    let ctx = Ctx::new("contention_loses_no_update", factory);
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    // No holder crashes or pauses here, so the leases outlast any renewal a loaded machine
    // delays: each hold reads and writes the store's fenced resource, and with the short
    // TTL a renewal late on a loaded three-member etcd cluster lost a lease mid-write.
    let held = Timing {
        ttl: t.long_ttl,
        ..t.clone()
    };
    let mut lockers = vec![locker(&ctx, first, &held)?];
    for _ in 1..4 {
        lockers.push(locker(&ctx, ctx.client().await, &held)?);
    }
    let key = ctx.key("counter")?;
    let counter = Arc::new(ctx.counter());
    let tasks = (0..TASKS).map(|i| {
        let locker = lockers[i % lockers.len()].clone();
        let key = key.clone();
        let counter = counter.clone();
        tokio::spawn(async move {
            let mut admitted = 0usize;
            for _ in 0..ROUNDS {
                let write = locker
                    .with_lock(&key, |guard| {
                        let token = guard.token();
                        let (key, counter) = (key.clone(), counter.clone());
                        async move {
                            let read = counter.read(&key).await?;
                            // Hold the lock across a suspension so overlapping holders
                            // would interleave their read and write.
                            sleep(Duration::from_millis(1)).await;
                            counter.write(&key, token, read, read + 1).await
                        }
                    })
                    .await??;
                if write.is_admitted() {
                    admitted += 1;
                }
            }
            Ok::<usize, LockError>(admitted)
        })
    });
    let mut admitted = 0;
    for joined in join_all(tasks).await {
        let result = joined.map_err(|e| ctx.fail("every worker task to finish", e))?;
        admitted += ctx.ok("with_lock", result)?;
    }
    let total = TASKS * ROUNDS;
    ctx.ensure(
        admitted == total,
        format!("all {total} writes admitted"),
        || format!("{admitted} admitted"),
    )?;
    let value = ctx.ok("read the counter", counter.read(&key).await)?;
    ctx.ensure(
        value == total as u64,
        format!("the counter at {total} (no lost update)"),
        || value,
    )?;
    let grants = ctx.history().grants(&key).len();
    ctx.ensure(grants == total, format!("{total} grants"), || grants)?;
    ctx.pass(&t)
}

/// The watchdog keeps a job running 3× its TTL alive: the guard stays held, nobody
/// else acquires the key, the token stays the store's current one. The TTL is
/// [`Timing::renewed_ttl`], so only a watchdog that stops renewing loses the lease.
pub async fn watchdog_keeps_long_job_alive(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("watchdog_keeps_long_job_alive", factory);
    let (client, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&client);
    let renewed = Timing {
        ttl: t.renewed_ttl,
        ..t.clone()
    };
    let locker = locker(&ctx, client, &renewed)?;
    let key = ctx.key("k")?;
    let Some(guard) = ctx.ok("try_lock", locker.try_lock(&key).await)? else {
        return Err(ctx.fail("try_lock of a free key to grant a guard", "Ok(None)"));
    };
    let token = guard.token();
    let until = Instant::now() + renewed.ttl * 3;
    while Instant::now() < until {
        sleep(renewed.ttl / 4).await;
        ctx.ensure(
            guard.is_held(),
            "the guard to stay held while renewed",
            || "is_held() == false".to_owned(),
        )?;
        ctx.expect_held(&other, &key, t.ttl, "the watchdog renews it")
            .await?;
    }
    let fence = ctx.ok("fence", locker.backend().fence(guard.lease()).await)?;
    ctx.ensure(
        fence == Fence::Current && guard.token() == token,
        format!("token {token} to stay Current after 3 TTLs"),
        || format!("{fence:?}, token {}", guard.token()),
    )?;
    guard_released(&ctx, guard.release().await)?;
    next_token_above(&ctx, &other, &key, &t, token).await?;
    ctx.pass(&t)
}

/// With the link cut, the watchdog reports the loss no later than the guard's
/// `valid_until` (plus scheduling slack): `lost()` resolves and `is_held()` is false.
pub async fn watchdog_reports_loss_by_valid_until(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new("watchdog_reports_loss_by_valid_until", factory);
    let link = ctx.link()?;
    ctx.with_faults();
    let client = ctx.client().await;
    let t = ctx.timing(&client);
    let locker = locker(&ctx, client, &t)?;
    let key = ctx.key("k")?;
    let Some(guard) = ctx.ok("try_lock", locker.try_lock(&key).await)? else {
        return Err(ctx.fail("try_lock of a free key to grant a guard", "Ok(None)"));
    };
    sleep(t.ttl / 2).await;
    link.cut().await;
    let cut_at = Instant::now();
    let control = ControlTimer::at(guard.valid_until());
    let lost = timeout_at(cut_at + t.ttl * 2 + Duration::from_secs(1), guard.lost()).await;
    let lost_at = Instant::now();
    link.heal().await;
    let valid = guard.valid_until();
    let bound = control.bound().await.max(valid + LOCAL_SLACK);
    ctx.ensure(
        lost.is_ok(),
        "lost() to resolve once the link is cut",
        || format!("still pending {:?} after the cut", lost_at - cut_at),
    )?;
    ctx.ensure(
        !guard.is_held(),
        "is_held() to be false after the loss",
        || "is_held() == true",
    )?;
    ctx.ensure(
        lost_at <= bound,
        format!("the loss reported by valid_until (+{LOCAL_SLACK:?} after a timer for it fired)"),
        || {
            format!(
                "reported {:?} after valid_until, {:?} after the bound",
                lost_at - valid,
                lost_at - bound
            )
        },
    )?;
    ctx.ensure(
        valid <= cut_at + t.ttl,
        "no validity beyond the cut plus one TTL",
        || format!("valid_until {:?} after the cut", valid - cut_at),
    )?;
    // The store may still hold the key until its TTL runs out; either answer is right.
    let _ = guard.release().await;
    let other = ctx.client().await;
    free_by_ttl(&ctx, &other, &key, &t, "after the heal").await?;
    ctx.pass(&t)
}

/// A layer whose renewals never reach the store (they hang) once stalled, while every
/// other call goes through: the loss of a lease without a link fault, for any backend.
#[derive(Debug, Default)]
struct StalledRenewals {
    stalled: AtomicBool,
}

impl StalledRenewals {
    async fn gate(&self) {
        if self.stalled.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }
}

#[async_trait]
impl BackendLayer for StalledRenewals {
    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        self.gate().await;
        next.renew(lease).await
    }
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.gate().await;
        next.renew_many(leases).await
    }
}

/// Drops set a flag: shows the job's future was dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// `with_lock` drops the job when the lease is lost and returns `Err(LockError::Lost)`.
pub async fn with_lock_aborts_job_on_loss(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("with_lock_aborts_job_on_loss", factory);
    let client = ctx.client().await;
    let t = ctx.timing(&client);
    let stalled = Arc::new(StalledRenewals::default());
    let locker = locker(&ctx, Arc::new(Layered::new(client, stalled.clone())), &t)?;
    let key = ctx.key("k")?;
    let (started, finished, dropped) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let invoked = Instant::now();
    let control = ControlTimer::at(invoked + t.ttl + t.expiry_slack);
    let result = locker
        .with_lock(&key, |_guard| {
            stalled.stalled.store(true, Ordering::SeqCst);
            let (started, finished, dropped) = (started.clone(), finished.clone(), dropped.clone());
            async move {
                let _flag = DropFlag(dropped);
                started.store(true, Ordering::SeqCst);
                sleep(t.ttl * 10).await;
                finished.store(true, Ordering::SeqCst);
            }
        })
        .await;
    let returned = Instant::now();
    ctx.ensure(
        matches!(result, Err(LockError::Lost)),
        "with_lock to return Err(LockError::Lost) when renewals stop",
        || format!("{result:?}"),
    )?;
    ctx.ensure(
        started.load(Ordering::SeqCst)
            && !finished.load(Ordering::SeqCst)
            && dropped.load(Ordering::SeqCst),
        "the job to have started, not finished, and been dropped",
        || {
            format!(
                "started {}, finished {}, dropped {}",
                started.load(Ordering::SeqCst),
                finished.load(Ordering::SeqCst),
                dropped.load(Ordering::SeqCst)
            )
        },
    )?;
    let bound = control.bound().await;
    ctx.ensure(
        returned <= bound,
        "with_lock to return within about one TTL of the grant",
        || {
            format!(
                "returned after {:?}, {:?} after the bound",
                returned - invoked,
                returned - bound
            )
        },
    )?;
    let other = ctx.client().await;
    free_by_ttl(&ctx, &other, &key, &t, "after the loss").await?;
    ctx.pass(&t)
}

/// A guard's release frees the key at once; a dropped guard frees it by its TTL at the
/// latest; neither is renewed afterwards. The TTL is [`Timing::renewed_ttl`]: the case
/// checks that the watchdog keeps the lease it was just granted, and with the short TTL
/// a loaded machine can let the lease run out before the check (seen once on a Redis
/// Cluster, the workspace's tests running beside it: "the watchdog to renew one lease",
/// got 0). "By its TTL" is counted with that TTL.
pub async fn guard_release_frees_the_key(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("guard_release_frees_the_key", factory);
    let (client, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&client);
    let t = Timing {
        ttl: t.renewed_ttl,
        ..t
    };
    let locker = locker(&ctx, client, &t)?;
    let key = ctx.key("released")?;
    let guard = ctx.ok("lock", locker.lock(&key).await)?;
    let token = guard.token();
    ctx.ensure(
        locker.held() == 1,
        "the watchdog to renew one lease",
        || locker.held(),
    )?;
    guard_released(&ctx, guard.release().await)?;
    next_token_above(&ctx, &other, &key, &t, token).await?;

    let dropped_key = ctx.key("dropped")?;
    let guard = ctx.ok("lock", locker.lock(&dropped_key).await)?;
    drop(guard);
    ctx.ensure(
        locker.held() == 0,
        "no lease renewed after release and drop",
        || locker.held(),
    )?;
    free_by_ttl(
        &ctx,
        &other,
        &dropped_key,
        &t,
        "after its guard was dropped",
    )
    .await?;
    ctx.pass(&t)
}

/// `Locker::builder` refuses TTLs the backend cannot honour.
pub async fn locker_builder_rejects_bad_ttl(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("locker_builder_rejects_bad_ttl", factory);
    let client = ctx.client().await;
    let t = ctx.timing(&client);
    for bad in super::input::bad_ttls(&client.capabilities(), t.ttl) {
        let built = Locker::builder(client.clone()).ttl(bad).build();
        ctx.ensure(
            matches!(built, Err(LockError::InvalidTtl { ttl, .. }) if ttl == bad),
            format!("Locker::builder().ttl({bad:?}).build() to fail with InvalidTtl"),
            || format!("{built:?}"),
        )?;
    }
    locker(&ctx, client, &t)?;
    ctx.pass(&t)
}
