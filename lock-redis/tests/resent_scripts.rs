//! The cluster client may send a script again after a connection drop that happened after
//! the script ran. An acquire sent twice with the same owner id must then return the
//! lease it took, not "held by someone else" while its own attempt holds the key.

mod common;

use std::time::Duration;

use common::RedisFactory;
use conformance::harness::{self, redis::RespValue};
use lock_api::{LockBackend, LockKey};

const ACQUIRE: &str = include_str!("../src/scripts/acquire.lua");
const ACQUIRE_MANY: &str = include_str!("../src/scripts/acquire_many.lua");
const TTL: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_sent_again_with_its_owner_id_returns_the_same_token() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("resent").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("free key");
    let (lock_key, fence_key) = redis.redis_keys(&key);
    let owner = lease.owner().to_string();
    let token = RespValue::Bulk(Some(lease.token().get().to_string().into_bytes()));

    let again = harness::require(
        f.server
            .command(&["EVAL", ACQUIRE, "2", &lock_key, &fence_key, &owner, "10000"])
            .await,
    );
    assert_eq!(again, token, "the single-key script");
    let again = harness::require(
        f.server
            .command(&[
                "EVAL",
                ACQUIRE_MANY,
                "2",
                &lock_key,
                &fence_key,
                &owner,
                "10000",
            ])
            .await,
    );
    assert_eq!(
        again,
        RespValue::Array(Some(vec![token])),
        "the batch script"
    );

    // Someone else's attempt is still refused, and the token did not move.
    let other = harness::require(
        f.server
            .command(&[
                "EVAL",
                ACQUIRE,
                "2",
                &lock_key,
                &fence_key,
                "someone-else",
                "10000",
            ])
            .await,
    );
    assert_eq!(other, RespValue::Bulk(None));
    assert_eq!(
        redis.inspect(&key).await.unwrap().token,
        Some(lease.token())
    );
}
