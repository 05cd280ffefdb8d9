//! Redis Sentinel: a master, a replica and three Sentinels with quorum 2, the backend built
//! from a `redis+sentinel://` URL. It finds the master through the Sentinels, follows a
//! switchover (`SENTINEL FAILOVER`) and a failover (the master killed), and sends nothing
//! to the old master once the Sentinels have named the new one.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockError, LockKey, Release, Renewal};
use harness::redis::sentinel::MASTER_NAME;
use harness::redis::{RedisServer, SentinelDeployment};
use lock_redis::{RedisBackend, RedisBackendBuilder};
use tokio::time::Instant;

const RESPONSE_TIMEOUT: Duration = common::RESPONSE_TIMEOUT;
const TTL: Duration = Duration::from_secs(30);
const FAILOVER_BOUND: Duration = common::SENTINEL_FAILOVER_BOUND;
/// How long the backend may take to hear a Sentinel's `+switch-master` after the Sentinel
/// answers the new address.
const NOTICE: Duration = Duration::from_millis(200);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

async fn backend(deployment: &SentinelDeployment) -> RedisBackend {
    RedisBackendBuilder::from_url(&deployment.url())
        .expect("a valid Sentinel URL")
        .request_timeout(RESPONSE_TIMEOUT)
        .build()
        .await
        .expect("connect through the Sentinels")
}

/// The value of `key` on `server`, if any.
async fn held_on(server: &RedisServer, key: &str) -> Option<String> {
    harness::require(server.command(&["GET", key]).await).as_text()
}

