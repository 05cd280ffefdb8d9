//! The cluster client may send a script again after a connection drop that happened after
//! the script ran. An acquire sent twice with the same owner id must then return the
//! lease it took, not "held by someone else" while its own attempt holds the key; a
//! release must never be sent twice (the second run would say "not held").

mod common;

use std::time::Duration;

use common::{RedisClusterFactory, RedisFactory};
use distlock_core::{LockBackend, LockError, LockKey};
use harness::{proxy::FaultProxy, redis::RespValue};
use lock_redis::RedisBackend;
use tokio::time::Instant;

/// The scripts as the backend sends them: `token.lua` first.
const ACQUIRE: &str = concat!(
    include_str!("../src/scripts/token.lua"),
    include_str!("../src/scripts/acquire.lua")
);
const ACQUIRE_MANY: &str = concat!(
    include_str!("../src/scripts/token.lua"),
    include_str!("../src/scripts/acquire_many.lua")
);
const ACQUIRE_ANY: &str = concat!(
    include_str!("../src/scripts/token.lua"),
    include_str!("../src/scripts/acquire_any.lua")
);
const TTL: Duration = Duration::from_secs(10);

/// `script` (one of the single-key acquires) sent again straight to the server for
/// `lock_key` as `owner`, with a 10 s TTL: what a resent attempt gets back.
async fn resend(f: &RedisFactory, script: &str, lock_key: &str, owner: &str) -> RespValue {
    let args = [
        "EVAL",
        script,
        "2",
        lock_key,
        "distlock:tokens",
        owner,
        "10000",
    ];
    harness::require(f.server.command(&args).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_sent_again_with_its_owner_id_returns_the_same_token() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("resent").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    let lock_key = redis.redis_key(&key);
    let owner = lease.owner().to_string();
    let token = RespValue::Bulk(Some(lease.token().get().to_string().into_bytes()));

    let again = resend(&f, ACQUIRE, &lock_key, &owner).await;
    assert_eq!(again, token, "the single-key script");
    let again = resend(&f, ACQUIRE_MANY, &lock_key, &owner).await;
    assert_eq!(
        again,
        RespValue::Array(Some(vec![token])),
        "the batch script"
    );

    // Someone else's attempt is still refused, and the token did not move.
    let other = resend(&f, ACQUIRE, &lock_key, "someone-else").await;
    assert_eq!(other, RespValue::Bulk(None));
    assert_eq!(
        redis.inspect(&key).await.unwrap().token,
        Some(lease.token())
    );
}

/// `acquire_any` sent again (flagged `R`) with its owner id returns the slot it took, with
/// its token, even when a slot before it has come free meanwhile: a resent attempt never
/// takes a second slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_any_sent_again_returns_the_slot_it_took() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots: Vec<LockKey> = (0..3)
        .map(|i| LockKey::new(format!("resent:permit:{i}")).unwrap())
        .collect();
    let first = redis
        .acquire(&slots[0], TTL)
        .await
        .unwrap()
        .expect("free slot");
    let lease = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("a free slot");
    assert_eq!(lease.key(), &slots[1]);
    redis.release(&first).await.unwrap();

    let lock_keys: Vec<String> = slots.iter().map(|s| redis.redis_key(s)).collect();
    let owner = lease.owner().to_string();
    let mut args = vec!["EVAL", ACQUIRE_ANY, "4"];
    args.extend(lock_keys.iter().map(String::as_str));
    args.extend(["distlock:tokens", owner.as_str(), "10000", "0", "R"]);
    let again = harness::require(f.server.command(&args).await);
    assert_eq!(
        again,
        RespValue::Array(Some(vec![
            RespValue::Integer(2),
            RespValue::Bulk(Some(lease.token().get().to_string().into_bytes())),
        ]))
    );
    // Slot 0 stayed free: the resent attempt took nothing more.
    assert_eq!(redis.inspect(&slots[0]).await.unwrap().owner, None);
    redis.release(&lease).await.unwrap();
}

