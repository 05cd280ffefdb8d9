//! Tokens never go back, whatever the server's clock does or the server comes back with:
//! its wall clock stepped back (the key held across the step, or released before it),
//! frozen (a release and a re-grant within one clock tick), a restart without
//! persistence, a restart from an RDB snapshot or an AOF that is behind the last grants
//! (after `kill -9`), `FLUSHALL`, and a failover (of a replica, or within a Cluster) to a
//! replica that missed the last grants. Each case runs lock cycles (single and batch
//! calls), brings the fault, runs more, and checks that every later token is above every
//! earlier one.

mod common;

use std::path::Path;
use std::time::Duration;

use common::RedisClusterFactory;
use distlock_core::{Fence, FencingToken};
use distlock_core::{LockBackend, LockKey, Release};
use harness::ShiftedClock;
use harness::redis::{RedisServer, RespValue};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const CYCLES: usize = 4;

async fn backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .build()
        .await
        .expect("connect to the test server")
}

fn key() -> LockKey {
    LockKey::new("report:nightly").unwrap()
}

/// `n` acquire + release cycles on `key`, every other one through the batch calls;
/// returns the tokens in the order they were granted.
async fn cycles(redis: &RedisBackend, key: &LockKey, n: usize) -> Vec<u64> {
    let mut tokens = Vec::with_capacity(n);
    for i in 0..n {
        if i % 2 == 0 {
            let lease = redis.acquire(key, TTL).await.unwrap().expect("a free key");
            tokens.push(lease.token().get());
            assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
        } else {
            let leases = redis
                .acquire_many(std::slice::from_ref(key), TTL)
                .await
                .unwrap();
            let lease = leases.into_iter().flatten().next().expect("a free key");
            tokens.push(lease.token().get());
            assert_eq!(
                redis.release_many(&[lease]).await.unwrap(),
                [Release::Released]
            );
        }
    }
    tokens
}

/// Every token of `after` is above every token of `before`, and `after` increases.
fn assert_above(before: &[u64], after: &[u64], what: &str) {
    let highest = before.iter().max().expect("tokens before");
    assert!(
        after.iter().all(|t| t > highest) && after.windows(2).all(|w| w[0] < w[1]),
        "{what}: tokens {after:?} after, {before:?} before"
    );
}

async fn command(server: &RedisServer, args: &[&str]) -> RespValue {
    let reply = command_raw(server, args).await;
    assert!(!matches!(reply, RespValue::Error(_)), "{args:?}: {reply:?}");
    reply
}

