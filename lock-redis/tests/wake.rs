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

/// A server (`F` a single node's or a cluster's factory); a backend holding a key for
/// 30 s; a second backend instance, to wait on.
struct Held<F> {
    factory: F,
    holder: lock_redis::RedisBackend,
    waiter: Arc<dyn LockBackend>,
    key: LockKey,
    /// The key's channel: its name in Redis.
    channel: String,
    lease: distlock_core::Lease,
}

impl<F> Held<F> {
    /// `holder` takes the key `name`, for 30 s.
    async fn taken(
        factory: F,
        holder: lock_redis::RedisBackend,
        waiter: lock_redis::RedisBackend,
        name: &str,
    ) -> Self {
        let key = key(name);
        let channel = holder.redis_key(&key);
        let lease = holder
            .acquire(&key, Duration::from_secs(30))
            .await
            .unwrap()
            .expect("a free key");
        Held {
            factory,
            holder,
            waiter: Arc::new(waiter),
            key,
            channel,
            lease,
        }
    }
}

async fn held(name: &str) -> Held<RedisFactory> {
    let factory = RedisFactory::start().await;
    let (holder, waiter) = (factory.redis().await, factory.redis().await);
    Held::taken(factory, holder, waiter, name).await
}

/// [`held`] on a cluster.
async fn held_on_cluster(name: &str) -> Held<common::RedisClusterFactory> {
    let factory = common::RedisClusterFactory::start().await;
    let (holder, waiter) = (factory.redis().await, factory.redis().await);
    Held::taken(factory, holder, waiter, name).await
}

/// The count in a `PUBSUB NUMSUB` or `SHARDNUMSUB` reply for one channel.
fn count_in(reply: RespValue) -> i64 {
    match &reply {
        RespValue::Array(Some(items)) => match items.get(1) {
            Some(RespValue::Integer(n)) => *n,
            _ => panic!("PUBSUB answered {reply:?}"),
        },
        _ => panic!("PUBSUB answered {reply:?}"),
    }
}

