//! A server that refuses a request for now (a replica, memory full) makes the call fail
//! with the retryable `Unavailable`, changes nothing, and works again once it recovers.

mod common;

use std::time::Duration;

use distlock_core::{LockBackend, LockError, LockKey};
use harness::{redis::RedisServer, redis::RespValue};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);

async fn connect(url: String) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .request_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("connect")
}

fn assert_unavailable<T: std::fmt::Debug>(outcome: Result<T, LockError>) {
    match outcome {
        Err(e @ LockError::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_sent_to_a_replica_is_unavailable() {
    let (master, replica) = common::master_and_replica().await;
    let redis = connect(replica.url()).await;
    let key = LockKey::new("behind-a-failover-address").unwrap();

    assert_unavailable(redis.acquire(&key, TTL).await);
    assert_unavailable(redis.acquire_many(std::slice::from_ref(&key), TTL).await);
    let lock_key = redis.redis_key(&key);
    assert_eq!(
        harness::require(master.command(&["EXISTS", lock_key.as_str()]).await),
        RespValue::Integer(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_on_a_server_out_of_memory_is_unavailable_until_memory_is_freed() {
    let server = harness::require(RedisServer::start().await);
    let redis = connect(server.url()).await;
    let key = LockKey::new("no-memory").unwrap();
    let lock_key = redis.redis_key(&key);
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        harness::require(server.command(&["CONFIG", "SET", name, value]).await);
    }

    assert_unavailable(redis.acquire(&key, TTL).await);
    assert_unavailable(redis.acquire_many(std::slice::from_ref(&key), TTL).await);
    assert_eq!(
        harness::require(server.command(&["EXISTS", lock_key.as_str()]).await),
        RespValue::Integer(0),
        "a refused acquire takes nothing"
    );

    harness::require(server.command(&["CONFIG", "SET", "maxmemory", "0"]).await);
    assert!(
        redis.acquire(&key, TTL).await.unwrap().is_some(),
        "the key is free once memory is"
    );
}
