//! The semaphore calls users expect, on the memory backend: an attempt dropped after the
//! store granted it gives its slot back, a wait of its own per call, the number of free
//! permits, and several permits at once, all or none.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::memory::MemoryBackend;
use distlock_core::{
    BackendLayer, Layered, Lease, LockBackend, LockError, LockKey, Locker, Release, RetryPolicy,
    Semaphore, async_trait,
};
use tokio::time::{Instant, sleep, timeout};

/// Long, so that a slot left held by a dropped attempt is told apart from one given back.
const TTL: Duration = Duration::from_secs(30);

/// How long the slow layer keeps an `acquire_any` reply after the store granted it.
const SLOW_REPLY: Duration = Duration::from_millis(300);

/// A slot given back after a drop is free again within this (a release in a task).
const GIVEN_BACK_WITHIN: Duration = Duration::from_secs(5);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// The store answers an `acquire_any` at once, and its reply comes back only after
/// [`SLOW_REPLY`] (a slow link on the way back): a caller dropped meanwhile has taken a
/// slot without knowing it. Counts the calls that reach the store.
#[derive(Debug, Default)]
struct SlowReplies {
    sent: AtomicUsize,
    /// Replies come back at once: the layer only counts.
    fast: bool,
}

#[async_trait]
impl BackendLayer for SlowReplies {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        next.acquire(key, ttl).await
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let granted = next.acquire_any(keys, ttl).await;
        if !self.fast {
            sleep(SLOW_REPLY).await;
        }
        granted
    }
}

struct Setup {
    store: MemoryBackend,
    layer: Arc<Layered<SlowReplies>>,
    semaphore: Semaphore,
}

/// A semaphore of `permits` on a locker (wait timeout 60 s) whose replies are slow.
fn setup(permits: u32) -> Setup {
    let store = MemoryBackend::new();
    let layer = Arc::new(Layered::new(
        Arc::new(store.client()),
        SlowReplies::default(),
    ));
    let semaphore = locker_on(layer.clone())
        .semaphore(&key("exports"), permits)
        .unwrap();
    Setup {
        store,
        layer,
        semaphore,
    }
}

fn locker_on(backend: Arc<dyn LockBackend>) -> Locker {
    Locker::builder(backend)
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
        })
        .wait_timeout(Some(Duration::from_secs(60)))
        .build()
        .unwrap()
}