/// Subscribers of `channel`, as the server counts them (`PUBSUB NUMSUB`).
async fn subscribers(factory: &RedisFactory, channel: &str) -> i64 {
    count_in(
        factory
            .server
            .command(&["PUBSUB", "NUMSUB", channel])
            .await
            .unwrap(),
    )
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
    let Held {
        factory,
        waiter,
        key: k,
        channel,
        ..
    } = held("wake:shared").await;
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

/// Releases `lease` of `holder`: how long `waiting` then took to hold its key.
async fn handoff(
    holder: &lock_redis::RedisBackend,
    lease: &distlock_core::Lease,
    waiting: tokio::task::JoinHandle<Result<Instant, distlock_core::LockError>>,
) -> Duration {
    let released = Instant::now();
    holder.release(lease).await.unwrap();
    let granted = waiting.await.unwrap().unwrap();
    granted - released
}

/// Asserts that the waiter `waiting` holds its key well within its backoff after `holder`
/// releases `lease`: it was woken (its listener subscribed again), not left to poll.
async fn woken_well_within_its_backoff(
    holder: &lock_redis::RedisBackend,
    lease: &distlock_core::Lease,
    waiting: tokio::task::JoinHandle<Result<Instant, distlock_core::LockError>>,
) {
    let handoff = handoff(holder, lease, waiting).await;
    assert!(
        handoff < Duration::from_secs(2),
        "the waiter held the key {:?} after the release; its backoff is {BACKOFF:?}",
        handoff
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_subscribes_again_after_a_server_restart() {
    let held = held("wake:restart").await;
    let (holder, waiter, k) = (&held.holder, &held.waiter, &held.key);
    let waiting = wait_for(waiter, k);
    assert_eq!(await_subscribers(&held.factory, &held.channel, 1).await, 1);

    // The restart loses every key (no persistence) and the subscription. Releases while
    // the listener was away are not heard, so once it has subscribed again it wakes a
    // waiter of every watched key to look: this one finds the key free.
    let restarted = Instant::now();
    held.factory.server.restart().await.unwrap();
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
        if let Ok(taken) = holder.acquire(k, Duration::from_secs(30)).await {
            lease = Some(taken.expect("the key is free"));
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    let lease = lease.expect("the holder reconnected");
    let waiting = wait_for(waiter, k);
    assert_eq!(await_subscribers(&held.factory, &held.channel, 1).await, 1);
    woken_well_within_its_backoff(holder, &lease, waiting).await;
}

/// The listener's backoff lengthens only over failed connects in a row: after many drops,
/// each followed by a good connection, the next drop is followed again at once, not after
/// the longest pause (2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listeners_backoff_starts_afresh_after_each_good_connection() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = key("reconnects");
    let channel = redis.redis_key(&key);
    let _watch = redis.watch_releases(&key).expect("wake-ups are on");
    assert_eq!(await_subscribers(&f, &channel, 1).await, 1);
    let mut back_after = Duration::ZERO;
    for _ in 0..8 {
        harness::require(
            f.server
                .command(&["CLIENT", "KILL", "TYPE", "pubsub"])
                .await,
        );
        let killed = Instant::now();
        assert_eq!(
            await_subscribers(&f, &channel, 1).await,
            1,
            "subscribed again"
        );
        back_after = killed.elapsed();
    }
    // Without the reset, the pause has doubled from 50 ms to its 2 s ceiling by now.
    assert!(
        back_after < Duration::from_millis(1_500),
        "the 8th drop was followed after {back_after:?}"
    );
}

/// Shard-channel subscribers of `channel` over every node of `cluster`
/// (`PUBSUB SHARDNUMSUB`).
async fn shard_subscribers(cluster: &common::RedisClusterFactory, channel: &str) -> i64 {
    let mut total = 0;
    for node in cluster.cluster.nodes() {
        total += count_in(
            node.command(&["PUBSUB", "SHARDNUMSUB", channel])
                .await
                .unwrap(),
        );
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_release_on_a_cluster_is_announced_on_the_keys_shard_only() {
    let held = held_on_cluster("wake:sharded").await;
    let factory = &held.factory;
    let woken = wait_for(&held.waiter, &held.key);
    // The listener follows the key on its shard, not with a node-wide SUBSCRIBE.
    await_shard_subscription(factory, &held.channel).await;
    sleep(Duration::from_millis(200)).await;
    let (publishes, spublishes) = (
        common::cluster_calls(&factory.cluster, "publish").await,
        common::cluster_calls(&factory.cluster, "spublish").await,
    );

    let handoff = handoff(&held.holder, &held.lease, woken).await;
    assert!(
        handoff < BACKOFF / 4,
        "the waiter polled instead of being woken: {handoff:?}"
    );
    assert_eq!(
        common::cluster_calls(&factory.cluster, "publish").await,
        publishes,
        "a release on a cluster PUBLISHed, which goes to every node"
    );
    assert!(
        common::cluster_calls(&factory.cluster, "spublish").await > spublishes,
        "the waited release was not announced with SPUBLISH"
    );
}

/// Waits, at most 5 s, for one shard-channel subscriber of `channel`.
async fn await_shard_subscription(cluster: &common::RedisClusterFactory, channel: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while shard_subscribers(cluster, channel).await != 1 {
        assert!(
            Instant::now() < deadline,
            "no shard-channel subscription to {channel}"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// Ends the connection of `node`'s one client with shard-channel subscriptions.
async fn kill_shard_subscriber(node: &harness::redis::RedisServer) {
    let clients = harness::require(node.command(&["CLIENT", "LIST"]).await)
        .as_text()
        .unwrap_or_default();
    let ids: Vec<String> = clients
        .lines()
        .filter(|l| l.split(' ').any(|field| field == "ssub=1"))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect();
    assert_eq!(ids.len(), 1, "one shard subscriber: {clients}");
    harness::require(
        node.command(&["CLIENT", "KILL", "ID", ids[0].as_str()])
            .await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_listener_subscribes_again_after_a_drop_and_wakes_the_waiters() {
    let held = held_on_cluster("wake:sharded-drop").await;
    let (factory, holder, waiter, k) = (&held.factory, &held.holder, &held.waiter, &held.key);
    let channel = &held.channel;
    let waiting = wait_for(waiter, k);
    await_shard_subscription(factory, channel).await;

    // The key goes without an announcement (as when a release came while the listener
    // was away), then the listener's connection to the key's shard drops. The cluster
    // connection subscribes again by itself; hearing it do so, the listener wakes the
    // waiter to look, and it finds the key free.
    let node = harness::require(factory.cluster.node_for_key(channel.as_bytes()).await);
    harness::require(node.command(&["DEL", channel.as_str()]).await);
    let dropped = Instant::now();
    kill_shard_subscriber(node).await;
    let granted = waiting.await.unwrap().unwrap();
    assert!(
        granted - dropped < Duration::from_secs(5),
        "the waiter held the key {:?} after the drop; its backoff is {BACKOFF:?}",
        granted - dropped
    );

    // And the subscription made again carries the next release.
    let lease = holder
        .acquire(k, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the key is free");
    let waiting = wait_for(waiter, k);
    await_shard_subscription(factory, channel).await;
    sleep(Duration::from_millis(200)).await;
    woken_well_within_its_backoff(holder, &lease, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_release_on_a_cluster_announces_each_waited_key_on_its_shard() {
    let factory = common::RedisClusterFactory::start().await;
    let holder = factory.redis().await;
    let waiter: Arc<dyn LockBackend> = Arc::new(factory.redis().await);
    // Keys of different slots, and one nobody waits for.
    let keys: Vec<LockKey> = (0..3).map(|i| key(&format!("wake:batch:{i}"))).collect();
    let leases = common::acquire_all(&holder, &keys, Duration::from_secs(30)).await;
    let waiting: Vec<_> = keys[..2].iter().map(|k| wait_for(&waiter, k)).collect();
    for k in &keys[..2] {
        await_shard_subscription(&factory, &holder.redis_key(k)).await;
    }
    sleep(Duration::from_millis(200)).await;
    let (publishes, spublishes) = (
        common::cluster_calls(&factory.cluster, "publish").await,
        common::cluster_calls(&factory.cluster, "spublish").await,
    );

    let released = Instant::now();
    holder.release_many(&leases).await.unwrap();
    for w in waiting {
        let granted = w.await.unwrap().unwrap();
        assert!(
            granted - released < BACKOFF / 4,
            "a waiter polled instead of being woken: {:?}",
            granted - released
        );
    }
    assert_eq!(
        common::cluster_calls(&factory.cluster, "publish").await,
        publishes
    );
    assert_eq!(
        common::cluster_calls(&factory.cluster, "spublish").await,
        spublishes + 2
    );
}

/// Waiters of one process take the key one after another: every release wakes the next,
/// not only the first one (the key each of them is granted is marked waited for, since
/// the others still watch it and made their one attempt before it was granted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_release_in_a_chain_of_waiters_of_one_process_wakes_the_next() {
    let held = held("wake:chain").await;
    let (k, locker) = (&held.key, waiting_locker(held.waiter.clone()));
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let (locker, k) = (locker.clone(), k.clone());
            tokio::spawn(async move {
                let guard = locker.lock(&k).await?;
                let granted = Instant::now();
                sleep(Duration::from_millis(50)).await;
                guard.release().await?;
                Ok::<_, distlock_core::LockError>(granted)
            })
        })
        .collect();
    assert_eq!(await_subscribers(&held.factory, &held.channel, 1).await, 1);
    // Each has made its first attempt, found the key held, and sleeps in its backoff.
    sleep(Duration::from_millis(200)).await;
    let released = Instant::now();
    held.holder.release(&held.lease).await.unwrap();
    let last = last_grant(waiting, released).await;
    assert!(
        last < Duration::from_secs(2),
        "the third waiter held the key {last:?} after the first release; each holds it \
         50 ms, and the backoff is {BACKOFF:?}"
    );
}

/// How long after `released` the last of `waiting` was granted.
async fn last_grant(
    waiting: Vec<tokio::task::JoinHandle<Result<Instant, distlock_core::LockError>>>,
    released: Instant,
) -> Duration {
    let mut last = Duration::ZERO;
    for waiting in waiting {
        let granted = waiting.await.unwrap().unwrap();
        last = last.max(granted - released);
    }
    last
}

/// The same for a semaphore's permits: waiters of one process take the freed permits one
/// after another, each release waking the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_permit_release_in_a_chain_of_waiters_of_one_process_wakes_the_next() {
    let factory = RedisFactory::start().await;
    let holder: Arc<dyn LockBackend> = Arc::new(factory.redis().await);
    let waiter: Arc<dyn LockBackend> = Arc::new(factory.redis().await);
    let name = key("wake:permits");
    let held = waiting_locker(holder).semaphore(&name, 2).unwrap();
    let (first, second) = (
        held.try_acquire().await.unwrap(),
        held.try_acquire().await.unwrap(),
    );
    let (first, second) = (
        first.expect("a free permit"),
        second.expect("a free permit"),
    );
    let waiting = waiting_locker(waiter).semaphore(&name, 2).unwrap();
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            let semaphore = waiting.clone();
            tokio::spawn(async move {
                let permit = semaphore.acquire().await?;
                let granted = Instant::now();
                sleep(Duration::from_millis(50)).await;
                permit.release().await?;
                Ok::<_, distlock_core::LockError>(granted)
            })
        })
        .collect();
    sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    first.release().await.unwrap();
    second.release().await.unwrap();
    let last = last_grant(waiting, released).await;
    assert!(
        last < Duration::from_secs(2),
        "the fourth waiter held a permit {last:?} after the first releases; each holds it \
         50 ms, and the backoff is {BACKOFF:?}"
    );
}
