//! `replica_acks`: an acquire holds only once enough replicas have the write (`WAIT`);
//! otherwise it fails, says how many acknowledged, and leaves the key free.

mod common;

use std::time::Duration;

use conformance::harness::{self, redis::RedisServer, redis::RespValue};
use lock_api::{LockBackend, LockError, LockKey, Release};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_holds_only_when_the_replica_acknowledges() {
    let master = harness::require(RedisServer::start().await);
    let replica = harness::require(
        RedisServer::builder()
            .replica_of(master.addr())
            .start()
            .await,
    );
    let redis = RedisBackend::builder()
        .url(master.url())
        .response_timeout(Duration::from_secs(2))
        .replica_acks(1, WAIT)
        .build()
        .await
        .expect("connect");

    let key = LockKey::new("replicated").unwrap();
    let lease = redis
        .acquire(&key, TTL)
        .await
        .expect("the replica acknowledged")
        .expect("free key");
    let (lock_key, fence_key) = redis.redis_keys(&key);
    // WAIT returned 1: the replica already has the lock.
    assert_eq!(
        harness::require(replica.command(&["GET", lock_key.as_str()]).await).as_text(),
        Some(lease.owner().to_string())
    );
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    harness::require(replica.pause());
    let outcome = redis.acquire(&key, TTL).await;
    harness::require(replica.resume());
    let err = outcome.expect_err("a paused replica cannot acknowledge");
    assert!(
        matches!(&err, LockError::Unavailable { message, .. }
            if message.contains("only 0 of 1 replicas acknowledged")),
        "{err:?}"
    );
    // The lock the acquire took was released; the token counter stays.
    assert_eq!(
        harness::require(master.command(&["EXISTS", lock_key.as_str()]).await),
        RespValue::Integer(0)
    );
    assert!(
        harness::require(master.command(&["GET", fence_key.as_str()]).await)
            .as_text()
            .is_some_and(|t| t.parse::<u64>().unwrap() > lease.token().get())
    );

    // With the replica back, the key can be taken again.
    let again = redis
        .acquire(&key, TTL)
        .await
        .expect("the replica is back")
        .expect("the failed acquire left the key free");
    assert!(again.token() > lease.token());
}

#[tokio::test]
async fn a_wait_as_long_as_the_response_timeout_is_a_config_error() {
    let err = RedisBackend::builder()
        .url("redis://127.0.0.1:1/")
        .response_timeout(Duration::from_millis(500))
        .replica_acks(1, Duration::from_millis(500))
        .build()
        .await
        .expect_err("WAIT would outlive the response timeout");
    assert!(matches!(err, LockError::Config(_)), "{err:?}");
}
