//! The whole conformance suite on a single `redis-server` run the ways users deploy it
//! (one server per case, link faults through a proxy):
//!
//! - `persistent`: RDB snapshots (a background save each second after a change) and the
//!   append-only file with `appendfsync everysec`; its server fault is `kill -9` and a
//!   restart from the same data directory on the same port, so the restart cases see the
//!   store come back with its data.
//! - `acl_user`: clients log in as the user of README's `ACL SETUSER` line, limited to the
//!   key prefix, its release channels and the commands named there.
//! - `acl_user_without_channels`: the same user without the channel rule (Redis 7's
//!   default for a new user): wake-ups are off, so the cases that need them are not
//!   stamped, and every other case runs.
//!
//! The ACL users are given on the server's command line, so they exist again after a
//! restart and the server-fault cases run for them too. The tests after the suites check
//! that each factory is what it says: the persistent server keeps a lease across
//! `kill -9`, and the ACL clients are that user and were refused nothing else.

mod common;

use std::time::Duration;

use common::{RedisFactory, readme_user};
use distlock_core::{LockBackend, LockKey, Release};
use harness::redis::{AppendFsync, RedisServer, RespValue};

const PASSWORD: &str = "deployed/pw#1";

/// RDB + AOF `everysec`, as the persistent factory runs it.
async fn persistent() -> RedisFactory {
    RedisFactory::start_with(
        "redis (RDB + AOF everysec, kill -9)",
        RedisServer::builder()
            .appendfsync(AppendFsync::EverySec)
            .snapshots(&[(1, 1)]),
        None,
    )
    .await
}

/// Clients as README's user, with its channel rule or without it.
async fn acl_user(channels: bool) -> RedisFactory {
    let user = readme_user(PASSWORD);
    let (name, user) = if channels {
        ("redis (ACL user)", user)
    } else {
        let user = harness::require(user.without_rule("&distlock:*"));
        ("redis (ACL user, no channels)", user)
    };
    RedisFactory::start_with(name, RedisServer::builder(), Some(user)).await
}

/// `factory` with the backend's own fenced resource, on a client of the factory's user.
async fn with_fenced(
    factory: RedisFactory,
) -> conformance::factory::WithFencedResource<RedisFactory> {
    let fenced = lock_redis::RedisFencedResource::new(
        factory.redis().await,
        distlock_core::EnforcementMode::Enforce,
    );
    conformance::factory::WithFencedResource::new(factory, fenced)
}

mod persistent {
    conformance::conformance_tests!(
        async { super::with_fenced(super::persistent().await).await },
        capabilities: [link_faults, server_faults, inspect, distinct_clients, wakes_waiters, clock_step],
    );
}

mod acl_user {
    conformance::conformance_tests!(
        async { super::with_fenced(super::acl_user(true).await).await },
        capabilities: [link_faults, server_faults, inspect, distinct_clients, wakes_waiters, clock_step],
    );
}

mod acl_user_without_channels {
    conformance::conformance_tests!(
        async { super::with_fenced(super::acl_user(false).await).await },
        capabilities: [link_faults, server_faults, inspect, distinct_clients, clock_step],
    );
}

/// `CONFIG GET name` on `server`.
async fn config(server: &RedisServer, name: &str) -> String {
    match harness::require(server.command(&["CONFIG", "GET", name]).await) {
        RespValue::Array(Some(items)) if items.len() == 2 => items[1].as_text().unwrap(),
        other => panic!("CONFIG GET {name} answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_persistent_server_snapshots_and_keeps_a_lease_across_kill_9() {
    let factory = persistent().await;
    assert_eq!(config(&factory.server, "appendonly").await, "yes");
    assert_eq!(config(&factory.server, "appendfsync").await, "everysec");
    assert_eq!(config(&factory.server, "save").await, "1 1");
    let redis = factory.redis().await;
    let key = LockKey::new("payout:durable").unwrap();
    let lease = redis
        .acquire(&key, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a free key");
    // A background save runs within a second of the change.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !factory.server.dir().join("dump.rdb").exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no RDB snapshot within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = factory.server.pid();

    harness::require(factory.server.kill());
    harness::require(factory.server.restart().await);

    assert_ne!(factory.server.pid(), pid, "a new process");
    let info = factory.redis().await.inspect(&key).await.unwrap();
    assert_eq!(
        (info.owner, info.token),
        (Some(lease.owner()), Some(lease.token())),
        "the lease came back from the data directory"
    );
    // The holder's client reconnects and releases it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let released = loop {
        match redis.release(&lease).await {
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    assert_eq!(released.unwrap(), Release::Released);
}

/// The user names of the server's client connections other than the one asking.
async fn client_users(server: &RedisServer) -> Vec<String> {
    let list = harness::require(server.command(&["CLIENT", "LIST"]).await)
        .as_text()
        .unwrap_or_default();
    list.lines()
        .filter(|l| !l.contains(" cmd=client|list "))
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("user=")))
        .map(str::to_owned)
        .collect()
}

/// A few calls through every connection a client opens (the main one, the release
/// listener's), as the factory's user.
async fn lock_and_wait(factory: &RedisFactory) {
    let redis = factory.redis().await;
    let key = LockKey::new("payout:acl").unwrap();
    let lease = redis
        .acquire(&key, Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a free key");
    let watch = redis.watch_releases(&key);
    // Long enough for a listener to subscribe.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!client_users(&factory.server).await.is_empty());
    assert!(
        client_users(&factory.server)
            .await
            .iter()
            .all(|user| user == "distlock"),
        "every connection of the client is README's user: {:?}",
        client_users(&factory.server).await
    );
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    drop(watch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acl_factory_clients_are_readmes_user_and_nothing_is_refused() {
    let factory = acl_user(true).await;
    lock_and_wait(&factory).await;
    assert!(factory.redis().await.capabilities().wakes_waiters);
    assert_eq!(harness::require(factory.server.acl_refusals().await), []);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channels_only_the_announcements_are_refused() {
    let factory = acl_user(false).await;
    lock_and_wait(&factory).await;
    assert!(!factory.redis().await.capabilities().wakes_waiters);
    let refused = harness::require(factory.server.acl_refusals().await);
    assert!(!refused.is_empty(), "the release's announcement is refused");
    assert!(
        refused.iter().all(|(reason, _)| reason == "channel"),
        "{refused:?}"
    );
}
