//! Counts what the server received (`INFO commandstats`, `INFO stats`) to prove that every
//! operation is one command, a batch of 1,000 renewals is one pipeline of a few multi-key
//! script calls, and concurrent single calls coalesce into fewer script calls.

mod common;

use std::future::Future;
use std::time::Duration;

use common::{
    RedisClusterFactory, RedisFactory, acquire_all, cluster_calls, command_calls, info_field,
};
use distlock_core::{Lease, LockBackend, LockKey, Renewal};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_is_one_evalsha() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("round-trip").unwrap();
    // Warm up: the first call of each script may need a SCRIPT LOAD.
    let lease = redis.acquire(&key, TTL).await.unwrap().unwrap();
    redis.renew(&lease).await.unwrap();
    redis.fence(&lease).await.unwrap();
    redis.release(&lease).await.unwrap();
    harness_reset(&f).await;

    let lease = redis.acquire(&key, TTL).await.unwrap().unwrap();
    assert_eq!(f.calls("evalsha").await, 1, "acquire");
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(f.calls("evalsha").await, 2, "renew");
    redis.fence(&lease).await.unwrap();
    assert_eq!(f.calls("evalsha").await, 3, "fence");
    redis.release(&lease).await.unwrap();
    assert_eq!(f.calls("evalsha").await, 4, "release");
    // No other client command did part of the work (commands run inside the scripts are
    // counted under their own names, so GET, SET and INCR are not listed here).
    for other in ["eval", "script|load", "multi", "exec"] {
        assert_eq!(f.calls(other).await, 0, "unexpected {other}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_many_of_a_thousand_leases_is_one_pipeline() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys: Vec<LockKey> = (0..1000)
        .map(|i| LockKey::new(format!("batch-{i}")).unwrap())
        .collect();
    let leases = acquire_all(&redis, &keys, TTL).await;
    redis.renew_many(&leases[..1]).await.unwrap();
    harness_reset(&f).await;
    // The server counts one read from the socket per received chunk; one pipeline arrives
    // in a handful of reads, one request at a time would need one read per call.
    let reads_before = info_field(&f.server, "stats", "total_reads_processed").await;
    let renewed = redis.renew_many(&leases).await.unwrap();
    let reads = info_field(&f.server, "stats", "total_reads_processed").await - reads_before;
    assert_eq!(renewed.len(), 1000);
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    // Multi-key calls of at most 128 leases: 8 calls, not one per lease.
    let calls = f.calls("evalsha").await;
    assert!(
        calls <= 1000 / 128 + 2,
        "1,000 renewals took {calls} script calls"
    );
    // The INFO commands of this test are reads too.
    assert!(
        reads < 100,
        "1,000 renewals took {reads} socket reads: not one pipeline"
    );
    println!("renew_many(1000): {calls} EVALSHA in {reads} server socket reads");
}

async fn harness_reset(f: &RedisFactory) {
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_loaded_once_when_connecting() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys: Vec<LockKey> = (0..10)
        .map(|i| LockKey::new(format!("warm-{i}")).unwrap())
        .collect();
    let first = redis.acquire_many(&keys, TTL).await.unwrap();
    assert!(first.iter().all(Option::is_some));
    // The eleven scripts were loaded by `build`; the batch needed no reload.
    assert_eq!(command_calls(&f.server, "script|load").await, 13);
    let leases: Vec<_> = first.into_iter().flatten().collect();
    redis.release_many(&leases).await.unwrap();
    let again = redis.acquire_many(&keys, TTL).await.unwrap();
    assert!(again.iter().all(Option::is_some));
    assert_eq!(command_calls(&f.server, "script|load").await, 13);
}

/// Eight permit slots of one semaphore: a permit behind seven held slots, then a full
/// semaphore's refusal, each one EVALSHA as `evalsha()` counts them from `reset()`. Returns
/// the slots, and the leases on them, to look at and give back.
async fn a_permit_behind_seven_held_slots<R, C>(
    redis: &RedisBackend,
    reset: impl Fn() -> R,
    evalsha: impl Fn() -> C,
) -> (Vec<LockKey>, Vec<Lease>)
where
    R: Future<Output = ()>,
    C: Future<Output = u64>,
{
    let slots: Vec<LockKey> = (0..8)
        .map(|i| LockKey::new(format!("exports:permit:{i}")).unwrap())
        .collect();
    let mut held = acquire_all(redis, &slots[..7], TTL).await;
    reset().await;
    let last = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("slot 7 is free");
    assert_eq!(last.key(), &slots[7]);
    assert_eq!(evalsha().await, 1, "a permit behind seven held slots");
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    assert_eq!(evalsha().await, 2, "a full semaphore's refusal");
    held.push(last);
    (slots, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_is_one_evalsha_however_many_slots_are_held() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let (slots, held) =
        a_permit_behind_seven_held_slots(&redis, || harness_reset(&f), || f.calls("evalsha")).await;
    // The refusal marked the semaphore waited for, once, not each slot: the next release
    // of a slot announces it.
    for slot in &slots {
        let value = harness::require(f.server.command(&["GET", &redis.redis_key(slot)]).await);
        let value = value.as_text().unwrap_or_default();
        assert!(!value.ends_with(":w"), "{slot}: {value}");
    }
    let waited = harness::require(
        f.server
            .command(&["EXISTS", "distlock:{exports}:permits:waited"])
            .await,
    );
    assert_eq!(waited, harness::redis::RespValue::Integer(1));
    redis.release_many(&held).await.unwrap();
}

/// On a Redis Cluster a semaphore's permit slots share the hash slot of its name, so an
/// attempt is one script call on one shard there too, however many slots are held (it
/// was one call per slot, a round trip each, spread over the shards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_on_a_cluster_is_one_evalsha_on_one_shard() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let reset = || async {
        for node in f.cluster.nodes() {
            harness::require(node.command(&["CONFIG", "RESETSTAT"]).await);
        }
    };
    let (slots, held) =
        a_permit_behind_seven_held_slots(&redis, reset, || cluster_calls(&f.cluster, "evalsha"))
            .await;
    let (cluster, redis) = (&f.cluster, &redis);
    let shard = |slot: &LockKey| {
        let key = redis.redis_key(slot);
        async move { harness::require(cluster.node_for_key(key.as_bytes()).await).addr() }
    };
    for slot in &slots {
        assert_eq!(shard(slot).await, shard(&slots[0]).await, "{slot}");
    }
    redis.release_many(&held).await.unwrap();
}
