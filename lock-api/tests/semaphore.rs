//! Semaphores on the memory backend: bad limits refused before anything is sent, a
//! backend that grants a key it was not asked for caught, one waiter woken per freed
//! permit, a lost permit reported like a lost lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{
    BackendLayer, Layered, Lease, LockBackend, LockError, LockKey, Locker, MAX_PERMITS, Release,
    RetryPolicy, async_trait,
};
use tokio::time::{sleep, timeout};

const TTL: Duration = Duration::from_secs(3);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// A layer whose `acquire_any` takes a key it was not given, as a buggy backend might.
#[derive(Debug)]
struct StrayGrant;

#[async_trait]
impl BackendLayer for StrayGrant {
    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        _keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        next.acquire(&key("somebody-else"), ttl).await
    }
}

fn locker_on(backend: Arc<dyn LockBackend>, backoff: Duration) -> Locker {
    Locker::builder(backend)
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: backoff,
            max: backoff,
        })
        .wait_timeout(Some(Duration::from_secs(60)))
        .build()
        .unwrap()
}

#[tokio::test]
async fn bad_limits_and_names_are_refused_before_anything_is_sent() {
    let faults = Arc::new(Faults::default());
    let locker = locker_on(
        Arc::new(Layered::new(Arc::new(MemoryBackend::new()), faults.clone())),
        Duration::from_millis(10),
    );
    for permits in [0, MAX_PERMITS + 1, u32::MAX] {
        let made = locker.semaphore(&key("exports"), permits);
        assert!(
            matches!(&made, Err(LockError::Config(why)) if why.contains("1 to 1024 permits")),
            "{permits}: {made:?}"
        );
    }
    // The slot names `<name>:permit:<i>` must fit the key limit too.
    let long = key(&"n".repeat(distlock_core::MAX_KEY_BYTES - 8));
    let made = locker.semaphore(&long, 10);
    assert!(
        matches!(made, Err(LockError::InvalidKey { .. })),
        "{made:?}"
    );
    assert_eq!(faults.calls(), 0, "calls that reached the store");

    let most = locker.semaphore(&key("exports"), MAX_PERMITS).unwrap();
    assert_eq!(most.permits(), MAX_PERMITS);
    assert_eq!(most.slots()[1023].as_str(), "exports:permit:1023");
}

