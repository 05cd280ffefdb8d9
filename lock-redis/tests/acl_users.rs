//! The backend as an ACL user limited to its key prefix and the commands it needs (the
//! line README gives), with and without rights on the release channels. Without them
//! (Redis 7's default for a new user) every call still works and nothing stays held: the
//! scripts' announcement is best effort, and the backend turns wake-ups off at `build`.

mod common;

use std::time::Duration;

use distlock_core::{Fence, LockBackend, LockKey, Release, Renewal};
use harness::redis::{RedisServer, RespValue};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const PASSWORD: &str = "acl-test-pw";
/// The channel rule of README's line, which a user without channel rights lacks.
const CHANNEL_RULE: &str = "&distlock:*";

/// Makes `user` on `server` with the rules of README's `ACL SETUSER` line (key prefix
/// `distlock`, the default), less its channel rule unless `channels`, plus `extra`.
async fn set_user(server: &RedisServer, user: &str, channels: bool, extra: &[&str]) {
    let mut readme = common::readme_user(PASSWORD);
    if !channels {
        readme = harness::require(readme.without_rule(CHANNEL_RULE));
    }
    let password = format!(">{PASSWORD}");
    let mut setuser = vec!["ACL", "SETUSER", user, "reset", password.as_str()];
    setuser.extend(readme.rules().iter().map(String::as_str));
    setuser.extend(extra);
    let reply = harness::require(server.command(&setuser).await);
    assert_eq!(reply, RespValue::Simple("OK".into()), "{setuser:?}");
}

/// Makes `user` as [`set_user`] says; returns a backend logged in as that user.
async fn backend_as(server: &RedisServer, user: &str, channels: bool) -> RedisBackend {
    set_user(server, user, channels, &[]).await;
    RedisBackend::builder()
        .url(format!(
            "redis://{user}:{PASSWORD}@127.0.0.1:{}/",
            server.port()
        ))
        .build()
        .await
        .expect("the limited user connects")
}

/// Every call of the backend on a few keys: single and batch, held and free.
async fn every_call_works(redis: &RedisBackend) {
    let key = LockKey::new("payout:1").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("a free key");
    assert!(redis.acquire(&key, TTL).await.unwrap().is_none());
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
    let info = redis.inspect(&key).await.unwrap();
    assert_eq!(
        (info.owner, info.token),
        (Some(lease.owner()), Some(lease.token()))
    );
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    assert!(matches!(
        redis.fence(&lease).await.unwrap(),
        Fence::Stale { .. }
    ));

    let keys: Vec<LockKey> = (0..10)
        .map(|i| LockKey::new(format!("payout:batch:{i}")).unwrap())
        .collect();
    let leases = common::acquire_all(redis, &keys, TTL).await;
    assert_eq!(leases.len(), keys.len());
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    assert_eq!(
        redis.release_many(&leases).await.unwrap(),
        vec![Release::Released; keys.len()]
    );

    // Single releases made at once go together as one batch call.
    let leases = common::acquire_all(redis, &keys, TTL).await;
    let released = futures::future::join_all(leases.iter().map(|l| redis.release(l))).await;
    assert!(
        released.iter().all(|r| matches!(r, Ok(Release::Released))),
        "{released:?}"
    );
    redis.purge(&key).await.unwrap();
}

async fn assert_nothing_held(server: &RedisServer) {
    // Lock keys only: the high-water key of the tokens stays.
    assert_eq!(
        harness::require(server.command(&["KEYS", "distlock:{*"]).await),
        RespValue::Array(Some(Vec::new())),
        "a lock was left held"
    );
}

