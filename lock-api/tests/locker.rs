//! Locker, guard and watchdog behaviour on the memory backend, on tokio's paused clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{
    BackendLayer, Layered, Lease, LockBackend, LockError, LockKey, Locker, Release, Renewal,
    RetryPolicy, async_trait,
};
use tokio::time::{Instant, sleep, sleep_until};

const TTL: Duration = Duration::from_secs(3);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Counts calls and can turn every renewal into `Lost`.
#[derive(Debug, Default)]
struct Spy {
    renew_many_calls: AtomicUsize,
    renewed_leases: AtomicUsize,
    lose_renewals: AtomicBool,
    unreachable_renewals: AtomicUsize,
}

#[async_trait]
impl BackendLayer for Spy {
    fn name(&self, _: &dyn LockBackend) -> &'static str {
        "spy"
    }
    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        Ok(self.renew_many(next, std::slice::from_ref(lease)).await?[0])
    }
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.renew_many_calls.fetch_add(1, Ordering::SeqCst);
        self.renewed_leases
            .fetch_add(leases.len(), Ordering::SeqCst);
        if self.lose_renewals.load(Ordering::SeqCst) {
            return Ok(vec![Renewal::Lost; leases.len()]);
        }
        let unreachable =
            self.unreachable_renewals
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if unreachable.is_ok() {
            return Ok(vec![Renewal::Unreachable; leases.len()]);
        }
        next.renew_many(leases).await
    }
}

/// A store over two nodes, where the node holding the `silent-*` keys stopped answering
/// after granting them. Like a cluster client, `renew_many` renews the leases on the
/// healthy node at once, and replies after the silent node's timeout with its items
/// `Unreachable`. Counts silent leases sent when they had already run out.
#[derive(Debug)]
struct SilentNode {
    node_timeout: Duration,
    sent_after_deadline: AtomicUsize,
}

impl SilentNode {
    fn new(node_timeout: Duration) -> Self {
        Self {
            node_timeout,
            sent_after_deadline: AtomicUsize::new(0),
        }
    }

    fn on_silent_node(lease: &Lease) -> bool {
        lease.key().as_str().starts_with("silent")
    }
}

#[async_trait]
impl BackendLayer for SilentNode {
    fn name(&self, _: &dyn LockBackend) -> &'static str {
        "silent-node"
    }
    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        match self.renew_many(next, std::slice::from_ref(lease)).await?[0] {
            Renewal::Unreachable => Err(LockError::unavailable("silent-node", "no reply")),
            renewal => Ok(renewal),
        }
    }
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let mut renewals = Vec::with_capacity(leases.len());
        let mut waits_for_silent_node = false;
        for lease in leases {
            if Self::on_silent_node(lease) {
                // Never renewed, so the grant's deadline is still the lease's deadline.
                if Instant::now() >= lease.valid_until() {
                    self.sent_after_deadline.fetch_add(1, Ordering::SeqCst);
                }
                waits_for_silent_node = true;
                renewals.push(Renewal::Unreachable);
            } else {
                renewals.push(next.renew(lease).await?);
            }
        }
        if waits_for_silent_node {
            sleep(self.node_timeout).await;
        }
        Ok(renewals)
    }
}

/// A memory backend wrapped in `layer`, which the caller keeps to read its state.
fn on_memory(layer: Arc<impl BackendLayer>) -> Arc<dyn LockBackend> {
    Arc::new(Layered::new(Arc::new(MemoryBackend::new()), layer))
}

/// A memory backend behind a [`Faults`] layer, and the layer's knobs.
fn faulted_memory() -> (Arc<Faults>, Arc<dyn LockBackend>) {
    let faults = Arc::new(Faults::default());
    (faults.clone(), on_memory(faults))
}

/// [`locker`] on a memory backend behind a [`Faults`] layer, and the layer's knobs.
fn faulted_locker() -> (Arc<Faults>, Locker) {
    let (faults, backend) = faulted_memory();
    (faults, locker(backend))
}