#[tokio::test]
async fn a_key_granted_outside_the_slots_is_given_back_and_reported() {
    let store = Arc::new(MemoryBackend::new());
    let locker = locker_on(
        Arc::new(Layered::new(store.clone(), StrayGrant)),
        Duration::from_millis(10),
    );
    let semaphore = locker.semaphore(&key("exports"), 2).unwrap();
    let got = semaphore.try_acquire().await;
    assert!(
        matches!(&got, Err(LockError::Backend { source, .. }) if source.to_string().contains("somebody-else")),
        "{got:?}"
    );
    // Given back: the stray key is free, and the locker renews nothing.
    assert!(
        store
            .acquire(&key("somebody-else"), TTL)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(locker.held(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_freed_permit_wakes_one_waiter() {
    const LONG: Duration = Duration::from_secs(30);
    let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    assert!(store.capabilities().wakes_waiters);
    let holder = locker_on(store.clone(), LONG);
    let semaphore = holder.semaphore(&key("exports"), 2).unwrap();
    let first = semaphore.try_acquire().await.unwrap().unwrap();
    let second = semaphore.try_acquire().await.unwrap().unwrap();

    let granted = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let semaphore = locker_on(store.clone(), LONG)
            .semaphore(&key("exports"), 2)
            .unwrap();
        let granted = granted.clone();
        waiters.push(tokio::spawn(async move {
            let permit = semaphore.acquire().await?;
            granted.fetch_add(1, Ordering::SeqCst);
            Ok::<_, LockError>(permit)
        }));
    }
    sleep(Duration::from_millis(200)).await;
    assert_eq!(granted.load(Ordering::SeqCst), 0);

    // Each release wakes a waiter long before its 30 s backoff, and only one takes it.
    let mut held = Vec::new();
    for (released, permit) in [first, second].into_iter().enumerate() {
        assert_eq!(permit.release().await.unwrap(), Release::Released);
        timeout(Duration::from_secs(5), async {
            while granted.load(Ordering::SeqCst) <= released {
                sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("a freed permit wakes a waiter");
        sleep(Duration::from_millis(100)).await;
        assert_eq!(granted.load(Ordering::SeqCst), released + 1);
    }
    let mut still_waiting = 0;
    for waiter in waiters {
        if waiter.is_finished() {
            held.push(waiter.await.unwrap().unwrap());
        } else {
            still_waiting += 1;
            waiter.abort();
        }
    }
    assert_eq!((held.len(), still_waiting), (2, 1));
    let mut slots: Vec<u32> = held.iter().map(|p| p.slot()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_lost_permit_stops_its_job_and_frees_the_slot() {
    let store = Arc::new(MemoryBackend::new());
    let locker = locker_on(store.clone(), Duration::from_millis(10));
    let semaphore = locker.semaphore(&key("exports"), 1).unwrap();
    let steps = Arc::new(AtomicUsize::new(0));
    let counted = steps.clone();
    let ran = semaphore
        .with_permit(|permit| {
            let slot = permit.key().clone();
            let store = store.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                // Another process takes the slot over: the store forgets this holder.
                store.purge(&slot).await.unwrap();
                let _theirs = store.acquire(&slot, TTL).await.unwrap().unwrap();
                loop {
                    sleep(Duration::from_millis(100)).await;
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .await;
    assert!(matches!(ran, Err(LockError::Lost)), "{ran:?}");
    let steps = steps.load(Ordering::SeqCst);
    // The watchdog renews at TTL / 3 and hears Lost: the job stops at its next step.
    assert!((2..=12).contains(&steps), "{steps} steps");
    assert_eq!(locker.held(), 0);
}

/// A lock named like a permit slot (`<name>:permit:<n>`) would silently take a permit of
/// semaphore `<name>`: the locker refuses it before anything is sent, and the
/// semaphore keeps its permit. Names that only look alike are locks as any other.
#[tokio::test]
async fn a_lock_named_like_a_permit_slot_is_refused_and_takes_no_permit() {
    let faults = Arc::new(Faults::default());
    let locker = locker_on(
        Arc::new(Layered::new(Arc::new(MemoryBackend::new()), faults.clone())),
        Duration::from_millis(10),
    );
    let exports = locker.semaphore(&key("exports"), 1).unwrap();
    let slot = key("exports:permit:0");
    let tried = locker.try_lock(&slot).await;
    assert!(
        matches!(&tried, Err(LockError::InvalidKey { reason }) if reason.contains("permit slot")),
        "{tried:?}"
    );
    let waited = locker.lock(&slot).await;
    assert!(
        matches!(&waited, Err(LockError::InvalidKey { .. })),
        "{waited:?}"
    );
    assert_eq!(faults.calls(), 0, "calls that reached the store");
    let permit = exports.try_acquire().await.unwrap();
    assert!(permit.is_some(), "the semaphore lost its only permit");
    for name in [
        "permit:0",
        "exports:permit:",
        "exports:permit:0a",
        "exports:permits:0",
    ] {
        let guard = locker.try_lock(&key(name)).await;
        assert!(matches!(guard, Ok(Some(_))), "{name}: {guard:?}");
    }
}

/// A layer that counts the watches asked for, by kind.
#[derive(Debug, Default)]
struct CountWatches {
    keys: AtomicUsize,
    semaphores: AtomicUsize,
}

#[async_trait]
impl BackendLayer for CountWatches {
    fn watch_releases(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
    ) -> Option<distlock_core::wake::ReleaseWatch> {
        self.keys.fetch_add(1, Ordering::SeqCst);
        next.watch_releases(key)
    }

    fn watch_permit_releases(
        &self,
        next: &dyn LockBackend,
        slots: &[LockKey],
    ) -> Option<distlock_core::wake::ReleaseWatch> {
        self.semaphores.fetch_add(1, Ordering::SeqCst);
        next.watch_permit_releases(slots)
    }
}

#[tokio::test]
async fn a_waiter_watches_all_the_slots_with_one_watch_whatever_their_number() {
    let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let count = Arc::new(CountWatches::default());
    let counted: Arc<dyn LockBackend> = Arc::new(Layered::new(store.clone(), count.clone()));
    let full = locker_on(store.clone(), Duration::from_millis(5))
        .semaphore(&key("exports"), MAX_PERMITS)
        .unwrap();
    let held = full.try_acquire_many(MAX_PERMITS).await.unwrap().unwrap();

    let semaphore = locker_on(counted, Duration::from_millis(5))
        .semaphore(&key("exports"), MAX_PERMITS)
        .unwrap();
    for _ in 0..4 {
        let waited = semaphore.acquire_timeout(Duration::from_millis(30)).await;
        assert!(
            matches!(waited, Err(LockError::Timeout { .. })),
            "{waited:?}"
        );
    }
    assert_eq!(
        count.semaphores.load(Ordering::SeqCst),
        4,
        "one watch per wait"
    );
    assert_eq!(count.keys.load(Ordering::SeqCst), 0, "no watch per slot");
    assert!(store.watched_keys().is_empty(), "nothing left watched");
    drop(held);
}

/// A layer that declares a permit index (or not) and records the first key of each
/// `acquire_any` a semaphore sends.
#[derive(Debug, Default)]
struct FirstAsked {
    index: bool,
    firsts: std::sync::Mutex<Vec<LockKey>>,
}

#[async_trait]
impl BackendLayer for FirstAsked {
    fn capabilities(&self, next: &dyn LockBackend) -> distlock_core::Capabilities {
        next.capabilities().permit_index(self.index)
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.firsts.lock().unwrap().push(keys[0].clone());
        next.acquire_any(keys, ttl).await
    }
}

/// Where the store keeps a permit index, a semaphore asks from slot 0 (the lowest free slot
/// is one look there); elsewhere from a random slot, so that stores asked slot by slot are
/// not all asked slot 0 first.
#[tokio::test]
async fn a_semaphore_asks_from_slot_0_only_where_the_store_keeps_an_index() {
    for index in [true, false] {
        let layer = Arc::new(FirstAsked {
            index,
            ..FirstAsked::default()
        });
        let locker = locker_on(
            Arc::new(Layered::new(Arc::new(MemoryBackend::new()), layer.clone())),
            Duration::from_millis(10),
        );
        let semaphore = locker.semaphore(&key("exports"), 16).unwrap();
        for _ in 0..40 {
            let permit = semaphore.try_acquire().await.unwrap().expect("free");
            permit.release().await.unwrap();
        }
        let firsts = std::mem::take(&mut *layer.firsts.lock().unwrap());
        assert_eq!(firsts.len(), 40);
        let mut distinct = firsts.clone();
        distinct.sort();
        distinct.dedup();
        if index {
            assert_eq!(
                distinct,
                [semaphore.slots()[0].clone()],
                "index: {firsts:?}"
            );
        } else {
            // 40 random starts of 16 all alike: one chance in 16^39.
            assert!(distinct.len() > 1, "no index: {firsts:?}");
        }
    }
}
