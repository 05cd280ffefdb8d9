//! Tokens pass through Lua numbers (doubles), exact only below 2^53: an acquire whose
//! token would reach 2^53 fails clearly and takes nothing (the counter is put back); it
//! never hands out a rounded token twice.

mod common;

use std::time::Duration;

use common::RedisFactory;
use distlock_core::{LockBackend, LockError, LockKey, Release};
use futures::future::join_all;
use harness::redis::RespValue;
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
    set_counter(&f, &redis, &key, TWO_POW_53 - 2).await;

    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    assert_eq!(lease.token().get(), TWO_POW_53 - 1);
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    assert_overflow(redis.acquire(&key, TTL).await);
    assert!(
        !is_taken(&f, &redis, &key).await,
        "a failed acquire took the key"
    );
    let (_, fence_key) = redis.redis_keys(&key);
    let counter = harness::require(f.server.command(&["GET", fence_key.as_str()]).await);
    assert_eq!(
        counter.as_text(),
        Some((TWO_POW_53 - 1).to_string()),
        "the failed acquire left the counter moved"
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

// One thread: the first `SENT_AT_ONCE` acquires are in flight while every other one joins
// the queue, so the others go together as one multi-key script call.
#[tokio::test(flavor = "current_thread")]
async fn a_full_counter_fails_only_its_own_caller_in_a_coalesced_batch() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let full = LockKey::new("full").unwrap();
    set_counter(&f, &redis, &full, TWO_POW_53).await;
    let mut keys: Vec<LockKey> = (0..10)
        .map(|i| LockKey::new(format!("fine-{i}")).unwrap())
        .collect();
    keys.insert(lock_redis::SENT_AT_ONCE + 1, full.clone());

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

/// A backend whose counters are kept `retention` after they are made.
async fn with_retention(f: &RedisFactory, retention: Duration) -> RedisBackend {
    RedisBackend::builder()
        .url(f.url())
        .fence_retention(retention)
        .build()
        .await
        .expect("connect to the test server")
}

/// Waits until `key`'s counter has expired (at most 5 s).
async fn counter_gone(f: &RedisFactory, redis: &RedisBackend, key: &LockKey) {
    let (_, fence_key) = redis.redis_keys(key);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while harness::require(f.server.command(&["EXISTS", fence_key.as_str()]).await)
        != RespValue::Integer(0)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the counter never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_its_counter_expires_a_key_still_gets_a_higher_token() {
    let f = RedisFactory::start().await;
    let retention = Duration::from_millis(300);
    let redis = with_retention(&f, retention).await;
    let key = LockKey::new("retained").unwrap();
    let ttl = Duration::from_millis(100);
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let lease = redis.acquire(&key, ttl).await.unwrap().expect("free key");
        tokens.push(lease.token().get());
        assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    }
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
    let (_, fence_key) = redis.redis_keys(&key);
    let pttl = harness::require(f.server.command(&["PTTL", fence_key.as_str()]).await);
    match pttl {
        RespValue::Integer(ms) => assert!(
            ms > 0 && ms <= 300,
            "the counter's PTTL is {ms} ms, not within the 300 ms retention"
        ),
        other => panic!("PTTL: {other:?}"),
    }

    counter_gone(&f, &redis, &key).await;
    let next = redis.acquire(&key, ttl).await.unwrap().expect("free key");
    assert!(
        next.token().get() > *tokens.last().unwrap(),
        "token {} after the counter expired, not above {tokens:?}",
        next.token()
    );
    assert_eq!(redis.release(&next).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewed_past_its_counters_retention_stays_current() {
    let f = RedisFactory::start().await;
    let redis = with_retention(&f, Duration::from_millis(300)).await;
    let key = LockKey::new("long-job").unwrap();
    let ttl = Duration::from_millis(200);
    let lease = redis.acquire(&key, ttl).await.unwrap().expect("free key");
    let renewing = async {
        loop {
            assert!(matches!(
                redis.renew(&lease).await.unwrap(),
                distlock_core::Renewal::Renewed { .. }
            ));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        () = counter_gone(&f, &redis, &key) => {}
        () = renewing => unreachable!(),
    }
    assert_eq!(
        redis.fence(&lease).await.unwrap(),
        distlock_core::Fence::Current
    );
    let other = redis.acquire(&key, ttl).await.unwrap();
    assert!(other.is_none(), "the key was granted twice: {other:?}");
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    let next = redis.acquire(&key, ttl).await.unwrap().expect("free key");
    assert!(
        next.token() > lease.token(),
        "{} <= {}",
        next.token(),
        lease.token()
    );
}

/// The counter of `key` as the server holds it, and its PTTL in milliseconds.
async fn counter_and_pttl(f: &RedisFactory, redis: &RedisBackend, key: &LockKey) -> (u64, i64) {
    let (_, fence_key) = redis.redis_keys(key);
    let value = match harness::require(f.server.command(&["GET", fence_key.as_str()]).await) {
        RespValue::Bulk(Some(v)) => String::from_utf8(v).unwrap().parse().unwrap(),
        other => panic!("GET {fence_key}: {other:?}"),
    };
    match harness::require(f.server.command(&["PTTL", fence_key.as_str()]).await) {
        RespValue::Integer(ms) => (value, ms),
        other => panic!("PTTL {fence_key}: {other:?}"),
    }
}

/// Acquires `keys` together, as one `acquire_many` or as single acquires polled at once
/// (which coalesce into one batch behind the first `SENT_AT_ONCE`), releases them, and
/// returns the tokens.
async fn take_together(redis: &RedisBackend, keys: &[LockKey], coalesced: bool) -> Vec<u64> {
    let ttl = Duration::from_millis(100);
    let leases: Vec<_> = if coalesced {
        join_all(keys.iter().map(|k| redis.acquire(k, ttl)))
            .await
            .into_iter()
            .map(|l| l.unwrap().expect("free key"))
            .collect()
    } else {
        redis
            .acquire_many(keys, ttl)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.expect("free key"))
            .collect()
    };
    let tokens = leases.iter().map(|l| l.token().get()).collect();
    for released in redis.release_many(&leases).await.unwrap() {
        assert_eq!(released, Release::Released);
    }
    tokens
}

/// Keys taken together get their counters made at the server's clock when there are none,
/// counted up when they are kept, and made again, higher, after they expire.
async fn counters_are_made_counted_and_made_again_higher(coalesced: bool) {
    let f = RedisFactory::start().await;
    let redis = with_retention(&f, Duration::from_millis(300)).await;
    let keys: Vec<LockKey> = (0..lock_redis::SENT_AT_ONCE + 4)
        .map(|i| LockKey::new(format!("together-{i}")).unwrap())
        .collect();

    let made = take_together(&redis, &keys, coalesced).await;
    let clock_us = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap();
    for (key, &token) in keys.iter().zip(&made) {
        let (counter, pttl) = counter_and_pttl(&f, &redis, key).await;
        assert_eq!(counter, token, "the new counter holds the token it issued");
        assert!(
            pttl > 0 && pttl <= 300,
            "PTTL {pttl} ms, not within the retention"
        );
        assert!(
            token > clock_us - 60_000_000 && token <= clock_us,
            "a new counter starts at the server's clock in µs (now {clock_us}), not {token}"
        );
    }

    let counted = take_together(&redis, &keys, coalesced).await;
    for (before, after) in made.iter().zip(&counted) {
        assert_eq!(*after, before + 1, "a kept counter is counted up");
    }

    for key in &keys {
        counter_gone(&f, &redis, key).await;
    }
    let remade = take_together(&redis, &keys, coalesced).await;
    for (before, after) in counted.iter().zip(&remade) {
        assert!(
            after > before,
            "token {after} after the counter expired, not above {before}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_makes_counts_and_remakes_its_counters_with_rising_tokens() {
    counters_are_made_counted_and_made_again_higher(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_acquires_make_count_and_remake_their_counters_with_rising_tokens() {
    counters_are_made_counted_and_made_again_higher(true).await;
}
