//! A Redis in cluster mode behind one address (one node holding every hash slot, as some
//! managed services offer): a client given a plain `redis://` URL sees `redis_mode:cluster`
//! and groups what it sends by slot, as it does on a Cluster. Without that, coalesced
//! acquires and batches of keys in different slots fail with CROSSSLOT, and so does the
//! token's high-water key beside a lock key of another slot.

mod common;

use std::time::Duration;

use common::acquire_all;
use distlock_core::{LockBackend, LockKey, Release, Renewal};
use futures::future::join_all;
use harness::redis::{RedisServer, RespValue};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);

/// One node in cluster mode that holds all 16,384 slots, and a client given its plain URL.
async fn one_node_cluster() -> (RedisServer, RedisBackend) {
    let server = cluster_mode_node().await;
    let redis = RedisBackend::builder()
        .url(server.url())
        .build()
        .await
        .expect("a plain URL to a node in cluster mode");
    (server, redis)
}

/// One node in cluster mode that holds all 16,384 slots.
async fn cluster_mode_node() -> RedisServer {
    let server = harness::require(RedisServer::builder().cluster(true).start().await);
    let added = harness::require(
        server
            .command(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
            .await,
    );
    assert_eq!(added, RespValue::Simple("OK".into()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = harness::require(server.command(&["CLUSTER", "INFO"]).await)
            .as_text()
            .unwrap_or_default();
        if info.contains("cluster_state:ok") {
            return server;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the one-node cluster did not come up: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_calls_coalesced_batches_and_renewals_work_on_a_one_address_cluster() {
    let (_server, redis) = one_node_cluster().await;
    let keys: Vec<LockKey> = (0..200)
        .map(|i| LockKey::new(format!("job:{i}")).unwrap())
        .collect();
    // Concurrent single acquires coalesce into batches of keys from many slots.
    let singles: Vec<_> = join_all(keys[..100].iter().map(|k| redis.acquire(k, TTL)))
        .await
        .into_iter()
        .map(|r| r.expect("an acquire").expect("a free key"))
        .collect();
    let batch = acquire_all(&redis, &keys[100..], TTL).await;
    let all: Vec<_> = singles.into_iter().chain(batch).collect();
    let renewed = redis.renew_many(&all).await.expect("renew_many");
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    let released = join_all(all[..100].iter().map(|l| redis.release(l))).await;
    assert!(
        released
            .into_iter()
            .all(|r| r.unwrap() == Release::Released)
    );
    let released = redis.release_many(&all[100..]).await.expect("release_many");
    assert!(released.iter().all(|r| *r == Release::Released));
    // Tokens still rise per key (each slot has its high-water key).
    let again = redis
        .acquire(&keys[0], TTL)
        .await
        .unwrap()
        .expect("a free key");
    assert!(again.token() > all[0].token());
}

/// `acquire_any` on a one-address cluster: keys of several hash slots are asked key by key
/// (one script over them is refused with CROSSSLOT), and a semaphore's permit slots, which
/// share the hash slot of its name, go as one script call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_any_takes_keys_of_several_slots_and_a_semaphores_slots_in_one_call() {
    let (server, redis) = one_node_cluster().await;
    let keys: Vec<LockKey> = ["report:a", "report:b", "report:c"]
        .into_iter()
        .map(|k| LockKey::new(k).unwrap())
        .collect();
    let mut slots_of_keys = Vec::new();
    for key in &keys {
        slots_of_keys.push(key_slot(&server, &redis.redis_key(key)).await);
    }
    assert!(
        slots_of_keys.windows(2).any(|w| w[0] != w[1]),
        "the keys must span slots for this case: {slots_of_keys:?}"
    );
    let first = redis.acquire_any(&keys, TTL).await.expect("acquire_any");
    let second = redis.acquire_any(&keys, TTL).await.expect("acquire_any");
    let (first, second) = (first.expect("a free key"), second.expect("a free key"));
    assert_ne!(first.key(), second.key());

    let slots: Vec<LockKey> = (0..4)
        .map(|i| LockKey::new(format!("exports:permit:{i}")).unwrap())
        .collect();
    let held = acquire_all(&redis, &slots[..3], TTL).await;
    harness::require(server.command(&["CONFIG", "RESETSTAT"]).await);
    let last = redis
        .acquire_any(&slots, TTL)
        .await
        .expect("acquire_any")
        .expect("slot 3 is free");
    assert_eq!(last.key(), &slots[3]);
    assert_eq!(common::command_calls(&server, "evalsha").await, 1);
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    assert_eq!(common::command_calls(&server, "evalsha").await, 2);
    redis.release_many(&held).await.unwrap();
}

/// The hash slot of a Redis key, as the node computes it.
async fn key_slot(server: &RedisServer, key: &str) -> RespValue {
    harness::require(server.command(&["CLUSTER", "KEYSLOT", key]).await)
}