/// `args`' reply, an error reply included.
async fn command_raw(server: &RedisServer, args: &[&str]) -> RespValue {
    harness::require(server.command(args).await)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_restart_without_persistence() {
    let server = harness::require(RedisServer::start().await);
    let before = cycles(&backend(&server).await, &key(), CYCLES).await;

    harness::require(server.kill());
    harness::require(server.restart().await);

    let after = cycles(&backend(&server).await, &key(), CYCLES).await;
    assert_above(&before, &after, "after a restart with nothing kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_restart_from_an_rdb_snapshot_behind_the_last_grants() {
    let server = harness::require(RedisServer::start().await);
    let redis = backend(&server).await;
    let mut before = cycles(&redis, &key(), CYCLES).await;
    command(&server, &["SAVE"]).await;
    before.extend(cycles(&redis, &key(), CYCLES).await);

    // No shutdown save: the server comes back with the snapshot, behind the last grants.
    harness::require(server.kill());
    assert!(
        server.dir().join("dump.rdb").exists(),
        "the snapshot was written"
    );
    harness::require(server.restart().await);

    let after = cycles(&backend(&server).await, &key(), CYCLES).await;
    assert_above(&before, &after, "after a restart from an older snapshot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_restart_from_an_aof_behind_the_last_grants() {
    let server = harness::require(
        RedisServer::builder()
            .appendonly(true)
            .args(["--appendfsync", "everysec"])
            .start()
            .await,
    );
    let redis = backend(&server).await;
    let mut before = cycles(&redis, &key(), CYCLES).await;
    // What a machine that lost power would find: the AOF as of its last `everysec` fsync,
    // which the later grants did not reach.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let aof = server.dir().join("appendonlydir");
    let synced = server.dir().join("aof-as-synced");
    copy_dir(&aof, &synced);
    before.extend(cycles(&redis, &key(), CYCLES).await);

    harness::require(server.kill());
    std::fs::remove_dir_all(&aof).unwrap();
    copy_dir(&synced, &aof);
    harness::require(server.restart().await);

    let after = cycles(&backend(&server).await, &key(), CYCLES).await;
    assert_above(
        &before,
        &after,
        "after a restart from an AOF behind the grants",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_flushall() {
    let server = harness::require(RedisServer::start().await);
    let redis = backend(&server).await;
    let before = cycles(&redis, &key(), CYCLES).await;

    command(&server, &["FLUSHALL"]).await;

    let after = cycles(&redis, &key(), CYCLES).await;
    assert_above(&before, &after, "after FLUSHALL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_failover_to_a_replica_that_missed_the_last_grants() {
    let (master, replica) = common::master_and_replica().await;
    let redis = backend(&master).await;
    let mut before = cycles(&redis, &key(), CYCLES).await;
    // The replica has the first grants.
    common::replicated(&master, &replica).await;
    // The replica stops following (as a partitioned one would) and is promoted; the
    // master grants on without it.
    command(&replica, &["REPLICAOF", "NO", "ONE"]).await;
    before.extend(cycles(&redis, &key(), CYCLES).await);

    let promoted = backend(&replica).await;
    let after = cycles(&promoted, &key(), CYCLES).await;
    assert_above(
        &before,
        &after,
        "after a failover to a replica behind the grants",
    );
}

/// The `ROLE` of `server` (`master`, `slave`), or `None` while it does not answer.
async fn role(server: &RedisServer) -> Option<String> {
    match server.command(&["ROLE"]).await.ok()? {
        RespValue::Array(Some(items)) => items.into_iter().next().and_then(|i| i.as_text()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_cluster_failover_to_a_replica_that_missed_the_last_grants()
{
    // Clients reach the masters through a proxy each, and so does the replica started
    // below: it follows its master at the address the master announces, the proxy's.
    let f = RedisClusterFactory::behind_proxies().await;
    let proxies = f.proxies.clone().expect("behind proxies");
    let redis = f.redis().await;
    // The key's master: the node that answers for it rather than redirecting (the slot
    // map names the proxies' ports).
    let redis_key = redis.redis_key(&key());
    let mut owner = None;
    for (i, n) in f.cluster.nodes().iter().enumerate() {
        if !matches!(
            command_raw(n, &["GET", &redis_key]).await,
            RespValue::Error(_)
        ) {
            owner = Some(i);
        }
    }
    let index = owner.expect("a node serves the key");
    let master = &f.cluster.nodes()[index];
    let replica = harness::require(f.cluster.start_replica(master).await);
    let info = harness::require(replica.command(&["INFO", "replication"]).await)
        .as_text()
        .unwrap_or_default();
    assert!(
        info.contains(&format!("master_port:{}", proxies[index].port())),
        "the replica follows its master through the proxy: {info}"
    );

    let mut before = cycles(&redis, &key(), CYCLES).await;
    // The replica has the first grants.
    common::replicated(master, &replica).await;
    // The replica's link goes silent (a partition); the master grants on, to a client
    // that reaches it directly, and dies without the replica having heard of them.
    proxies[index].blackhole();
    let direct = backend(master).await;
    before.extend(cycles(&direct, &key(), CYCLES).await);
    let granted_up_to = common::info_field(master, "replication", "master_repl_offset").await;
    harness::require(master.kill());
    // The link is reset, not healed: what the proxy had not yet read from the master
    // would otherwise still reach the replica.
    proxies[index].reset();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let replicated_up_to = common::info_field(&replica, "replication", "master_repl_offset").await;
    assert!(
        replicated_up_to < granted_up_to,
        "the replica missed the last grants: it is at offset {replicated_up_to}, the \
         master was at {granted_up_to}"
    );
    proxies[index].heal();

    // The replica takes the master's slots without its agreement, as an operator forcing
    // a failover would.
    command(&replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while role(&replica).await.as_deref() != Some("master") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica was not promoted within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The clients learn the new owner of the slot on their own; until then an acquire
    // fails or is refused.
    let promoted = f.redis().await;
    let mut after = Vec::new();
    while after.len() < CYCLES {
        match promoted.acquire(&key(), TTL).await {
            Ok(Some(lease)) => {
                after.push(lease.token().get());
                assert_eq!(promoted.release(&lease).await.unwrap(), Release::Released);
            }
            outcome => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no grant from the promoted replica within 30 s: {outcome:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_above(
        &before,
        &after,
        "after a cluster failover to a replica behind the grants",
    );
}

/// A server (no persistence, as the harness starts it) under a wall clock the test steps.
async fn server_under_a_clock() -> (RedisServer, ShiftedClock) {
    let clock = harness::require(ShiftedClock::new());
    let server = harness::require(RedisServer::builder().clock(&clock).start().await);
    (server, clock)
}

/// How far the clock steps back: a minute, as NTP stepping a drifted VM's clock might.
const STEP: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_when_the_server_clock_steps_back_under_a_held_key() {
    let (server, clock) = server_under_a_clock().await;
    let redis = backend(&server).await;
    let before = cycles(&redis, &key(), CYCLES).await;
    let held = redis
        .acquire(&key(), TTL)
        .await
        .unwrap()
        .expect("a free key");

    harness::require(clock.step_back(STEP));

    assert_eq!(redis.release(&held).await.unwrap(), Release::Released);
    let after = cycles(&redis, &key(), CYCLES).await;
    let mut granted = before;
    granted.push(held.token().get());
    assert_above(
        &granted,
        &after,
        "after the clock stepped back under a held key",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_when_the_server_clock_steps_back_under_a_free_key() {
    let (server, clock) = server_under_a_clock().await;
    let redis = backend(&server).await;
    let before = cycles(&redis, &key(), CYCLES).await;

    harness::require(clock.step_back(STEP));

    let after = cycles(&redis, &key(), CYCLES).await;
    assert_above(
        &before,
        &after,
        "after the clock stepped back under a free key",
    );
    // A step of hours, and a name never granted before beside the first.
    harness::require(clock.step_back(Duration::from_secs(6 * 3600)));
    let later = cycles(&redis, &key(), CYCLES).await;
    assert_above(&after, &later, "after a step back of six hours");
    let other = LockKey::new("report:weekly").unwrap();
    let first = cycles(&redis, &other, 1).await;
    assert_above(
        &later,
        &first,
        "a new name after the steps (one high-water key)",
    );
}

/// A stopped clock is the limit of every re-grant within one tick: each grant is above
/// the last, and a release does not wait for the clock (no `TIME` call on the server's
/// one thread).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_and_a_regrant_within_one_clock_tick_get_higher_tokens_and_no_wait() {
    let (server, clock) = server_under_a_clock().await;
    let redis = backend(&server).await;
    cycles(&redis, &key(), 1).await;

    harness::require(clock.freeze());
    let lease = redis
        .acquire(&key(), TTL)
        .await
        .unwrap()
        .expect("a free key");
    let time_calls = common::command_calls(&server, "time").await;
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert_eq!(
        common::command_calls(&server, "time").await,
        time_calls,
        "a release read the server clock"
    );
    let after = cycles(&redis, &key(), CYCLES).await;
    harness::require(clock.thaw());
    assert_above(
        &[lease.token().get()],
        &after,
        "with the clock standing still",
    );
}

/// `fence` on a free key reports at least the newest token granted for it, never a clock
/// reading that a step back put below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_on_a_free_key_reports_at_least_its_newest_token_after_a_step_back() {
    let (server, clock) = server_under_a_clock().await;
    let redis = backend(&server).await;
    let lease = redis
        .acquire(&key(), TTL)
        .await
        .unwrap()
        .expect("a free key");
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    harness::require(clock.step_back(STEP));

    let fence = redis.fence(&lease).await.unwrap();
    assert!(
        matches!(fence, Fence::Stale { current } if current >= lease.token()),
        "{fence:?} for a released lease with token {}",
        lease.token()
    );
    // With the high-water key gone too (FLUSHALL), what is left is the clock: the floor
    // of the next token, which the next grant does not go below.
    command(&server, &["FLUSHALL"]).await;
    let Fence::Stale { current: floor } = redis.fence(&lease).await.unwrap() else {
        panic!("a released lease reported current");
    };
    let next = redis
        .acquire(&key(), TTL)
        .await
        .unwrap()
        .expect("a free key");
    assert!(
        next.token() >= floor,
        "{:?} below the floor {floor:?}",
        next.token()
    );
    assert!(floor > FencingToken(0));
}
