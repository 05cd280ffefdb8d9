//! The token counter is counted in Lua numbers (doubles): from 2^53 on, `counter + 1`
//! would round back and repeat a token. Such an acquire fails clearly and takes nothing;
//! it never hands out the same token twice.

mod common;

use std::time::Duration;

use common::RedisFactory;
use futures::future::join_all;
use harness::redis::RespValue;
use lock_api::{LockBackend, LockError, LockKey, Release};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const TWO_POW_53: u64 = 1 << 53;

async fn set_counter(f: &RedisFactory, redis: &RedisBackend, key: &LockKey, value: u64) {
    let (_, fence_key) = redis.redis_keys(key);
    let value = value.to_string();
    harness::require(f.server.command(&["SET", fence_key.as_str(), &value]).await);
}

async fn is_taken(f: &RedisFactory, redis: &RedisBackend, key: &LockKey) -> bool {
    let (lock_key, _) = redis.redis_keys(key);
    harness::require(f.server.command(&["EXISTS", lock_key.as_str()]).await)
        != RespValue::Integer(0)
}

fn assert_overflow<T: std::fmt::Debug>(outcome: Result<T, LockError>) {
    match outcome {
        Err(e @ LockError::Backend { .. }) => {
            assert!(e.to_string().contains("2^53"), "{e}");
            assert!(!e.is_retryable());
        }
        other => panic!("expected the counter overflow error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_exact_token_is_issued_once_and_the_next_acquire_fails_clearly() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("nearly-full").unwrap();
    set_counter(&f, &redis, &key, TWO_POW_53 - 1).await;

    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    assert_eq!(lease.token().get(), TWO_POW_53);
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    assert_overflow(redis.acquire(&key, TTL).await);
    assert!(
        !is_taken(&f, &redis, &key).await,
        "a failed acquire took the key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_full_counter_fails_and_keeps_nothing() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let full = LockKey::new("full").unwrap();
    let fine = LockKey::new("fine").unwrap();
    set_counter(&f, &redis, &full, TWO_POW_53).await;

    assert_overflow(redis.acquire_many(&[fine.clone(), full.clone()], TTL).await);
    assert!(!is_taken(&f, &redis, &full).await);
    assert!(
        !is_taken(&f, &redis, &fine).await,
        "the failed batch kept a lock"
    );
}

// One thread: the first acquire is in flight while every other one joins the queue, so
// the others go together as one multi-key script call.
#[tokio::test(flavor = "current_thread")]
async fn a_full_counter_fails_only_its_own_caller_in_a_coalesced_batch() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let full = LockKey::new("full").unwrap();
    set_counter(&f, &redis, &full, TWO_POW_53).await;
    let mut keys: Vec<LockKey> = (0..10)
        .map(|i| LockKey::new(format!("fine-{i}")).unwrap())
        .collect();
    keys.insert(5, full.clone());

    let results = join_all(keys.iter().map(|k| redis.acquire(k, TTL))).await;
    for (key, result) in keys.iter().zip(results) {
        if *key == full {
            assert_overflow(result);
        } else {
            let lease = result.unwrap().expect("free key");
            assert_eq!(lease.key(), key);
            assert!(is_taken(&f, &redis, key).await);
        }
    }
    assert!(!is_taken(&f, &redis, &full).await);
}
