//! Waiters woken by releases on Redis: the subscriptions the server sees, and the
//! listener's reconnect after a server restart. (The shared cases in `conformance` show
//! the wake itself on single node and cluster.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::RedisFactory;
use distlock_core::{LockBackend, LockKey, Locker, RetryPolicy};
use harness::redis::RespValue;
use tokio::time::{Instant, sleep};

/// Far longer than a woken handoff takes, so a waiter that polls is obvious.
const BACKOFF: Duration = Duration::from_secs(20);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

fn waiting_locker(backend: Arc<dyn LockBackend>) -> Locker {
    Locker::builder(backend)
        .ttl(Duration::from_secs(30))
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(BACKOFF * 3))
        .build()
        .unwrap()
}

/// Subscribers of `channel`, as the server counts them (`PUBSUB NUMSUB`).
async fn subscribers(factory: &RedisFactory, channel: &str) -> i64 {
    match factory
        .server
        .command(&["PUBSUB", "NUMSUB", channel])
        .await
        .unwrap()
    {
        RespValue::Array(Some(items)) => match items.get(1) {
            Some(RespValue::Integer(n)) => *n,
            other => panic!("PUBSUB NUMSUB answered {other:?}"),
        },
        other => panic!("PUBSUB NUMSUB answered {other:?}"),
    }
}

/// Polls `subscribers` until it equals `want`, for at most 5 s.
async fn await_subscribers(factory: &RedisFactory, channel: &str, want: i64) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = subscribers(factory, channel).await;
        if n == want || Instant::now() > deadline {
            return n;
        }
        sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_share_one_subscription_and_leave_none_when_cancelled() {
    let factory = RedisFactory::start().await;
    let holder = factory.redis().await;
    let waiter: Arc<dyn LockBackend> = Arc::new(factory.redis().await);
    let k = key("wake:shared");
    let (channel, _) = holder.redis_keys(&k);
    let _held = holder
        .acquire(&k, Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let locker = waiting_locker(waiter.clone());
            let k = k.clone();
            tokio::spawn(async move { locker.lock(&k).await.map(drop) })
        })
        .collect();
    assert_eq!(
        await_subscribers(&factory, &channel, 1).await,
        1,
        "eight waiters in one process: one subscription"
    );
    for w in &waiters {
        w.abort();
    }
    for w in waiters {
        let _ = w.await;
    }
    assert_eq!(
        await_subscribers(&factory, &channel, 0).await,
        0,
        "no subscription once every waiter is gone"
    );
    assert!(waiter.watched_keys().is_empty());
}

/// A waiter in `Locker::lock` on `backend` for `k`; resolves to the instant it held it.
fn wait_for(
    backend: &Arc<dyn LockBackend>,
    k: &LockKey,
) -> tokio::task::JoinHandle<Result<Instant, distlock_core::LockError>> {
    let locker = waiting_locker(backend.clone());
    let k = k.clone();
    tokio::spawn(async move {
        let guard = locker.lock(&k).await?;
        let granted = Instant::now();
        guard.release().await?;
        Ok(granted)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_subscribes_again_after_a_server_restart() {
    let factory = RedisFactory::start().await;
    let holder = factory.redis().await;
    let waiter: Arc<dyn LockBackend> = Arc::new(factory.redis().await);
    let k = key("wake:restart");
    let (channel, _) = holder.redis_keys(&k);
    holder
        .acquire(&k, Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let waiting = wait_for(&waiter, &k);
    assert_eq!(await_subscribers(&factory, &channel, 1).await, 1);

    // The restart loses every key (no persistence) and the subscription. Releases while
    // the listener was away are not heard, so once it has subscribed again it wakes a
    // waiter of every watched key to look: this one finds the key free.
    let restarted = Instant::now();
    factory.server.restart().await.unwrap();
    let granted = waiting.await.unwrap().unwrap();
    assert!(
        granted - restarted < Duration::from_secs(5),
        "the waiter held the key {:?} after the restart; its backoff is {BACKOFF:?}",
        granted - restarted
    );

    // And the new subscription carries the next release. (The holder's first call after
    // the restart may find its connection broken: it tries again.)
    let mut lease = None;
    for _ in 0..10 {
        if let Ok(taken) = holder.acquire(&k, Duration::from_secs(30)).await {
            lease = Some(taken.expect("the key is free"));
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    let lease = lease.expect("the holder reconnected");
    let waiting = wait_for(&waiter, &k);
    assert_eq!(await_subscribers(&factory, &channel, 1).await, 1);
    let released = Instant::now();
    holder.release(&lease).await.unwrap();
    let granted = waiting.await.unwrap().unwrap();
    assert!(
        granted - released < Duration::from_secs(2),
        "the waiter held the key {:?} after the release; its backoff is {BACKOFF:?}",
        granted - released
    );
}
