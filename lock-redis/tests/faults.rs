//! Fault cases on real servers, one test each: a paused server, a partitioned link while
//! the watchdog runs, `SCRIPT FLUSH`, a restart that loses every key, a dead cluster master,
//! a batch whose call stops part way.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{RedisClusterFactory, RedisFactory};
use distlock_core::{
    Admission, EnforcementMode, Fence, FencedResource, LockBackend, LockError, LockKey, Locker,
    Release, Renewal,
};
use lock_redis::{RedisBackend, RedisFencedResource};
use tokio::time::{Instant, sleep, timeout_at};

const SLACK: Duration = Duration::from_millis(300);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

fn locker(redis: RedisBackend, ttl: Duration) -> Locker {
    Locker::builder(Arc::new(redis))
        .ttl(ttl)
        .wait_timeout(Some(Duration::from_secs(10)))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_paused_past_the_ttl_loses_the_guard_and_fences_out_the_old_holder() {
    let f = RedisFactory::start().await;
    let ttl = Duration::from_millis(900);
    let old = locker(f.redis().await, ttl);
    let guard = old
        .try_lock(&key("paused"))
        .await
        .unwrap()
        .expect("free key");
    let old_token = guard.token();

    harness::require(f.server.pause());
    let deadline = guard.valid_until();
    let lost = timeout_at(deadline + SLACK, guard.lost()).await;
    assert!(
        lost.is_ok(),
        "the guard still claimed the lease after its valid_until"
    );
    assert!(!guard.is_held());
    // Keep the server frozen past the TTL, so the key has expired when it wakes up.
    sleep(ttl).await;
    harness::require(f.server.resume());

    let new = f.redis().await;
    let lease = new
        .acquire(&key("paused"), ttl)
        .await
        .unwrap()
        .expect("the expired key is free again");
    assert!(
        lease.token() > old_token,
        "{} <= {old_token}",
        lease.token()
    );

    let resource = RedisFencedResource::new(new.clone(), EnforcementMode::Enforce);
    assert_eq!(
        resource.check_only("ledger", lease.token()).await.unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        resource.check_only("ledger", old_token).await.unwrap(),
        Admission::Stale {
            latest: lease.token()
        }
    );
    assert!(matches!(
        guard.release().await,
        Ok(Release::NotHeld) | Err(LockError::Lost)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_link_loses_the_guard_and_the_locker_recovers_after_heal() {
    let f = RedisFactory::start().await;
    let ttl = Duration::from_millis(900);
    let locker = locker(f.redis().await, ttl);
    let guard = locker.try_lock(&key("partition")).await.unwrap().unwrap();
    // Let the watchdog renew a few times first.
    sleep(ttl).await;
    assert!(guard.is_held());

    f.proxy.blackhole();
    let deadline = guard.valid_until();
    assert!(
        timeout_at(deadline + SLACK, guard.lost()).await.is_ok(),
        "the watchdog did not report the lease lost by its valid_until"
    );
    assert!(!guard.is_held());
    drop(guard);
    f.proxy.heal();

    // Renewals held back by the partition may reach the server after the heal and keep
    // the old key for one more TTL; `lock` waits that out.
    let again = locker
        .lock(&key("partition"))
        .await
        .expect("recovered after heal");
    assert!(again.is_held());
    let other = locker.try_lock(&key("partition-2")).await.unwrap();
    assert!(other.is_some());
    again.release().await.unwrap();
}

/// A batch of 300 keys goes out as three calls (128, 128, 44 keys); key 200, in the
/// second, holds a hash, so that call's script stops there with an error, after it set
/// keys 128 to 199. The batch fails and holds nothing: the first and third calls' keys are
/// released, and the second's, which no lease ever named, are given back by owner id,
/// long before their TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_call_stops_part_way_holds_none_of_its_keys() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys: Vec<LockKey> = (0..300).map(|i| key(&format!("part-way-{i}"))).collect();
    harness::require(
        f.server
            .command(&["HSET", "distlock:{part-way-200}", "field", "value"])
            .await,
    );
    let ttl = Duration::from_secs(60);
    let failed = redis.acquire_many(&keys, ttl).await;
    assert!(
        matches!(failed, Err(LockError::Backend { .. })),
        "a key of another type stops the batch: {failed:?}"
    );
    let mut others = keys.clone();
    others.remove(200);
    until_none_held(&f, &others, "the failed batch").await;
    // The keys are free for the next batch.
    let taken = redis.acquire_many(&others, ttl).await.unwrap();
    assert!(taken.iter().all(Option::is_some));
    let taken: Vec<_> = taken.into_iter().flatten().collect();
    redis.release_many(&taken).await.unwrap();
}

/// `acquire_many` of 300 keys (three calls) whose future is dropped while its calls are
/// on their way: the server, paused for writes when the first poll sent them, runs them
/// once it is let go, and the keys they took are given back by owner id long before their
/// TTL, whether each call's reply had come back (and waited, unread) or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_dropped_on_its_way_holds_none_of_its_keys() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys: Vec<LockKey> = (0..300).map(|i| key(&format!("dropped-{i}"))).collect();
    let ttl = Duration::from_secs(60);
    harness::require(
        f.server
            .command(&["CLIENT", "PAUSE", "10000", "WRITE"])
            .await,
    );
    let mut batch = Box::pin(redis.acquire_many(&keys, ttl));
    let first_poll = futures::poll!(&mut batch);
    harness::require(f.server.command(&["CLIENT", "UNPAUSE"]).await);
    assert!(
        first_poll.is_pending(),
        "the server runs no script while paused: {first_poll:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !held(&f, &keys[0]).await {
        assert!(Instant::now() < deadline, "the first call never ran");
        sleep(Duration::from_millis(10)).await;
    }
    drop(batch);
    until_none_held(&f, &keys, "the batch was dropped").await;
}

/// Whether `key`'s lock key holds a value on `f`'s server.
async fn held(f: &RedisFactory, key: &LockKey) -> bool {
    let name = format!("distlock:{{{}}}", key.as_str());
    harness::require(f.server.command(&["GET", &name]).await)
        .as_text()
        .is_some()
}

/// Waits until none of `keys` is held, at most 5 s after `after` (far less than the tests'
/// 60 s TTL): what a batch took is given back by owner id, not left to its TTL.
async fn until_none_held(f: &RedisFactory, keys: &[LockKey], after: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut still = Vec::new();
        for k in keys {
            if held(f, k).await {
                still.push(k.as_str());
            }
        }
        if still.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "5 s after {after} (TTL 60 s), keys still held: {still:?}"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_succeed_after_script_flush() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let ttl = Duration::from_secs(10);
    let flush = || async { harness::require(f.server.command(&["SCRIPT", "FLUSH"]).await) };

    flush().await;
    let lease = redis.acquire(&key("flush"), ttl).await.unwrap().unwrap();
    flush().await;
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    flush().await;
    assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
    flush().await;
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    let keys: Vec<LockKey> = (0..20).map(|i| key(&format!("flush-{i}"))).collect();
    flush().await;
    let leases = common::acquire_all(&redis, &keys, ttl).await;
    flush().await;
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    flush().await;
    let released = redis.release_many(&leases).await.unwrap();
    assert!(released.iter().all(|r| *r == Release::Released));
    assert!(common::command_calls(&f.server, "script|load").await >= 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_restart_that_lost_every_key() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let ttl = Duration::from_secs(10);
    let k = key("restart");
    let mut before = Vec::new();
    for _ in 0..3 {
        let lease = redis.acquire(&k, ttl).await.unwrap().unwrap();
        before.push(lease.token());
        redis.release(&lease).await.unwrap();
    }
    let highest_before = *before.iter().max().unwrap();

    harness::require(f.server.restart().await);

    // The client reconnects on its own; the first calls may still see the old connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        match redis.acquire(&k, ttl).await {
            Ok(Some(lease)) => break lease.token(),
            Ok(None) => panic!("nobody else holds the key"),
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no reconnect after restart: {e}"),
        }
    };
    assert!(after > highest_before, "{after} <= {highest_before}");
}

/// The connection a restart broke is found broken by the next acquire, which sends its
/// attempt again on the new connection (the script hands a resent attempt its own token)
/// instead of failing with an unknown outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_acquire_after_a_restart_takes_the_key() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let ttl = Duration::from_secs(10);
    let warm = redis.acquire(&key("warm"), ttl).await.unwrap().unwrap();
    redis.release(&warm).await.unwrap();

    harness::require(f.server.restart().await);
    let k = key("first-after-restart");
    let lease = redis
        .acquire(&k, ttl)
        .await
        .expect("the acquire is sent again on the new connection")
        .expect("nobody holds the key");
    assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_master_fails_its_keys_cleanly_and_the_others_keep_working() {
    let f = RedisClusterFactory::start().await;
    // Let the surviving masters keep serving their slots when one master is gone.
    for node in f.cluster.nodes() {
        harness::require(
            node.command(&["CONFIG", "SET", "cluster-require-full-coverage", "no"])
                .await,
        );
    }
    let redis = f.redis().await;
    let ttl = Duration::from_secs(20);
    let victim = f.cluster.nodes()[0].port();
    let mut on_victim = Vec::new();
    let mut elsewhere = Vec::new();
    for i in 0..40 {
        let k = key(&format!("kill-{i}"));
        let lock_key = redis.redis_key(&k);
        let node = harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await);
        if node.port() == victim {
            on_victim.push(k)
        } else {
            elsewhere.push(k)
        }
    }
    assert!(!on_victim.is_empty() && !elsewhere.is_empty());
    let fresh_key = elsewhere.pop().unwrap();
    let victim_leases = common::acquire_all(&redis, &on_victim, ttl).await;
    let other_leases = common::acquire_all(&redis, &elsewhere, ttl).await;

    harness::require(f.cluster.nodes()[0].kill());

    for lease in &victim_leases[..2] {
        let err = redis.renew(lease).await.expect_err("its master is dead");
        assert!(err.is_retryable(), "{err}");
    }
    for lease in &other_leases {
        assert!(matches!(
            redis.renew(lease).await.unwrap(),
            Renewal::Renewed { .. }
        ));
    }
    let fresh = redis
        .acquire(&fresh_key, ttl)
        .await
        .unwrap()
        .expect("a new key on a surviving master can be taken");
    assert_eq!(redis.release(&fresh).await.unwrap(), Release::Released);

    // Batches answer per lease: the healthy masters' leases are renewed, the dead
    // master's are unreachable (not lost: nothing is known about them).
    let mut all = victim_leases.clone();
    all.extend(other_leases.iter().cloned());
    let renewed = redis.renew_many(&all).await.unwrap();
    for (lease, r) in all.iter().zip(&renewed) {
        if elsewhere.contains(lease.key()) {
            assert!(
                matches!(r, Renewal::Renewed { .. }),
                "{:?}: {r:?}",
                lease.key()
            );
        } else {
            assert_eq!(*r, Renewal::Unreachable, "{:?}", lease.key());
        }
    }

    // A batch acquire gives `None` for the keys it could not ask and takes the others.
    let mut fresh_keys: Vec<LockKey> = on_victim
        .iter()
        .map(|k| key(&format!("{k}-again")))
        .collect();
    fresh_keys.push(fresh_key.clone());
    let taken = redis.acquire_many(&fresh_keys, ttl).await.unwrap();
    assert_eq!(taken.len(), fresh_keys.len());
    for (k, lease) in fresh_keys.iter().zip(&taken) {
        let lock_key = redis.redis_key(k);
        let on_dead =
            harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await).port() == victim;
        assert_eq!(lease.is_none(), on_dead, "{k:?}");
    }
    let taken: Vec<_> = taken.into_iter().flatten().collect();
    assert!(!taken.is_empty());

    let mut to_release = all.clone();
    to_release.extend(taken.iter().cloned());
    let released = redis.release_many(&to_release).await.unwrap();
    for (lease, r) in to_release.iter().zip(&released) {
        let lock_key = redis.redis_key(lease.key());
        let on_dead =
            harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await).port() == victim;
        let expected = if on_dead {
            Release::Unreachable
        } else {
            Release::Released
        };
        assert_eq!(*r, expected, "{:?}", lease.key());
    }

    // A batch with only the dead master's leases has nobody to answer: it fails as the
    // single form does.
    let err = redis
        .renew_many(&victim_leases)
        .await
        .expect_err("no node answered");
    assert!(err.is_retryable(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_cluster_master_makes_only_its_leases_unreachable_in_batches() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let ttl = Duration::from_secs(20);
    let victim = f.cluster.nodes()[1].port();
    let keys: Vec<LockKey> = (0..30).map(|i| key(&format!("silent-{i}"))).collect();
    let leases = common::acquire_all(&redis, &keys, ttl).await;
    let mut on_victim = Vec::new();
    for lease in &leases {
        let lock_key = redis.redis_key(lease.key());
        let node = harness::require(f.cluster.node_for_key(lock_key.as_bytes()).await);
        on_victim.push(node.port() == victim);
    }
    assert!(on_victim.iter().any(|v| *v) && on_victim.iter().any(|v| !*v));

    // Frozen, not dead: its connections stay open and nothing is answered.
    harness::require(f.cluster.nodes()[1].pause());
    let renewed = redis.renew_many(&leases).await;
    harness::require(f.cluster.nodes()[1].resume());
    let renewed = renewed.expect("the other masters answered");
    for ((lease, r), silent) in leases.iter().zip(&renewed).zip(&on_victim) {
        if *silent {
            assert_eq!(*r, Renewal::Unreachable, "{:?}", lease.key());
        } else {
            assert!(
                matches!(r, Renewal::Renewed { .. }),
                "{:?}: {r:?}",
                lease.key()
            );
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_cleanup_after_an_acquire_to_a_hung_server_ends_long_before_the_ttl() {
    let server = harness::require(harness::redis::RedisServer::start().await);
    let redis = RedisBackend::builder()
        .url(server.url())
        .request_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let metrics = tokio::runtime::Handle::current().metrics();
    harness::require(server.pause());
    let tasks_before = metrics.num_alive_tasks();

    let outcome = redis.acquire(&key("hung"), Duration::from_secs(60)).await;
    assert!(
        matches!(outcome, Err(LockError::OutcomeUnknown { .. })),
        "{outcome:?}"
    );
    assert!(
        metrics.num_alive_tasks() > tasks_before,
        "no cleanup was started"
    );
    // It gives up after two response timeouts; the 60 s lease's TTL is far off.
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.num_alive_tasks() > tasks_before {
        assert!(
            Instant::now() < deadline,
            "the cleanup of a 60 s lease is still running against the hung server"
        );
        sleep(Duration::from_millis(50)).await;
    }

    // The acquire and its cleanup were sent: the server runs both, in order, once it wakes.
    harness::require(server.resume());
    let lock_key = redis.redis_key(&key("hung"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while harness::require(server.command(&["EXISTS", &lock_key]).await)
        != harness::redis::RespValue::Integer(0)
    {
        assert!(Instant::now() < deadline, "{lock_key} is still held");
        sleep(Duration::from_millis(50)).await;
    }
}
