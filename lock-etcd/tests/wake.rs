//! Waiters woken by etcd: a waiter in `Locker::lock` whose backoff is long is granted the
//! key soon after it is released or its holder's lease expires, because the backend's one
//! watch on its lock keys hears the delete; the watch comes back after etcd restarts; a
//! cancelled waiter leaves no watched key behind.
//!
//! Holders and waiters use separate backends, as separate processes would: a waiter hears
//! a release through etcd, never in-process.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{EtcdFactory, until_answered};
use distlock_core::{FencingToken, Lease, LockBackend, LockKey, Locker, RetryPolicy};
use lock_etcd::EtcdBackend;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

/// The holder's TTL where the test releases the key itself.
const HELD: Duration = Duration::from_secs(30);
/// A waiter's backoff: a waiter that polls takes the key at least half of it after its
/// last attempt, so one that takes it within [`WOKEN_WITHIN`] of a release was woken.
const BACKOFF: Duration = Duration::from_secs(5);
/// Generous for a loaded machine; a woken handoff takes milliseconds.
const WOKEN_WITHIN: Duration = Duration::from_secs(1);
/// Long enough for a waiter's first attempt to be refused and its wait to begin.
const SETTLE: Duration = Duration::from_millis(500);

fn key(name: &str) -> LockKey {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    LockKey::new(format!("etcd-wake:{random:016x}:{name}")).unwrap()
}

fn locker(backend: &EtcdBackend, backoff: Duration) -> Locker {
    Locker::builder(Arc::new(backend.clone()))
        .ttl(HELD)
        .retry(RetryPolicy {
            initial: backoff,
            max: backoff,
        })
        .wait_timeout(Some(Duration::from_secs(120)))
        .build()
        .unwrap()
}

/// Waits for `key` in `Locker::lock` on its own task; answers when and with which token
/// it was granted.
fn wait_for(locker: Locker, key: &LockKey) -> JoinHandle<(Instant, FencingToken)> {
    let key = key.clone();
    tokio::spawn(async move {
        let guard = locker.lock(&key).await.unwrap();
        let granted = (Instant::now(), guard.token());
        guard.release().await.unwrap();
        granted
    })
}

/// The waiter was granted the key within [`WOKEN_WITHIN`] of its release at
/// `released_at`, with a token above the released lease's.
async fn woken_by_the_release(
    waiting: JoinHandle<(Instant, FencingToken)>,
    released_at: Instant,
    held: &Lease,
) {
    let (granted_at, token) = waiting.await.unwrap();
    assert!(
        granted_at - released_at < WOKEN_WITHIN,
        "granted {:?} after the release",
        granted_at - released_at
    );
    assert!(token > held.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_well_before_its_backoff() {
    let factory = EtcdFactory::single().await;
    let (holder, waiter) = (factory.etcd().await, factory.etcd().await);
    assert!(waiter.capabilities().wakes_waiters);
    let k = key("release");
    let held = holder.acquire(&k, HELD).await.unwrap().unwrap();
    let waiting = wait_for(locker(&waiter, BACKOFF), &k);
    sleep(SETTLE).await;

    let released_at = Instant::now();
    holder.release(&held).await.unwrap();
    woken_by_the_release(waiting, released_at, &held).await;
}

/// etcd deletes the key of a lease that ran out, and the watch hears that delete too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_wakes_a_waiter_before_its_backoff() {
    const TTL: Duration = Duration::from_secs(2);
    const LONG_BACKOFF: Duration = Duration::from_secs(10);
    let factory = EtcdFactory::single().await;
    let (holder, waiter) = (factory.etcd().await, factory.etcd().await);
    let k = key("expiry");
    let acquired_at = Instant::now();
    let held = holder.acquire(&k, TTL).await.unwrap().unwrap();
    // The holder never renews nor releases.
    let (granted_at, token) = wait_for(locker(&waiter, LONG_BACKOFF), &k).await.unwrap();

    let waited = granted_at - acquired_at;
    assert!(waited >= TTL, "granted {waited:?} into a {TTL:?} lease");
    // etcd checks expiry about every 500 ms; a waiter that polled would wait at least
    // half its backoff after its first attempt.
    assert!(
        waited < TTL + WOKEN_WITHIN + Duration::from_millis(500),
        "granted {waited:?} after the {TTL:?} lease was taken"
    );
    assert!(token > held.token());
}

/// The watch breaks when etcd goes down and is opened again once it is back: a release
/// after the restart still wakes the waiter, whose backoff is longer than the whole test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_etcd_restarted_still_wakes_the_waiter() {
    const LONGER_THAN_THE_TEST: Duration = Duration::from_secs(60);
    let factory = EtcdFactory::private_single().await;
    let server = factory.single_server().expect("a single node");
    let (holder, waiter) = (factory.etcd().await, factory.etcd().await);
    let k = key("restart");
    let held = holder.acquire(&k, HELD).await.unwrap().unwrap();
    let waiting = wait_for(locker(&waiter, LONGER_THAN_THE_TEST), &k);
    sleep(SETTLE).await;

    server.kill().unwrap();
    server.restart().await.unwrap();
    // Time for the listener to notice the broken stream and open a new one (it pauses at
    // most 2 s between attempts).
    sleep(Duration::from_secs(4)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let released = until_answered("release", deadline, || holder.release(&held)).await;
    let released_at = Instant::now();
    assert_eq!(released, distlock_core::Release::Released);

    woken_by_the_release(waiting, released_at, &held).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_waiter_leaves_no_watched_key() {
    let factory = EtcdFactory::single().await;
    let (holder, waiter) = (factory.etcd().await, factory.etcd().await);
    let k = key("cancel");
    let held = holder.acquire(&k, HELD).await.unwrap().unwrap();
    let waiting = wait_for(locker(&waiter, BACKOFF), &k);
    sleep(SETTLE).await;
    assert_eq!(waiter.watched_keys(), std::slice::from_ref(&k));

    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    assert!(
        waiter.watched_keys().is_empty(),
        "{:?}",
        waiter.watched_keys()
    );
    holder.release(&held).await.unwrap();
}