/// A cluster whose master for `key` is reached through a fault proxy (the node announces
/// the proxy's port), and a client with room for a resend within its response timeout.
async fn cluster_behind_a_proxy(key: &LockKey) -> (RedisClusterFactory, FaultProxy, RedisBackend) {
    let f = RedisClusterFactory::start().await;
    let probe = f.redis().await;
    let lock_key = probe.redis_key(key);
    let master = harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await);
    let proxy = harness::require(FaultProxy::start(master.addr()).await);
    let proxy_port = proxy.port().to_string();
    harness::require(
        master
            .command(&["CONFIG", "SET", "cluster-announce-port", &proxy_port])
            .await,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    for node in f.cluster.nodes() {
        loop {
            let nodes = harness::require(node.command(&["CLUSTER", "NODES"]).await)
                .as_text()
                .unwrap_or_default();
            if nodes.contains(&format!(":{proxy_port}@")) {
                break;
            }
            assert!(Instant::now() < deadline, "the new port was never gossiped");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let redis = RedisBackend::builder()
        .cluster_urls(f.cluster.urls())
        .request_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("connect to the test cluster");
    (f, proxy, redis)
}

/// Runs `release` while the link to the lock's master is slow, and resets the connection
/// after the release has reached the server but before its reply is back.
async fn release_losing_its_reply<T>(
    proxy: &FaultProxy,
    release: impl std::future::Future<Output = T> + Send + 'static,
) -> T
where
    T: Send + 'static,
{
    proxy.delay(Duration::from_millis(300));
    let release = tokio::spawn(release);
    tokio::time::sleep(Duration::from_millis(450)).await;
    proxy.reset();
    // Healing at once could let the held-back reply through before the reset.
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.heal();
    release.await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_release_whose_reply_was_lost_is_not_sent_again() {
    let key = LockKey::new("released-once").unwrap();
    let (_f, proxy, redis) = cluster_behind_a_proxy(&key).await;
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");

    let outcome = release_losing_its_reply(&proxy, {
        let (redis, lease) = (redis.clone(), lease.clone());
        async move { redis.release(&lease).await }
    })
    .await;
    assert!(
        matches!(outcome, Err(LockError::OutcomeUnknown { .. })),
        "a release that ran must never be reported as not held: {outcome:?}"
    );
    assert_eq!(redis.inspect(&key).await.unwrap().owner, None, "it ran");

    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    // Batches ask for the slot map first: have it cached before the link turns slow.
    redis
        .renew_many(std::slice::from_ref(&lease))
        .await
        .unwrap();
    let outcome = release_losing_its_reply(&proxy, {
        let (redis, lease) = (redis.clone(), lease.clone());
        async move { redis.release_many(&[lease]).await }
    })
    .await;
    assert!(
        matches!(outcome, Err(LockError::OutcomeUnknown { .. })),
        "the batch form: {outcome:?}"
    );
    assert_eq!(redis.inspect(&key).await.unwrap().owner, None);
}

/// On a cluster `acquire_any` over a semaphore's slots is one script call (the slots share
/// one hash slot). Its connection reset after the script ran, and a slot before the one
/// it took freed meanwhile: the call is sent again flagged `R` and returns the slot it
/// took; sent again unflagged (as the cluster client's retrying connection would), it
/// would take the freed slot as well and hold two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_acquire_any_whose_reply_was_lost_holds_one_slot() {
    let slots: Vec<LockKey> = (0..3)
        .map(|i| LockKey::new(format!("resent-any:permit:{i}")).unwrap())
        .collect();
    let (f, proxy, redis) = cluster_behind_a_proxy(&slots[0]).await;
    // Slot 0 held by another attempt: the call takes slot 1.
    let held = redis.acquire(&slots[0], TTL).await.unwrap();
    assert!(held.is_some(), "slot 0 was free");
    let slot_0 = redis.redis_key(&slots[0]);

    // Each way takes a second: the script runs about 1 s after the call, its reply would
    // be back about 1 s after that.
    proxy.delay(Duration::from_secs(1));
    let attempt = tokio::spawn({
        let (redis, slots) = (redis.clone(), slots.clone());
        async move { redis.acquire_any(&slots, TTL).await }
    });
    let slot_1 = redis.redis_key(&slots[1]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !held_on_a_node(&f, &slot_1).await {
        assert!(Instant::now() < deadline, "the attempt never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Slot 0's holder goes (a release, or its TTL) before the call is sent again.
    // Straight to the nodes, past the proxy: only slot 0's master deletes it (the others
    // answer MOVED, an error here).
    let mut deleted = 0;
    for node in f.cluster.nodes() {
        if let Ok(RespValue::Integer(n)) = node.command(&["DEL", &slot_0]).await {
            deleted += n;
        }
    }
    assert_eq!(deleted, 1, "slot 0 was held");
    assert!(
        !attempt.is_finished(),
        "the reply came back before the connection was reset"
    );
    proxy.reset();
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.heal();
    let lease = attempt
        .await
        .unwrap()
        .expect("sent again, the call learns the slot it took")
        .expect("a slot was free");
    assert_eq!(lease.key(), &slots[1], "the slot the first run took");
    let mut owners = Vec::new();
    for slot in &slots {
        owners.push(redis.inspect(slot).await.unwrap().owner);
    }
    assert_eq!(
        owners,
        vec![None, Some(lease.owner()), None],
        "one slot held by the attempt, the freed one left free"
    );
    redis.release(&lease).await.unwrap();
}

/// True when a node, asked directly, holds `key` (its master: the others answer MOVED).
async fn held_on_a_node(f: &RedisClusterFactory, key: &str) -> bool {
    for node in f.cluster.nodes() {
        if let Ok(RespValue::Bulk(Some(_))) = node.command(&["GET", key]).await {
            return true;
        }
    }
    false
}
