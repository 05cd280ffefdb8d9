//! Waiters woken by releases: `Locker::lock` on the memory backend, which announces
//! releases, on tokio's paused clock (so "at once" and "after a backoff" are exact).

use std::sync::Arc;
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{Layered, LockBackend, LockKey, Locker, RetryPolicy};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(60);
/// Far longer than a handoff by notification takes, so a waiter that polls is obvious.
const BACKOFF: Duration = Duration::from_secs(10);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

fn locker(client: impl LockBackend + 'static) -> Locker {
    Locker::builder(Arc::new(client))
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(Duration::from_secs(120)))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_release_wakes_a_waiter_at_once_not_after_its_backoff() {
    let store = MemoryBackend::new();
    let (holder, waiter) = (locker(store.client()), locker(store.client()));
    let guard = holder.try_lock(&key("job:1")).await.unwrap().unwrap();
    let waiting = tokio::spawn(async move {
        let guard = waiter.lock(&key("job:1")).await.unwrap();
        (Instant::now(), guard.token())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released_at = Instant::now();
    guard.release().await.unwrap();
    let (granted_at, token) = waiting.await.unwrap();
    assert!(
        granted_at - released_at < Duration::from_millis(1),
        "granted {:?} after the release",
        granted_at - released_at
    );
    assert_eq!(token.get(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_still_acquires_when_the_notification_is_lost() {
    let store = MemoryBackend::new();
    let faults = Arc::new(Faults::default());
    let faulty = || Layered::new(Arc::new(store.client()), faults.clone());
    let (holder, waiter) = (locker(faulty()), locker(faulty()));
    let guard = holder.try_lock(&key("job:1")).await.unwrap().unwrap();
    faults.lose_notifications(true);
    let started = Instant::now();
    let waiting = tokio::spawn(async move { waiter.lock(&key("job:1")).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    guard.release().await.unwrap();
    waiting
        .await
        .unwrap()
        .expect("the backoff fallback takes the key");
    // Not woken: it took the key at its next poll, within one backoff step.
    let waited = Instant::now() - started;
    assert!(waited >= BACKOFF / 2 && waited <= BACKOFF, "{waited:?}");
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_leaves_no_subscription_behind() {
    let store = MemoryBackend::new();
    let (holder, waiter) = (locker(store.client()), locker(store.client()));
    let _guard = holder.try_lock(&key("job:1")).await.unwrap().unwrap();
    let waiting = tokio::spawn(async move { waiter.lock(&key("job:1")).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.watched_keys(), vec![key("job:1")]);
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    assert!(store.watched_keys().is_empty());
}

#[tokio::test(start_paused = true)]
async fn sixteen_waiters_take_turns_with_one_store_call_per_handoff() {
    const WAITERS: u64 = 16;
    let store = MemoryBackend::new();
    let faults = Arc::new(Faults::default());
    let faulty = || Layered::new(Arc::new(store.client()), faults.clone());
    let holder = locker(faulty());
    let guard = holder.try_lock(&key("job:1")).await.unwrap().unwrap();
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let waiter = locker(faulty());
        tasks.push(tokio::spawn(async move {
            let guard = waiter.lock(&key("job:1")).await.unwrap();
            guard.release().await.unwrap();
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = faults.calls();
    let started = Instant::now();
    guard.release().await.unwrap();
    for task in tasks {
        task.await.unwrap();
    }
    // Each handoff: the release, and one acquire by the one waiter it woke. Waking every
    // waiter would cost up to 16 acquires per handoff.
    let calls = faults.calls() - before;
    assert_eq!(
        calls,
        1 + 2 * WAITERS,
        "{calls} store calls for {WAITERS} handoffs"
    );
    assert!(Instant::now() - started < BACKOFF / 2, "a waiter polled");
}