/// A started deployment, a backend through its Sentinels, the master's address, and a
/// lease held there whose key the replica has too.
async fn held_on_the_master() -> (SentinelDeployment, RedisBackend, SocketAddr, Lease) {
    let deployment = harness::require(SentinelDeployment::start().await);
    let redis = backend(&deployment).await;
    let master = harness::require(deployment.master_addr().await);
    let held = redis
        .acquire(&key("held"), TTL)
        .await
        .unwrap()
        .expect("a free key");
    common::replicated(&deployment.nodes[0], &deployment.nodes[1]).await;
    (deployment, redis, master, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_locks_on_the_master_the_sentinels_name() {
    let deployment = harness::require(SentinelDeployment::start().await);
    let (master, replica) = (&deployment.nodes[0], &deployment.nodes[1]);
    let redis = backend(&deployment).await;
    let k = key("on-master");
    let lease = redis.acquire(&k, TTL).await.unwrap().expect("a free key");
    let value = format!("{}:{}", lease.owner(), lease.token());
    assert_eq!(held_on(master, &redis.redis_key(&k)).await, Some(value));
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(held_on(master, &redis.redis_key(&k)).await, None);
    assert_eq!(
        common::command_calls(replica, "evalsha").await,
        0,
        "nothing was sent to the replica"
    );
    let unknown = deployment.url().replace("/locks", "/nosuch");
    let built = RedisBackendBuilder::from_url(&unknown)
        .unwrap()
        .build()
        .await;
    assert!(
        matches!(&built, Err(LockError::Config(m)) if m.contains("no master named `nosuch`")),
        "{built:?}"
    );
}

/// `SENTINEL FAILOVER`: the replica is promoted and the old master, still up, keeps
/// serving writes until the Sentinels demote it seconds later. The backend moves to the
/// new master when the Sentinels announce it, and sends the old one nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_is_followed_and_the_old_master_gets_nothing_more() {
    let (deployment, redis, old_addr, held) = held_on_the_master().await;
    let redis = std::sync::Arc::new(redis);
    let old = deployment.node(old_addr).unwrap();

    // Renewals every 20 ms across the switchover, each (start, outcome) recorded.
    let renewals = tokio::spawn({
        let (redis, held) = (redis.clone(), held.clone());
        async move {
            let mut seen = Vec::new();
            let until = Instant::now() + Duration::from_secs(4);
            while Instant::now() < until {
                let at = Instant::now();
                seen.push((at, redis.renew(&held).await));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let switch = Instant::now();
    let ok = harness::require(
        deployment.sentinels[0]
            .command(&["SENTINEL", "FAILOVER", MASTER_NAME])
            .await,
    );
    assert_eq!(ok.as_text().as_deref(), Some("OK"), "{ok:?}");
    let new_addr = harness::require(
        deployment
            .wait_for_new_master(old_addr, FAILOVER_BOUND)
            .await,
    );
    let named = switch.elapsed();
    let new = deployment.node(new_addr).unwrap();
    tokio::time::sleep(NOTICE).await;
    let old_calls = common::command_calls(old, "evalsha").await;

    let started = Instant::now();
    let k = key("after");
    let lease = redis
        .acquire(&k, TTL)
        .await
        .expect("the first acquire after the switchover succeeds")
        .expect("a free key");
    let first_acquire = started.elapsed();
    assert_eq!(
        held_on(new, &redis.redis_key(&k)).await,
        Some(format!("{}:{}", lease.owner(), lease.token())),
        "the new master holds the lease"
    );
    assert!(matches!(
        redis.renew(&held).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    let seen = renewals.await.unwrap();
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(redis.release(&held).await.unwrap(), Release::Released);
    assert_eq!(
        common::command_calls(old, "evalsha").await,
        old_calls,
        "the old master got scripts after the Sentinels named the new one"
    );
    assert!(
        held_on(new, &redis.redis_key(&key("held"))).await.is_none(),
        "the release reached the new master"
    );

    // What the switchover cost the held lease.
    let failed: Vec<Duration> = seen
        .iter()
        .filter(|(_, r)| !matches!(r, Ok(Renewal::Renewed { .. })))
        .map(|(at, _)| at.duration_since(switch))
        .collect();
    let after_named: Vec<_> = seen
        .iter()
        .filter(|(at, _)| *at > switch + named + NOTICE + RESPONSE_TIMEOUT)
        .collect();
    assert!(!after_named.is_empty());
    assert!(
        after_named
            .iter()
            .all(|(_, r)| matches!(r, Ok(Renewal::Renewed { .. }))),
        "a renewal failed after the switch was announced: {after_named:?}"
    );
    println!(
        "switchover: the Sentinels named the new master {named:?} after SENTINEL FAILOVER; \
         {} of {} renewals failed (at {failed:?} after it); first acquire after the switch \
         took {first_acquire:?}",
        failed.len(),
        seen.len()
    );
}

/// The master killed: the Sentinels fail it over, and the backend, unable to reach it,
/// asks them again until they name the new master; a lease held across the failover is
/// renewed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_failed_over_and_followed() {
    let (deployment, redis, old_addr, held) = held_on_the_master().await;
    let old = deployment.node(old_addr).unwrap();

    harness::require(old.kill());
    let killed = Instant::now();
    let mut failures = 0;
    let renewed_after = loop {
        match redis.renew(&held).await {
            Ok(Renewal::Renewed { .. }) => break killed.elapsed(),
            Ok(other) => panic!("the held lease was lost: {other:?}"),
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                failures += 1;
            }
        }
        assert!(
            killed.elapsed() < FAILOVER_BOUND,
            "no renewal succeeded within {FAILOVER_BOUND:?} of the kill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let new_addr = harness::require(deployment.master_addr().await);
    assert_ne!(new_addr, old_addr);
    let new = deployment.node(new_addr).unwrap();
    let k = key("after");
    let lease = redis
        .acquire(&k, TTL)
        .await
        .expect("an acquire after the failover succeeds")
        .expect("a free key");
    assert_eq!(
        held_on(new, &redis.redis_key(&k)).await,
        Some(format!("{}:{}", lease.owner(), lease.token())),
        "the new master holds the lease"
    );
    assert_eq!(redis.release(&held).await.unwrap(), Release::Released);
    println!(
        "failover: the first renewal succeeded {renewed_after:?} after the master was killed \
         ({failures} failed before)"
    );
}

#[tokio::test]
async fn bad_sentinel_urls_are_config_errors_before_anything_is_sent() {
    for (url, says) in [
        ("redis+sentinel://127.0.0.1:1", "names no master"),
        ("redis+sentinel://127.0.0.1:1/", "names no master"),
        ("redis+sentinel://127.0.0.1:1,/locks", "host[:port]"),
        ("redis+sentinel://127.0.0.1:99999/locks", "host[:port]"),
        ("redis+sentinel://127.0.0.1:1/locks/x", "database"),
        ("redis+sentinel://127.0.0.1:1/locks/0/more", "more path"),
        ("redis+sentinel://127.0.0.1:1/locks?timeout=1", "`timeout`"),
        ("redis+sentinel://:hun/ter2@127.0.0.1:1/locks", "%2F"),
    ] {
        let Err(LockError::Config(message)) = RedisBackendBuilder::from_url(url) else {
            panic!("{url} was accepted");
        };
        assert!(message.contains(says), "{url}: {message}");
        assert!(!message.contains("ter2"), "{url}: {message}");
        // The builder, given the URL, refuses it in `build` before connecting (nothing
        // listens on port 1: a build that connected would fail with `Unavailable`).
        let built = RedisBackend::builder().url(url).build().await;
        assert!(
            matches!(&built, Err(LockError::Config(m)) if !m.contains("ter2")),
            "{url}: {built:?}"
        );
    }
    let built = RedisBackend::builder()
        .url("redis://127.0.0.1:1")
        .sentinel_auth("", "hunter2")
        .build()
        .await;
    assert!(
        matches!(&built, Err(LockError::Config(m)) if m.contains("redis+sentinel")),
        "{built:?}"
    );
}
