//! A switchover behind one address: the replica is promoted (`REPLICAOF NO ONE`), the old
//! master follows it (`REPLICAOF`), and the address clients know (here a proxy; a virtual
//! IP or a DNS name in production) leads new connections to the new master. Connections
//! open to the old master stay open, and it answers every write `READONLY`: the backend
//! connects again on that reply, so the first call after the switchover already reaches
//! the new master, and leases held across it keep being renewed.

mod common;

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockBackend, LockKey, Locker, Release, Renewal};
use harness::proxy::FaultProxy;
use harness::redis::{RedisServer, RespValue};
use lock_redis::RedisBackend;
use tokio::time::Instant;

/// Each call must get through within one response timeout, reconnecting included.
const RESPONSE_TIMEOUT: Duration = common::RESPONSE_TIMEOUT;
const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

async fn through(proxy: &FaultProxy) -> RedisBackend {
    RedisBackend::builder()
        .url(format!("redis://{}/", proxy.addr()))
        .request_timeout(RESPONSE_TIMEOUT)
        .build()
        .await
        .expect("connect through the proxy")
}

fn ok(reply: RespValue) {
    assert_eq!(reply, RespValue::Simple("OK".into()));
}

/// Promotes `replica` and makes `master` its replica, once the replica has every write.
async fn switch_over(master: &RedisServer, replica: &RedisServer) {
    common::replicated(master, replica).await;
    ok(harness::require(
        replica.command(&["REPLICAOF", "NO", "ONE"]).await,
    ));
    let port = replica.port().to_string();
    ok(harness::require(
        master.command(&["REPLICAOF", "127.0.0.1", &port]).await,
    ));
}

/// The value of `key` on `server`, if any.
async fn held_on(server: &RedisServer, key: &str) -> Option<String> {
    harness::require(server.command(&["GET", key]).await).as_text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_calls_after_a_switchover_reach_the_new_master() {
    let (old, new) = common::master_and_replica().await;
    let proxy = harness::require(FaultProxy::start(old.addr()).await);
    // One backend per kind of call, each with its connection still open to the old
    // master: each call below is the first its backend makes after the switchover.
    let acquirer = through(&proxy).await;
    let renewer = through(&proxy).await;
    let batcher = through(&proxy).await;
    let warm = acquirer.acquire(&key("warm"), TTL).await.unwrap().unwrap();
    acquirer.release(&warm).await.unwrap();
    let single = renewer.acquire(&key("single"), TTL).await.unwrap().unwrap();
    let keys: Vec<LockKey> = (0..4).map(|i| key(&format!("batch-{i}"))).collect();
    let batch = common::acquire_all(&batcher, &keys, TTL).await;

    switch_over(&old, &new).await;
    proxy.retarget(new.addr());
    let connections = proxy.accepted();

    let started = Instant::now();
    let lease = acquirer
        .acquire(&key("after"), TTL)
        .await
        .expect("the acquire reaches the new master")
        .expect("a free key");
    let took = started.elapsed();
    assert_eq!(
        held_on(&new, &acquirer.redis_key(&key("after"))).await,
        Some(format!("{}:{}", lease.owner(), lease.token())),
        "the new master holds the lease"
    );
    println!("first acquire after the switchover: {took:?}");

    assert!(
        matches!(renewer.renew(&single).await, Ok(Renewal::Renewed { .. })),
        "a lease held across the switchover is renewed by the first renew"
    );
    let renewed = batcher
        .renew_many(&batch)
        .await
        .expect("the batch reaches the new master");
    assert!(
        renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })),
        "{renewed:?}"
    );
    // One new connection each, all to the new master.
    assert_eq!(proxy.accepted() - connections, 3);

    assert_eq!(acquirer.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(renewer.release(&single).await.unwrap(), Release::Released);
    let released = batcher.release_many(&batch).await.unwrap();
    assert!(released.iter().all(|r| *r == Release::Released));
}

/// The address moves to the new master some time after the promotion: meanwhile the old
/// master refuses every renewal, and connections made again still reach it. A lease whose
/// TTL is longer than that pause is renewed once the address has moved, and never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_outlives_a_switchover_whose_pause_is_shorter_than_its_ttl() {
    // Renewed every second, retried every 250 ms after a failure: a pause of a second
    // leaves a renewal more than half a TTL before the lease would run out.
    const GUARD_TTL: Duration = Duration::from_secs(3);
    const PAUSE: Duration = Duration::from_secs(1);
    let (old, new) = common::master_and_replica().await;
    let proxy = harness::require(FaultProxy::start(old.addr()).await);
    let redis = through(&proxy).await;
    let k = key("guarded");
    let lock_key = redis.redis_key(&k);
    let locker = Locker::builder(Arc::new(redis))
        .ttl(GUARD_TTL)
        .build()
        .unwrap();
    let guard = locker.try_lock(&k).await.unwrap().expect("a free key");
    let value = format!("{}:{}", guard.lease().owner(), guard.token());

    switch_over(&old, &new).await;
    tokio::time::sleep(PAUSE).await;
    proxy.retarget(new.addr());
    let moved = Instant::now();

    // Two TTLs after the move: a lease not renewed on the new master would be gone.
    let lost = tokio::time::timeout(GUARD_TTL * 2, guard.lost()).await;
    assert!(lost.is_err(), "the guard was lost across the switchover");
    assert!(guard.is_held());
    assert_eq!(held_on(&new, &lock_key).await, Some(value));
    let pttl = harness::require(new.command(&["PTTL", &lock_key]).await);
    let RespValue::Integer(left) = pttl else {
        panic!("PTTL answered {pttl:?}");
    };
    let since_move = moved.elapsed();
    assert!(
        Duration::from_millis(u64::try_from(left).unwrap()) + since_move > GUARD_TTL,
        "the key on the new master was last renewed before the address moved \
         ({left} ms left, {since_move:?} after the move)"
    );
    assert_eq!(guard.release().await.unwrap(), Release::Released);
}