/// `ACL LOG` as `(reason, object)` pairs: empty when the user had every right it used.
async fn refusals(server: &RedisServer) -> Vec<(String, String)> {
    harness::require(server.acl_refusals().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_limited_to_the_prefix_and_the_listed_commands_does_everything() {
    let server = harness::require(RedisServer::start().await);
    let redis = backend_as(&server, "locker", true).await;
    assert!(redis.capabilities().wakes_waiters);
    every_call_works(&redis).await;

    // The release listener subscribes with the user's rights and hears a release.
    let key = LockKey::new("payout:watched").unwrap();
    let lease = redis.acquire(&key, TTL).await.unwrap().expect("a free key");
    let mut watch = redis.watch_releases(&key).expect("wake-ups are on");
    let channel = redis.redis_key(&key);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while harness::require(server.command(&["PUBSUB", "NUMSUB", &channel]).await)
        != RespValue::Array(Some(vec![
            RespValue::Bulk(Some(channel.clone().into_bytes())),
            RespValue::Integer(1),
        ]))
    {
        assert!(tokio::time::Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The listener wakes a new watcher once when it subscribes (a release may have come
    // just before): that wake is not the one looked for.
    let _ = tokio::time::timeout(Duration::from_millis(200), watch.released()).await;
    // A waiter tries first, which marks the key waited for (with `APPEND`).
    assert!(redis.acquire(&key, TTL).await.unwrap().is_none());
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    tokio::time::timeout(Duration::from_secs(5), watch.released())
        .await
        .expect("the waiter was woken by the release");

    assert_nothing_held(&server).await;
    assert_eq!(refusals(&server).await, [], "nothing was refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_channel_rights_releases_everything_and_runs_without_wake_ups() {
    let server = harness::require(RedisServer::start().await);
    let redis = backend_as(&server, "no-channels", false).await;
    assert!(!redis.capabilities().wakes_waiters);
    assert!(
        redis
            .watch_releases(&LockKey::new("payout:watched").unwrap())
            .is_none(),
        "no listener is started"
    );

    every_call_works(&redis).await;

    assert_nothing_held(&server).await;
    // The refusals are the probe's announcement at build only: with wake-ups off, no key is
    // marked waited for and no release announces.
    let refused = refusals(&server).await;
    assert!(!refused.is_empty());
    for (reason, object) in refused {
        assert_eq!(reason, "channel", "refused {object}");
    }
}

/// Connecting and a whole cycle send nothing the server refuses or does not know (redis-rs
/// would send `CLIENT SETINFO`, which 7.0 does not know and 7.2 refuses to a user without
/// it): the server counts no error replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_sends_no_command_the_server_answers_with_an_error() {
    let server = harness::require(RedisServer::start().await);
    harness::require(server.command(&["CONFIG", "RESETSTAT"]).await);
    let redis = backend_as(&server, "locker", true).await;
    every_call_works(&redis).await;
    let errors = harness::require(server.command(&["INFO", "errorstats"]).await)
        .as_text()
        .expect("INFO is text");
    let counted: Vec<&str> = errors
        .lines()
        .filter(|line| line.starts_with("errorstat_"))
        .collect();
    assert_eq!(counted, Vec::<&str>::new(), "error replies the server sent");
}

/// The commands a user needs beyond README's line on a Redis 7 cluster for its releases to
/// be announced on their key's shard (README says so).
const SHARD_COMMANDS: &[&str] = &["+spublish", "+ssubscribe", "+sunsubscribe"];

/// What a cluster client needs beyond README's line: the slot map (README says so).
const CLUSTER_COMMANDS: &[&str] = &["+cluster|slots"];

/// Makes `user` on every node of `cluster` as [`set_user`] says (channels included), with
/// [`CLUSTER_COMMANDS`] and `extra`; returns a backend logged in as that user.
async fn cluster_backend_as(
    cluster: &harness::redis::RedisCluster,
    user: &str,
    extra: &[&str],
) -> RedisBackend {
    let extra: Vec<&str> = CLUSTER_COMMANDS.iter().chain(extra).copied().collect();
    for node in cluster.nodes() {
        set_user(node, user, true, &extra).await;
    }
    let built = RedisBackend::builder()
        .cluster_urls(
            cluster
                .nodes()
                .iter()
                .map(|n| format!("redis://{user}:{PASSWORD}@127.0.0.1:{}/", n.port())),
        )
        .build()
        .await;
    match built {
        Ok(b) => b,
        Err(e) => panic!(
            "{e}; a node's ACL LOG: {:?}",
            refusals(&cluster.nodes()[0]).await
        ),
    }
}

/// A locker on `waiter` that backs off from `initial` to `max` and waits up to `wait`.
fn waiting_locker(
    waiter: RedisBackend,
    initial: Duration,
    max: Duration,
    wait: Duration,
) -> distlock_core::Locker {
    distlock_core::Locker::builder(std::sync::Arc::new(waiter))
        .ttl(TTL)
        .retry(distlock_core::RetryPolicy { initial, max })
        .wait_timeout(Some(wait))
        .build()
        .unwrap()
}

/// A waiter on `waiter` for a key `holder` holds, then the release: how long the waiter
/// took to hold the key after it, and the `(PUBLISH, SPUBLISH)` calls the cluster ran
/// meanwhile.
async fn one_woken_handoff(
    cluster: &harness::redis::RedisCluster,
    holder: &RedisBackend,
    waiter: RedisBackend,
) -> (Duration, (u64, u64)) {
    let backoff = Duration::from_secs(20);
    let key = LockKey::new("acl:handoff").unwrap();
    let lease = holder
        .acquire(&key, TTL)
        .await
        .unwrap()
        .expect("a free key");
    let locker = waiting_locker(waiter, backoff, backoff, backoff * 2);
    let waiting = tokio::spawn({
        let key = key.clone();
        async move {
            let guard = locker.lock(&key).await.expect("the waiter holds the key");
            let held = tokio::time::Instant::now();
            guard.release().await.unwrap();
            held
        }
    });
    // The waiter has tried, marked the key waited for, and subscribed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = (
        common::cluster_calls(cluster, "publish").await,
        common::cluster_calls(cluster, "spublish").await,
    );
    let released = tokio::time::Instant::now();
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    let held = waiting.await.unwrap();
    let after = (
        common::cluster_calls(cluster, "publish").await,
        common::cluster_calls(cluster, "spublish").await,
    );
    (held - released, (after.0 - before.0, after.1 - before.1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_user_with_the_shard_channel_commands_is_woken_over_spublish() {
    let cluster = harness::require(harness::redis::RedisCluster::start().await);
    let holder = cluster_backend_as(&cluster, "locker", SHARD_COMMANDS).await;
    let waiter = cluster_backend_as(&cluster, "locker", SHARD_COMMANDS).await;
    assert!(waiter.capabilities().wakes_waiters);
    let (after_release, (publishes, spublishes)) =
        one_woken_handoff(&cluster, &holder, waiter).await;
    assert!(after_release < Duration::from_secs(5), "{after_release:?}");
    assert_eq!((publishes, spublishes), (0, 1));
    for node in cluster.nodes() {
        assert_eq!(refusals(node).await, Vec::new(), "node {}", node.port());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_user_without_the_shard_channel_commands_is_still_woken_over_publish() {
    let cluster = harness::require(harness::redis::RedisCluster::start().await);
    let holder = cluster_backend_as(&cluster, "locker", &[]).await;
    let waiter = cluster_backend_as(&cluster, "locker", &[]).await;
    assert!(waiter.capabilities().wakes_waiters);
    let (after_release, (publishes, spublishes)) =
        one_woken_handoff(&cluster, &holder, waiter).await;
    assert!(after_release < Duration::from_secs(5), "{after_release:?}");
    assert_eq!((publishes, spublishes), (1, 0));
}

/// The `count` of each `ACL LOG` entry of `server` (a refusal repeated within a minute is
/// counted in one entry).
async fn refusal_counts(server: &RedisServer) -> Vec<i64> {
    let RespValue::Array(Some(entries)) = harness::require(server.command(&["ACL", "LOG"]).await)
    else {
        panic!("ACL LOG is an array")
    };
    entries
        .into_iter()
        .map(|entry| match entry {
            RespValue::Array(Some(fields)) => fields
                .chunks(2)
                .find_map(|pair| match pair {
                    [RespValue::Bulk(Some(name)), RespValue::Integer(n)] if name == b"count" => {
                        Some(*n)
                    }
                    _ => None,
                })
                .expect("an ACL LOG entry has a count"),
            other => panic!("an ACL LOG entry is an array: {other:?}"),
        })
        .collect()
}

/// A cluster user who may `SPUBLISH` but not `SSUBSCRIBE`: `build` finds out (one refused
/// `SSUBSCRIBE` per backend built) and falls back to `PUBLISH` and `SUBSCRIBE`, which it
/// may: its waiters are woken, and no listener is refused after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_user_refused_ssubscribe_at_build_is_woken_over_publish() {
    let cluster = harness::require(harness::redis::RedisCluster::start().await);
    let holder = cluster_backend_as(&cluster, "locker", &["+spublish"]).await;
    let waiter = cluster_backend_as(&cluster, "locker", &["+spublish"]).await;
    assert!(waiter.capabilities().wakes_waiters);
    let (after_release, (publishes, spublishes)) =
        one_woken_handoff(&cluster, &holder, waiter).await;
    assert!(after_release < Duration::from_secs(5), "{after_release:?}");
    assert_eq!((publishes, spublishes), (1, 0));
    let mut refused = Vec::new();
    let mut counts = Vec::new();
    for node in cluster.nodes() {
        refused.extend(refusals(node).await);
        counts.extend(refusal_counts(node).await);
    }
    assert_eq!(refused, [("command".into(), "ssubscribe".into())]);
    assert_eq!(counts, [2], "one SSUBSCRIBE refused per backend built");
}

/// A key `holder` holds, waited for by `waiter`'s `Locker::lock` (which watches its
/// releases) until the holder releases it; `rounds` times, the waiter releasing the key
/// it got each time. The holder tries the key once while held first, as a waiter of
/// another process would (which marks it waited for, with wake-ups on).
async fn contended_waits(holder: &RedisBackend, waiter: &RedisBackend, rounds: usize) {
    let key = LockKey::new("acl:contended").unwrap();
    let locker = waiting_locker(
        waiter.clone(),
        Duration::from_millis(10),
        Duration::from_millis(50),
        TTL,
    );
    for round in 0..rounds {
        let lease = holder
            .acquire(&key, TTL)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: the key is free"));
        let waiting = tokio::spawn({
            let (locker, key) = (locker.clone(), key.clone());
            async move {
                let guard = locker.lock(&key).await?;
                guard.release().await
            }
        });
        // The waiter has tried (and found the key held) at least once.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
        assert_eq!(
            waiting.await.unwrap().unwrap(),
            Release::Released,
            "round {round}: the waiter got the key"
        );
    }
}

/// A user whose `SUBSCRIBE` is refused after the backend was built (its rights changed):
/// the listener is refused once and stays ended, however many waiters come after, and
/// their acquires mark nothing for a listener that no longer hears (no `PUBLISH` per
/// release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_refused_once_is_not_started_again_by_the_next_twenty_waits() {
    let server = harness::require(RedisServer::start().await);
    let waiter = backend_as(&server, "locker", true).await;
    assert!(waiter.capabilities().wakes_waiters);
    let holder = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{}/", server.port()))
        .build()
        .await
        .unwrap();
    assert_eq!(refusals(&server).await, [], "nothing refused at build");
    let revoke = ["ACL", "SETUSER", "locker", "-subscribe"];
    assert_eq!(
        harness::require(server.command(&revoke).await),
        RespValue::Simple("OK".into())
    );

    contended_waits(&holder, &waiter, 1).await;
    let publishes = common::command_calls(&server, "publish").await;
    contended_waits(&holder, &waiter, 19).await;

    let refused = refusals(&server).await;
    assert_eq!(refused, [("command".into(), "subscribe".into())]);
    assert_eq!(
        refusal_counts(&server).await,
        [1],
        "SUBSCRIBE refused over 20 waits"
    );
    assert_eq!(
        common::command_calls(&server, "publish").await - publishes,
        0,
        "PUBLISH calls over the 19 waits after the refusal"
    );
    assert!(
        waiter
            .watch_releases(&LockKey::new("acl:later").unwrap())
            .is_none(),
        "later waiters poll"
    );
}

/// Without rights on the release channels, contended keys are not marked waited for and
/// releases announce nothing: 20 contended releases add no `ACL LOG` entry to the probe's
/// at build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channel_rights_contended_releases_run_no_refused_publish() {
    let server = harness::require(RedisServer::start().await);
    let redis = backend_as(&server, "no-channels", false).await;
    assert!(!redis.capabilities().wakes_waiters);
    let probe = [("channel".to_owned(), "distlock:{}".to_owned())];
    assert_eq!(refusals(&server).await, probe, "the probe at build");

    contended_waits(&redis, &redis, 20).await;

    assert_eq!(refusals(&server).await, probe);
    assert_eq!(refusal_counts(&server).await, [1], "only the probe's");
}

/// A user who may `PUBLISH` but not `SUBSCRIBE`: `build` finds out (one refused
/// `SUBSCRIBE`) and turns wake-ups off, so no waiter starts a listener to be refused, and
/// contended keys are not marked (no `PUBLISH` for nobody) over 20 waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_may_publish_but_not_subscribe_runs_without_wake_ups_from_build() {
    let server = harness::require(RedisServer::start().await);
    set_user(&server, "publisher", true, &["-subscribe"]).await;
    let redis = RedisBackend::builder()
        .url(format!(
            "redis://publisher:{PASSWORD}@127.0.0.1:{}/",
            server.port()
        ))
        .build()
        .await
        .expect("a user without SUBSCRIBE builds a backend");
    assert!(!redis.capabilities().wakes_waiters);
    assert!(
        redis
            .watch_releases(&LockKey::new("acl:watched").unwrap())
            .is_none(),
        "no listener is started"
    );

    contended_waits(&redis, &redis, 20).await;

    assert_eq!(
        refusals(&server).await,
        [("command".into(), "subscribe".into())]
    );
    assert_eq!(refusal_counts(&server).await, [1], "the probe's, once");
    assert_eq!(
        common::command_calls(&server, "publish").await,
        1,
        "the probe's"
    );
}

/// The commands of the semaphores' index, which a user set up by README's line before the
/// index lacks.
const INDEX_COMMANDS: [&str; 8] = [
    "-setbit",
    "-getbit",
    "-bitpos",
    "-bitcount",
    "-zadd",
    "-zrem",
    "-zrange",
    "-zrangebyscore",
];

/// A user set up before the semaphores' index (README's line without the index's
/// commands) still takes and gives back permits after an upgrade: the first attempt is
/// refused before it writes a slot key, and the backend takes the slot keys without the
/// index from then on. Never more permits than the semaphore has, and nothing left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_the_index_commands_still_takes_permits() {
    let server = harness::require(RedisServer::start().await);
    set_user(&server, "old", true, &INDEX_COMMANDS).await;
    let url = format!("redis://old:{PASSWORD}@127.0.0.1:{}/", server.port());
    let redis = RedisBackend::builder().url(url).build().await.unwrap();
    let locker = distlock_core::Locker::builder(std::sync::Arc::new(redis.clone()))
        .ttl(TTL)
        .build()
        .unwrap();
    let semaphore = locker
        .semaphore(&LockKey::new("exports").unwrap(), 3)
        .unwrap();
    // Declared at build; once refused, a semaphore no longer asks from slot 0 first.
    assert!(redis.capabilities().permit_index, "before the refusal");
    let mut held = Vec::new();
    for _ in 0..3 {
        let permit = semaphore
            .try_acquire()
            .await
            .expect("no error")
            .expect("free");
        held.push(permit);
    }
    assert!(!redis.capabilities().permit_index, "after the refusal");
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "a 4th of 3"
    );
    let mut slots: Vec<u32> = held.iter().map(|p| p.slot()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2]);
    let freed = held.pop().unwrap();
    assert_eq!(freed.release().await.unwrap(), Release::Released);
    let again = semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("the freed permit");
    held.push(again);
    for permit in held {
        assert_eq!(permit.release().await.unwrap(), Release::Released);
    }
    assert_nothing_held(&server).await;
    // Refused once by an attempt: the index is not asked again (releases still try to
    // free their slot there, best effort, and are refused `SETBIT`).
    assert_eq!(refused_times(&server, "bitpos").await, 1);
}

/// The same user's permit attempts made at once, so that they are coalesced: the calls
/// the server refuses the index take the slot keys without it, every attempt is answered
/// without an error, and never more permits are granted than the semaphore has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_the_index_commands_takes_permits_in_coalesced_attempts() {
    let server = harness::require(RedisServer::start().await);
    set_user(&server, "old", true, &INDEX_COMMANDS).await;
    let url = format!("redis://old:{PASSWORD}@127.0.0.1:{}/", server.port());
    let redis = RedisBackend::builder().url(url).build().await.unwrap();
    let slots: Vec<LockKey> = (0..3)
        .map(|i| LockKey::new(format!("exports:permit:{i}")).unwrap())
        .collect();
    let attempts = futures::future::join_all((0..8).map(|_| redis.acquire_any(&slots, TTL))).await;
    let held: Vec<_> = attempts
        .into_iter()
        .filter_map(|a| a.expect("no error"))
        .collect();
    let mut taken: Vec<&LockKey> = held.iter().map(|l| l.key()).collect();
    taken.sort();
    assert_eq!(taken, slots.iter().collect::<Vec<_>>());
    for lease in &held {
        assert_eq!(redis.release(lease).await.unwrap(), Release::Released);
    }
    assert_nothing_held(&server).await;
}

/// How many times `ACL LOG` says the server refused `command` (it counts repeats of one
/// refusal in one entry).
async fn refused_times(server: &RedisServer, command: &str) -> i64 {
    let RespValue::Array(Some(entries)) = harness::require(server.command(&["ACL", "LOG"]).await)
    else {
        panic!("ACL LOG is not an array");
    };
    let mut times = 0;
    for entry in entries {
        let RespValue::Array(Some(fields)) = entry else {
            panic!("an ACL LOG entry is not an array: {entry:?}");
        };
        let field = |name: &str| {
            let at = fields
                .iter()
                .position(|f| f.as_text().as_deref() == Some(name));
            at.and_then(|i| fields.get(i + 1))
        };
        if field("object").and_then(RespValue::as_text).as_deref() == Some(command) {
            match field("count") {
                Some(RespValue::Integer(n)) => times += n,
                other => panic!("an ACL LOG entry's count is {other:?}"),
            }
        }
    }
    times
}