fn locker(backend: Arc<dyn LockBackend>) -> Locker {
    Locker::builder(backend)
        .ttl(TTL)
        .wait_timeout(Some(Duration::from_secs(10)))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_keeps_a_job_three_times_its_ttl_alive() {
    let backend = Arc::new(MemoryBackend::new());
    let locker = locker(backend.clone());
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    let token = guard.token();
    let end = Instant::now() + TTL * 3;
    while Instant::now() < end {
        sleep(Duration::from_millis(250)).await;
        assert!(guard.is_held(), "lost the lease while renewing");
        assert!(backend.acquire(&key("job"), TTL).await.unwrap().is_none());
    }
    assert_eq!(guard.token(), token);
    assert_eq!(guard.release().await.unwrap(), Release::Released);
}

#[tokio::test(start_paused = true)]
async fn one_renew_many_call_renews_every_due_lease() {
    let spy = Arc::new(Spy::default());
    let locker = locker(on_memory(spy.clone()));
    let mut guards = Vec::new();
    for i in 0..500 {
        guards.push(
            locker
                .try_lock(&key(&format!("job-{i}")))
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(locker.held(), 500);
    // Just past one renewal interval (TTL / 3): one round for all 500.
    sleep(TTL / 3 + Duration::from_millis(10)).await;
    assert_eq!(spy.renew_many_calls.load(Ordering::SeqCst), 1);
    assert_eq!(spy.renewed_leases.load(Ordering::SeqCst), 500);
    sleep(TTL * 2).await;
    assert!(guards.iter().all(|g| g.is_held()));
    let calls = spy.renew_many_calls.load(Ordering::SeqCst);
    assert!(
        calls <= 7,
        "{calls} calls for 2 TTLs: renewals are not batched"
    );
}

#[tokio::test(start_paused = true)]
async fn a_partition_is_reported_no_later_than_valid_until() {
    let (faults, locker) = faulted_locker();
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    faults.partition();
    let deadline = guard.valid_until();
    guard.lost().await;
    assert!(Instant::now() <= deadline, "reported after valid_until");
    assert!(!guard.is_held());
}

#[tokio::test(start_paused = true)]
async fn a_hanging_store_is_reported_no_later_than_valid_until() {
    let (faults, locker) = faulted_locker();
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    faults.hang();
    let deadline = guard.valid_until();
    tokio::time::timeout_at(deadline + Duration::from_millis(1), guard.lost())
        .await
        .expect("lost() did not resolve by valid_until");
    assert!(!guard.is_held());
    faults.heal();
}

#[tokio::test(start_paused = true)]
async fn leases_on_a_healthy_node_stay_held_while_a_silent_nodes_leases_run_out() {
    let store = Arc::new(SilentNode::new(Duration::from_millis(400)));
    let locker = locker(on_memory(store.clone()));
    let mut healthy = Vec::new();
    for i in 0..3 {
        let guard = locker.try_lock(&key(&format!("healthy-{i}"))).await;
        healthy.push(guard.unwrap().unwrap());
    }
    // Workers keep taking jobs whose keys live on the silent node, so every renewal batch
    // holds some silent lease close to its deadline.
    let mut silent = Vec::new();
    let end = Instant::now() + TTL * 3;
    while Instant::now() < end {
        let name = format!("silent-{}", silent.len());
        silent.push(locker.try_lock(&key(&name)).await.unwrap().unwrap());
        sleep(Duration::from_millis(100)).await;
        for guard in &healthy {
            assert!(guard.is_held(), "{} was lost", guard.key());
        }
    }
    assert!(!silent[0].is_held(), "the silent node's leases run out");
    assert_eq!(
        store.sent_after_deadline.load(Ordering::SeqCst),
        0,
        "a lease past its deadline was sent for renewal"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lease_past_its_deadline_is_given_up_without_being_sent() {
    // Unreachable at once: retries every 250 ms, the last one falling on the deadline.
    let store = Arc::new(SilentNode::new(Duration::ZERO));
    let locker = locker(on_memory(store.clone()));
    let guard = locker.try_lock(&key("silent")).await.unwrap().unwrap();
    // Nothing awaits `lost()`, so only the watchdog can notice the deadline.
    sleep(TTL * 2).await;
    assert!(!guard.is_held());
    assert_eq!(locker.held(), 0);
    assert_eq!(
        store.sent_after_deadline.load(Ordering::SeqCst),
        0,
        "the lease was sent for renewal after its deadline"
    );
}

#[test]
fn the_watchdog_starts_again_on_a_new_runtime_after_its_runtime_shut_down() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    };
    let backend = Arc::new(MemoryBackend::new());
    let locker = locker(backend.clone());
    let first = runtime();
    first.block_on(async {
        let guard = locker.try_lock(&key("first")).await.unwrap().unwrap();
        guard.release().await.unwrap();
    });
    drop(first);

    runtime().block_on(async {
        let guard = locker.try_lock(&key("second")).await.unwrap().unwrap();
        sleep(TTL * 2).await;
        assert!(
            guard.is_held(),
            "nothing renewed the lease on the new runtime"
        );
        assert!(
            backend
                .acquire(&key("second"), TTL)
                .await
                .unwrap()
                .is_none()
        );
        guard.release().await.unwrap();
    });
}

#[tokio::test(start_paused = true)]
async fn transient_renewal_errors_are_retried() {
    let (faults, locker) = faulted_locker();
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    faults.fail_next(2);
    sleep(TTL * 2).await;
    assert!(
        guard.is_held(),
        "two failed renewals should have been retried"
    );
}

#[tokio::test(start_paused = true)]
async fn unreachable_items_of_a_batch_are_retried_not_lost() {
    let spy = Arc::new(Spy::default());
    let locker = locker(on_memory(spy.clone()));
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    spy.unreachable_renewals.store(3, Ordering::SeqCst);
    sleep(TTL * 2).await;
    assert!(guard.is_held(), "an unreachable item was treated as lost");
    assert!(spy.renew_many_calls.load(Ordering::SeqCst) >= 4);
}

#[tokio::test(start_paused = true)]
async fn an_item_unreachable_until_valid_until_is_lost() {
    let spy = Arc::new(Spy::default());
    let locker = locker(on_memory(spy.clone()));
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    spy.unreachable_renewals.store(usize::MAX, Ordering::SeqCst);
    let deadline = guard.valid_until();
    guard.lost().await;
    assert!(Instant::now() <= deadline);
    sleep(Duration::from_millis(10)).await;
    assert_eq!(locker.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_lost_renewal_marks_the_guard_lost_at_once() {
    let spy = Arc::new(Spy::default());
    let locker = locker(on_memory(spy.clone()));
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    spy.lose_renewals.store(true, Ordering::SeqCst);
    let renewal_due = Instant::now() + TTL / 3;
    guard.lost().await;
    assert!(Instant::now() < renewal_due + Duration::from_millis(50));
    assert!(!guard.is_held());
    assert_eq!(locker.held(), 0, "a lost lease is no longer renewed");
}

#[tokio::test(start_paused = true)]
async fn with_lock_cancels_the_job_when_the_lease_is_lost() {
    let (faults, locker) = faulted_locker();
    let finished = Arc::new(AtomicBool::new(false));
    let job = {
        let finished = finished.clone();
        let faults = faults.clone();
        move |_: &distlock_core::LockGuard| async move {
            faults.partition();
            sleep(TTL * 10).await;
            finished.store(true, Ordering::SeqCst);
        }
    };
    let result = locker.with_lock(&key("job"), job).await;
    assert!(matches!(result, Err(LockError::Lost)), "{result:?}");
    assert!(!finished.load(Ordering::SeqCst), "the job ran to its end");
}

#[tokio::test(start_paused = true)]
async fn with_lock_returns_lost_without_waiting_for_a_hung_store() {
    let (faults, locker) = faulted_locker();
    let job = {
        let faults = faults.clone();
        move |_: &distlock_core::LockGuard| async move {
            faults.hang();
            sleep(TTL * 10).await;
        }
    };
    let started = Instant::now();
    let result = locker.with_lock(&key("job"), job).await;
    assert!(matches!(result, Err(LockError::Lost)), "{result:?}");
    assert!(
        Instant::now() - started <= TTL,
        "with_lock waited on the hung store"
    );
    faults.heal();
}

#[tokio::test(start_paused = true)]
async fn with_lock_returns_the_value_without_waiting_for_a_hung_release() {
    let (faults, locker) = faulted_locker();
    let job = {
        let faults = faults.clone();
        move |_: &distlock_core::LockGuard| async move {
            faults.hang();
            7
        }
    };
    let started = Instant::now();
    assert_eq!(locker.with_lock(&key("job"), job).await.unwrap(), 7);
    assert!(Instant::now() - started <= TTL);
    faults.heal();
}

#[tokio::test(start_paused = true)]
async fn with_lock_keeps_a_result_ready_before_the_deadline_and_polls_nothing_at_it() {
    let (faults, locker) = faulted_locker();
    // No renewal gets through: each lease runs out at its first deadline.
    let job = |finish_before: Duration| {
        let faults = faults.clone();
        move |guard: &distlock_core::LockGuard| {
            faults.partition();
            let until = guard.valid_until();
            async move {
                sleep_until(until - finish_before).await;
                42
            }
        }
    };
    // A step that ends while the lease is valid is kept, however near the deadline.
    let kept = locker
        .with_lock(&key("job"), job(Duration::from_millis(1)))
        .await;
    assert_eq!(kept.unwrap(), 42, "the finished job's result was dropped");
    faults.heal();
    // A job woken at its lease's deadline is not polled again.
    let late = locker.with_lock(&key("job"), job(Duration::ZERO)).await;
    assert!(matches!(late, Err(LockError::Lost)), "{late:?}");
    faults.heal();
}

#[tokio::test(start_paused = true)]
async fn with_lock_returns_the_job_value_and_releases() {
    let backend = Arc::new(MemoryBackend::new());
    let locker = locker(backend.clone());
    let token = locker
        .with_lock(&key("job"), |g| {
            let t = g.token();
            async move { t }
        })
        .await
        .unwrap();
    let next = backend.acquire(&key("job"), TTL).await.unwrap().unwrap();
    assert!(next.token() > token);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_guard_releases_it_in_the_background() {
    let backend = Arc::new(MemoryBackend::new());
    let locker = locker(backend.clone());
    let guard = locker.try_lock(&key("job")).await.unwrap().unwrap();
    drop(guard);
    sleep(Duration::from_millis(1)).await;
    assert!(backend.acquire(&key("job"), TTL).await.unwrap().is_some());
    assert_eq!(locker.held(), 0);
}

#[tokio::test(start_paused = true)]
async fn lock_waits_for_the_holder_and_times_out() {
    let backend = Arc::new(MemoryBackend::new());
    let locker = Locker::builder(backend.clone())
        .ttl(TTL)
        .wait_timeout(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let held = locker.try_lock(&key("job")).await.unwrap().unwrap();
    let started = Instant::now();
    let err = locker.lock(&key("job")).await.unwrap_err();
    assert!(matches!(err, LockError::Timeout { .. }), "{err}");
    assert!(Instant::now() - started >= Duration::from_secs(1));
    assert!(Instant::now() - started < Duration::from_millis(1100));

    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock(&key("job")).await.map(|g| g.token()) }
    });
    sleep(Duration::from_millis(300)).await;
    let first = held.token();
    held.release().await.unwrap();
    assert!(waiter.await.unwrap().unwrap() > first);
}

#[tokio::test(start_paused = true)]
async fn lock_gives_up_at_its_wait_timeout_even_when_an_acquire_hangs() {
    let (faults, backend) = faulted_memory();
    let locker = Locker::builder(backend.clone())
        .ttl(TTL)
        .wait_timeout(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    faults.hang();
    let result = tokio::time::timeout(Duration::from_secs(60), locker.lock(&key("job")))
        .await
        .expect("lock() waited on the hung call past its wait timeout");
    assert!(
        matches!(result, Err(LockError::Timeout { .. })),
        "{result:?}"
    );
    faults.heal();
}

#[tokio::test(start_paused = true)]
async fn lock_retries_transient_errors_within_its_deadline() {
    let (faults, locker) = faulted_locker();
    faults.fail_next(3);
    assert!(locker.lock(&key("job")).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_ttl_the_store_cannot_honour_is_refused_when_building() {
    let backend = Arc::new(MemoryBackend::new());
    let locker = Locker::builder(backend)
        .ttl(Duration::from_micros(1500))
        .build();
    assert!(matches!(locker, Err(LockError::InvalidTtl { .. })));
}

#[test]
fn the_builder_validates_its_settings() {
    let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let build = |b: distlock_core::LockerBuilder| b.build().map(|_| ()).unwrap_err();
    assert!(matches!(
        build(Locker::builder(backend.clone()).ttl(Duration::ZERO)),
        LockError::InvalidTtl { .. }
    ));
    assert!(matches!(
        build(Locker::builder(backend.clone()).renew_interval(Duration::from_secs(60))),
        LockError::Config(_)
    ));
    assert!(matches!(
        build(Locker::builder(backend).retry(RetryPolicy {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(1)
        })),
        LockError::Config(_)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_wait_timeout_beyond_the_clock_is_a_config_error_and_a_long_one_works() {
    let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let built = Locker::builder(backend.clone())
        .ttl(TTL)
        .wait_timeout(Some(Duration::MAX))
        .build();
    assert!(
        matches!(&built, Err(LockError::Config(m)) if m.contains("wait_timeout(None)")),
        "{built:?}"
    );
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    let locker = Locker::builder(backend)
        .ttl(TTL)
        .wait_timeout(Some(century))
        .build()
        .unwrap();
    let guard = locker.lock(&key("job")).await.unwrap();
    guard.release().await.unwrap();
}

#[test]
fn a_renew_interval_that_leaves_no_time_to_retry_is_refused() {
    let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let with_interval = |every| {
        Locker::builder(backend.clone())
            .ttl(TTL)
            .renew_interval(every)
            .build()
    };
    // A 3 s lease is trusted for 2.968 s: renewing at 2.5 s leaves no room for a retry.
    let late = with_interval(Duration::from_millis(2500));
    assert!(
        matches!(&late, Err(LockError::Config(m)) if m.contains("renew interval")),
        "{late:?}"
    );
    assert!(with_interval(Duration::from_secs(2)).is_ok());
}

#[test]
fn a_ttl_too_short_to_renew_is_invalid() {
    let backend: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let with_ttl = |ttl| Locker::builder(backend.clone()).ttl(ttl).build();
    // The store honours 2 ms, but the lease would be trusted for no time at all.
    let tiny = Duration::from_millis(2);
    let built = with_ttl(tiny);
    assert!(
        matches!(&built, Err(LockError::InvalidTtl { ttl, .. }) if *ttl == tiny),
        "{built:?}"
    );
    assert!(with_ttl(Duration::from_millis(10)).is_ok());
}

#[tokio::test]
async fn a_direct_acquire_with_a_ttl_trusted_for_no_time_is_refused() {
    let backend = MemoryBackend::new();
    for tiny in [Duration::from_millis(1), Duration::from_millis(2)] {
        let granted = backend.acquire(&key("job"), tiny).await;
        assert!(
            matches!(&granted, Err(LockError::InvalidTtl { ttl, .. }) if *ttl == tiny),
            "{tiny:?}: {granted:?}"
        );
    }
    let granted = backend.acquire(&key("job"), Duration::from_millis(3)).await;
    assert!(matches!(granted, Ok(Some(_))), "{granted:?}");
}

/// Holds every renewal's reply for `delay` once armed.
#[derive(Debug, Default)]
struct SlowReplies {
    delay: parking_lot::Mutex<Duration>,
}

#[async_trait]
impl BackendLayer for SlowReplies {
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let renewals = next.renew_many(leases).await?;
        let delay = *self.delay.lock();
        sleep(delay).await;
        Ok(renewals)
    }
}

#[tokio::test(start_paused = true)]
async fn a_renewal_reply_read_after_a_leases_deadline_does_not_bring_it_back() {
    let slow = Arc::new(SlowReplies::default());
    let locker = locker(on_memory(slow.clone()));
    let start = Instant::now();
    // Two leases close enough to be renewed in one batch, which waits for its reply until
    // the later one's deadline.
    let early = locker.try_lock(&key("early")).await.unwrap().unwrap();
    sleep(Duration::from_millis(200)).await;
    let late = locker.try_lock(&key("late")).await.unwrap().unwrap();
    let (early_until, late_until) = (early.valid_until(), late.valid_until());
    // The first renewal (at TTL / 3) is answered between the two deadlines.
    let renewal_sent = start + TTL / 3;
    *slow.delay.lock() = (early_until - renewal_sent) + Duration::from_millis(100);
    sleep_until(early_until + Duration::from_millis(150)).await;
    assert!(Instant::now() < late_until);
    // Nothing looked at `early` before the reply came: only the watchdog decides.
    assert!(
        !early.is_held(),
        "a reply read after the lease's deadline brought it back"
    );
    assert!(late.is_held(), "the other lease of the batch is renewed");
    assert_eq!(locker.held(), 1, "the lost lease is still being renewed");
    late.release().await.unwrap();
}

#[test]
fn backoff_grows_with_jitter_and_stays_bounded() {
    let policy = RetryPolicy::default();
    for attempt in 0..40 {
        let wait = policy.backoff(attempt);
        let ceiling = (policy.initial * 2u32.saturating_pow(attempt.min(20))).min(policy.max);
        assert!(
            wait <= ceiling && wait >= ceiling / 2,
            "attempt {attempt}: {wait:?}"
        );
    }
    let draws: std::collections::HashSet<_> = (0..20).map(|_| policy.backoff(6)).collect();
    assert!(draws.len() > 1, "backoff is not jittered");
}