/// Polls `store` (another client of it) until it takes every slot of `semaphore`; the
/// time that took, or a panic naming the slots still held after [`GIVEN_BACK_WITHIN`].
async fn all_free(store: &MemoryBackend, semaphore: &Semaphore, after: &str) -> Duration {
    let other = store.client();
    let started = Instant::now();
    loop {
        let taken = other.acquire_many(semaphore.slots(), TTL).await.unwrap();
        let held: Vec<_> = semaphore
            .slots()
            .iter()
            .zip(&taken)
            .filter(|(_, t)| t.is_none())
            .map(|(slot, _)| slot.to_string())
            .collect();
        let leases: Vec<Lease> = taken.into_iter().flatten().collect();
        other.release_many(&leases).await.unwrap();
        if held.is_empty() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < GIVEN_BACK_WITHIN,
            "{after}: {held:?} still held {:?} later (the TTL is {TTL:?})",
            started.elapsed()
        );
        sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_after_the_store_granted_gives_the_slot_back() {
    let s = setup(1);
    let dropped = timeout(SLOW_REPLY / 3, s.semaphore.acquire()).await;
    assert!(
        dropped.is_err(),
        "the acquire outlived its reply: {dropped:?}"
    );
    assert_eq!(s.layer.layer().sent.load(Ordering::SeqCst), 1);
    all_free(
        &s.store,
        &s.semaphore,
        "an acquire dropped while its reply was on its way",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_acquire_many_dropped_part_way_gives_every_slot_back() {
    let s = setup(3);
    // Dropped while the second slot's reply is on its way: the first is taken, and so is
    // the second.
    let dropped = timeout(SLOW_REPLY + SLOW_REPLY / 2, s.semaphore.try_acquire_many(3)).await;
    assert!(
        dropped.is_err(),
        "the attempt outlived its replies: {dropped:?}"
    );
    assert_eq!(s.layer.layer().sent.load(Ordering::SeqCst), 2);
    all_free(
        &s.store,
        &s.semaphore,
        "a try_acquire_many dropped part way",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_timeout_gives_up_after_its_own_wait_and_holds_nothing() {
    let s = setup(2);
    let other = s.store.client();
    let held = other
        .acquire(&s.semaphore.slots()[0], TTL)
        .await
        .unwrap()
        .unwrap();
    let one = s
        .semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("one slot free");
    // Full: a wait of 200 ms (the locker's is 60 s) ends with Timeout naming the semaphore.
    let started = Instant::now();
    let waited = s
        .semaphore
        .acquire_timeout(Duration::from_millis(200))
        .await;
    let took = started.elapsed();
    assert!(
        matches!(&waited, Err(LockError::Timeout { key, .. }) if key == s.semaphore.name()),
        "{waited:?}"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(30),
        "timed out after {took:?}"
    );
    // A wait that times out while its attempt's reply is on its way gives the slot back.
    one.release().await.unwrap();
    let waited = s.semaphore.acquire_timeout(SLOW_REPLY / 3).await;
    assert!(
        matches!(waited, Err(LockError::Timeout { .. })),
        "{waited:?}"
    );
    other.release(&held).await.unwrap();
    all_free(
        &s.store,
        &s.semaphore,
        "an acquire_timeout that timed out mid-reply",
    )
    .await;
    // Too long to be a deadline: refused.
    let waited = s.semaphore.acquire_timeout(Duration::MAX).await;
    assert!(matches!(waited, Err(LockError::Config(_))), "{waited:?}");
}

#[tokio::test]
async fn available_counts_the_free_permits() {
    let locker = locker_on(Arc::new(MemoryBackend::new()));
    let semaphore = locker.semaphore(&key("exports"), 3).unwrap();
    assert_eq!(semaphore.available().await.unwrap(), 3);
    let first = semaphore.try_acquire().await.unwrap().unwrap();
    let two = semaphore.try_acquire_many(2).await.unwrap().unwrap();
    assert_eq!(semaphore.available().await.unwrap(), 0);
    first.release().await.unwrap();
    assert_eq!(semaphore.available().await.unwrap(), 1);
    assert_eq!(
        two.release().await.unwrap(),
        vec![Release::Released, Release::Released]
    );
    assert_eq!(semaphore.available().await.unwrap(), 3);
}

#[tokio::test]
async fn many_permits_are_granted_all_or_none() {
    let store = MemoryBackend::new();
    let semaphore = locker_on(Arc::new(store.client()))
        .semaphore(&key("exports"), 4)
        .unwrap();
    let three = semaphore
        .try_acquire_many(3)
        .await
        .unwrap()
        .expect("4 free");
    let mut slots = three.slots();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 3, "three permits on three slots: {three:?}");
    // One free, two asked for: none granted, and the one it took on the way given back.
    assert!(semaphore.try_acquire_many(2).await.unwrap().is_none());
    assert_eq!(semaphore.available().await.unwrap(), 1);
    let last = semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("the fourth slot");
    assert!(!slots.contains(&last.slot()));
    drop(last);
    three.release().await.unwrap();
}

#[tokio::test]
async fn bad_counts_are_refused_before_anything_is_sent() {
    let s = setup(3);
    for k in [0, 4, u32::MAX] {
        let tried = s.semaphore.try_acquire_many(k).await;
        assert!(
            matches!(&tried, Err(LockError::Config(why)) if why.contains("1 to 3")),
            "{k}: {tried:?}"
        );
        let waited = s.semaphore.acquire_many(k).await;
        assert!(
            matches!(&waited, Err(LockError::Config(_))),
            "{k}: {waited:?}"
        );
        let waited = s
            .semaphore
            .acquire_many_timeout(k, Duration::from_secs(1))
            .await;
        assert!(
            matches!(&waited, Err(LockError::Config(_))),
            "{k}: {waited:?}"
        );
    }
    assert_eq!(s.layer.layer().sent.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_many_waits_until_enough_are_free() {
    let store = MemoryBackend::new();
    let holder = store.client();
    let counted = Arc::new(Layered::new(
        Arc::new(store.client()),
        SlowReplies {
            fast: true,
            ..SlowReplies::default()
        },
    ));
    let semaphore = locker_on(counted.clone())
        .semaphore(&key("exports"), 3)
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            holder
                .acquire_any(semaphore.slots(), TTL)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    let waiter = {
        let semaphore = semaphore.clone();
        tokio::spawn(async move { semaphore.acquire_many(2).await })
    };
    let waited = Duration::from_millis(300);
    sleep(waited).await;
    assert!(!waiter.is_finished(), "two granted while one was free");
    // Each attempt takes the free slot and gives it back, a release its own watch hears:
    // it waits its backoff (at least 5 ms with this policy) before the next, instead of
    // being woken by its own release at once, round after round.
    let attempts = counted.layer().sent.load(Ordering::SeqCst) / 2;
    let most = usize::try_from(waited.as_millis() / 5).unwrap() + 1;
    assert!(
        attempts <= most,
        "{attempts} attempts in {waited:?}, a backoff of at least 5 ms allows {most}"
    );
    holder.release(&held[0]).await.unwrap();
    let two = waiter.await.unwrap().unwrap();
    assert_eq!(two.len(), 2);
    assert!(two.is_held());
    two.release().await.unwrap();
    holder.release(&held[1]).await.unwrap();
}
