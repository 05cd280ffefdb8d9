//! `adopt` rebuilds a lease from an owner id and token without asking the server; the
//! scripts' owner and token checks decide what it may do. `purge` deletes a lock's two keys.

mod common;

use std::time::Duration;

use common::{RedisClusterFactory, RedisFactory};
use distlock_core::{
    Fence, FencingToken, LockBackend, LockError, LockKey, OwnerId, Release, Renewal,
};
use harness::redis::RespValue;

const TTL: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_acts_only_with_the_right_owner_and_token() {
    let f = RedisFactory::start().await;
    let holder = f.redis().await;
    let tool = f.redis().await;
    let key = LockKey::new("adopt").unwrap();
    let lease = holder.acquire(&key, TTL).await.unwrap().expect("free key");

    let wrong_owner = tool
        .adopt(&key, OwnerId::random(), lease.token(), TTL)
        .unwrap();
    let wrong_token = tool
        .adopt(
            &key,
            lease.owner(),
            FencingToken(lease.token().get() - 1),
            TTL,
        )
        .unwrap();
    assert_eq!(tool.renew(&wrong_owner).await.unwrap(), Renewal::Lost);
    assert_eq!(tool.release(&wrong_owner).await.unwrap(), Release::NotHeld);
    // The owner id is unique per acquisition, so renew and release go by it alone; fence
    // also compares the token with the key's counter.
    for wrong in [&wrong_owner, &wrong_token] {
        assert!(matches!(
            tool.fence(wrong).await.unwrap(),
            Fence::Stale { current } if current == lease.token()
        ));
    }
    // The holder's lease is untouched.
    let info = tool.inspect(&key).await.unwrap();
    assert_eq!(info.owner, Some(lease.owner()));
    assert_eq!(holder.fence(&lease).await.unwrap(), Fence::Current);

    let adopted = tool.adopt(&key, lease.owner(), lease.token(), TTL).unwrap();
    assert_eq!(adopted.token(), lease.token());
    assert_eq!(adopted.owner(), lease.owner());
    assert!(matches!(
        tool.renew(&adopted).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(tool.release(&adopted).await.unwrap(), Release::Released);
    assert_eq!(holder.release(&lease).await.unwrap(), Release::NotHeld);
    assert!(
        tool.acquire(&key, TTL).await.unwrap().is_some(),
        "free again"
    );

    // An adopted lease belongs to the instance that adopted it.
    let foreign = tool.adopt(&key, lease.owner(), lease.token(), TTL).unwrap();
    assert!(matches!(
        holder.release(&foreign).await,
        Err(LockError::ForeignLease { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_refuses_a_ttl_the_store_cannot_honour() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("adopt-ttl").unwrap();
    for ttl in [
        Duration::ZERO,
        Duration::from_micros(1500),
        Duration::from_secs(8 * 24 * 3600),
    ] {
        let err = redis
            .adopt(&key, OwnerId::random(), FencingToken(1), ttl)
            .expect_err("bad TTL");
        assert!(
            matches!(err, LockError::InvalidTtl { .. }),
            "{ttl:?}: {err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_the_lock_key_and_the_fence_counter() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("purge").unwrap();
    let other = LockKey::new("purge-other").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().unwrap();
    let kept = redis.acquire(&other, TTL).await.unwrap().unwrap();
    let lock_key = redis.redis_key(&key);
    let exists =
        || async { harness::require(f.server.command(&["EXISTS", lock_key.as_str()]).await) };
    assert_eq!(exists().await, RespValue::Integer(1));

    redis.purge(&key).await.unwrap();
    assert_eq!(exists().await, RespValue::Integer(0));
    assert_eq!(redis.release(&lease).await.unwrap(), Release::NotHeld);
    // Other keys are left alone; purging a key with nothing stored is fine.
    assert_eq!(redis.fence(&kept).await.unwrap(), Fence::Current);
    redis.purge(&key).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_works_in_a_cluster() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let keys: Vec<LockKey> = (0..6)
        .map(|i| LockKey::new(format!("purge-{i}")).unwrap())
        .collect();
    for key in &keys {
        redis.acquire(key, TTL).await.unwrap().expect("free key");
        redis.purge(key).await.unwrap();
        let lock_key = redis.redis_key(key);
        let node = harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await);
        assert_eq!(
            harness::require(node.command(&["EXISTS", lock_key.as_str()]).await),
            RespValue::Integer(0),
            "{key:?}"
        );
    }
}
