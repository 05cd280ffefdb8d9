//! One key per lock: `<prefix>:{<name>}` holds `<owner id>:<token>` while held, the token
//! being the server's clock in µs as an exact integer (one above the last when the clock
//! has not moved past it), and nothing of it is left once released; beside the locks, one
//! high-water key, `<prefix>:tokens`, holds the newest token granted. A free key keeps no
//! token of its own: a stale lease's fence check then names the high-water token, which
//! is at least its token.

mod common;

use std::time::Duration;

use common::RedisFactory;
use distlock_core::{Fence, LockBackend, LockKey, Release};
use harness::redis::{RedisServer, RespValue};

const TTL: Duration = Duration::from_secs(10);

/// The server clock in µs, from `TIME`.
async fn server_clock(server: &RedisServer) -> u64 {
    let reply = harness::require(server.command(&["TIME"]).await);
    let RespValue::Array(Some(parts)) = reply else {
        panic!("TIME answered {reply:?}")
    };
    let part = |i: usize| parts[i].as_text().unwrap().parse::<u64>().unwrap();
    part(0) * 1_000_000 + part(1)
}

/// How many keys the server holds: the locks held, and the high-water key once a lock
/// was granted.
async fn keys_left(server: &RedisServer) -> RespValue {
    harness::require(server.command(&["DBSIZE"]).await)
}

/// The high-water key's token.
async fn high_water(server: &RedisServer) -> Option<u64> {
    harness::require(server.command(&["GET", "distlock:tokens"]).await)
        .as_text()
        .map(|t| t.parse().expect("a token"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_holds_owner_and_token_and_nothing_is_left_after_release() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("job:7").unwrap();

    let before = server_clock(&f.server).await;
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("a free key");
    let after = server_clock(&f.server).await;
    let token = lease.token().get();
    assert!(
        (before..=after).contains(&token),
        "the token {token} is the server clock, read between {before} and {after}"
    );
    let held = harness::require(
        f.server
            .command(&["GET", redis.redis_key(&key).as_str()])
            .await,
    );
    assert_eq!(held.as_text(), Some(format!("{}:{token}", lease.owner())));
    assert_eq!(keys_left(&f.server).await, RespValue::Integer(2));
    assert_eq!(high_water(&f.server).await, Some(token));

    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(keys_left(&f.server).await, RespValue::Integer(1));

    let keys: Vec<LockKey> = (0..20)
        .map(|i| LockKey::new(format!("job:{i}:batch")).unwrap())
        .collect();
    let leases = common::acquire_all(&redis, &keys, TTL).await;
    assert_eq!(leases.len(), keys.len());
    assert!(leases.iter().all(|l| l.token() > lease.token()));
    let newest = leases.iter().map(|l| l.token().get()).max();
    assert_eq!(high_water(&f.server).await, newest);
    let released = redis.release_many(&leases).await.unwrap();
    assert!(released.iter().all(|r| *r == Release::Released));
    assert_eq!(keys_left(&f.server).await, RespValue::Integer(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lease_is_stale_with_the_high_water_token_between_its_token_and_the_next() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("job:8").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("a free key");
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    let Fence::Stale { current } = redis.fence(&lease).await.unwrap() else {
        panic!("a released lease is stale")
    };
    assert_eq!(
        current,
        lease.token(),
        "the newest token granted is its own"
    );
    assert_eq!(redis.inspect(&key).await.unwrap().token, None);

    let next = redis.acquire(&key, TTL).await.unwrap().expect("a free key");
    assert!(next.token() > current, "{} <= {current}", next.token());
    // While someone holds the key, a stale lease learns the holder's token.
    assert_eq!(
        redis.fence(&lease).await.unwrap(),
        Fence::Stale {
            current: next.token()
        }
    );
    assert_eq!(redis.inspect(&key).await.unwrap().token, Some(next.token()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_release_someone_waited_for_is_announced() {
    let f = RedisFactory::start().await;
    let (holder, waiter) = (f.redis().await, f.redis().await);
    let key = LockKey::new("job:9").unwrap();
    let lock_key = holder.redis_key(&key);
    let value =
        async || harness::require(f.server.command(&["GET", lock_key.as_str()]).await).as_text();

    // Each backend's `build` published once, to learn whether it may.
    let built = common::command_calls(&f.server, "publish").await;
    let announced = async || common::command_calls(&f.server, "publish").await - built;

    // Nobody waits: a cycle publishes nothing.
    let lease = holder
        .acquire(&key, TTL)
        .await
        .unwrap()
        .expect("a free key");
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(announced().await, 0, "an unwaited release was announced");

    // A refused acquire marks the key; the holder's lease works as before.
    let lease = holder
        .acquire(&key, TTL)
        .await
        .unwrap()
        .expect("a free key");
    let held = format!("{}:{}", lease.owner(), lease.token());
    assert!(waiter.acquire(&key, TTL).await.unwrap().is_none());
    assert_eq!(value().await, Some(format!("{held}:w")));
    assert!(waiter.acquire(&key, TTL).await.unwrap().is_none());
    assert_eq!(value().await, Some(format!("{held}:w")), "marked once");
    assert!(matches!(
        holder.renew(&lease).await.unwrap(),
        distlock_core::Renewal::Renewed { .. }
    ));
    assert_eq!(holder.fence(&lease).await.unwrap(), Fence::Current);
    let info = waiter.inspect(&key).await.unwrap();
    assert_eq!(
        (info.owner, info.token),
        (Some(lease.owner()), Some(lease.token()))
    );
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(announced().await, 1, "the waited release is announced");
    assert_eq!(value().await, None);

    // The same through the batch forms.
    let leases = common::acquire_all(&holder, std::slice::from_ref(&key), TTL).await;
    assert!(
        waiter
            .acquire_many(std::slice::from_ref(&key), TTL)
            .await
            .unwrap()[0]
            .is_none()
    );
    assert!(matches!(
        holder.renew_many(&leases).await.unwrap()[..],
        [distlock_core::Renewal::Renewed { .. }]
    ));
    assert_eq!(
        holder.release_many(&leases).await.unwrap(),
        vec![Release::Released]
    );
    assert_eq!(announced().await, 2);
    assert_eq!(
        keys_left(&f.server).await,
        RespValue::Integer(1),
        "the high-water key"
    );
}
