//! Bad input gets a typed error, changes nothing and never leaks a password: malformed
//! URLs, wrong credentials, a server that is down, bad TTLs, foreign leases, and keys with
//! braces, spaces and non-ASCII text (which work, with both keys in one slot).

mod common;

use std::time::Duration;

use common::{RedisClusterFactory, RedisFactory, command_calls};
use distlock_core::{Fence, LockBackend, LockError, LockKey, Release, Renewal};
use harness::redis::RedisServer;
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const SECRET: &str = "hunter2-secret";

async fn build(url: &str) -> Result<RedisBackend, LockError> {
    RedisBackend::builder()
        .url(url)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
}

#[tokio::test]
async fn malformed_urls_are_config_errors_without_the_password() {
    for url in [
        format!("redis://:{SECRET}@[::1"),
        format!("http://:{SECRET}@127.0.0.1:1/"),
        format!("redis://:{SECRET}@127.0.0.1:1/not-a-db"),
        SECRET.to_string(),
    ] {
        let err = build(&url).await.expect_err(&url);
        assert!(matches!(err, LockError::Config(_)), "{url}: {err:?}");
        assert!(!err.to_string().contains(SECRET), "{err}");
        assert!(!format!("{err:?}").contains(SECRET), "{err:?}");
    }
    let err = RedisBackend::builder()
        .cluster_urls([format!("redis://:{SECRET}@127.0.0.1:1/3")])
        .build()
        .await
        .expect_err("a cluster has no database 3");
    assert!(
        matches!(err, LockError::Config(_)) && !err.to_string().contains(SECRET),
        "{err}"
    );
}

/// A refused connection says so, with the operating system's reason kept as the source.
#[tokio::test]
async fn a_refused_connection_keeps_the_operating_systems_reason() {
    let port = harness::free_port().unwrap();
    let err = build(&format!("redis://:{SECRET}@127.0.0.1:{port}/"))
        .await
        .expect_err("nothing listens");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("Connection refused"), "{err}");
    let io = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .unwrap_or_else(|| panic!("an I/O error as the source: {err:?}"));
    assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(!format!("{err:?}").contains(SECRET), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_password_is_refused_without_echoing_it() {
    let server = harness::require(RedisServer::builder().password(Some(SECRET)).start().await);
    let port = server.port();
    for url in [
        format!("redis://:wrong-{SECRET}@127.0.0.1:{port}/"),
        format!("redis://127.0.0.1:{port}/"),
    ] {
        let err = build(&url).await.expect_err("bad credentials");
        assert!(matches!(err, LockError::Config(_)), "{err:?}");
        assert!(!err.is_retryable());
        assert!(!err.to_string().contains(SECRET), "{err}");
    }
    let redis = build(&server.url())
        .await
        .expect("the right password works");
    assert!(!format!("{redis:?}").contains(SECRET), "{redis:?}");
    let lease = redis
        .acquire(&LockKey::new("pw").unwrap(), TTL)
        .await
        .unwrap();
    assert!(lease.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_unavailable() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let lease = redis
        .acquire(&LockKey::new("down").unwrap(), TTL)
        .await
        .unwrap()
        .unwrap();
    harness::require(f.server.kill());

    let err = build(&format!("redis://:{SECRET}@{}/", f.server.addr()))
        .await
        .expect_err("down");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(!err.to_string().contains(SECRET));

    // An existing client fails every call with a retryable error, and never panics.
    let acquire = redis.acquire(&LockKey::new("down-2").unwrap(), TTL).await;
    assert!(
        matches!(&acquire, Err(e) if e.is_retryable()),
        "{acquire:?}"
    );
    let renew = redis.renew(&lease).await;
    assert!(matches!(&renew, Err(e) if e.is_retryable()), "{renew:?}");
    let fence = redis.fence(&lease).await;
    assert!(
        matches!(&fence, Err(LockError::Unavailable { .. })),
        "{fence:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_ttl_longer_than_redis_keeps_is_refused_and_the_longest_ttl_works() {
    let f = RedisFactory::start().await;
    let too_long = Duration::from_millis(u64::MAX);
    let err = RedisBackend::builder()
        .url(f.url())
        .ttl_bounds(lock_redis::DEFAULT_MIN_TTL, too_long)
        .build()
        .await
        .expect_err("PX cannot hold this TTL");
    assert!(matches!(err, LockError::Config(_)), "{err:?}");

    let redis = RedisBackend::builder()
        .url(f.url())
        .ttl_bounds(lock_redis::DEFAULT_MIN_TTL, lock_redis::LONGEST_TTL)
        .build()
        .await
        .expect("the longest TTL is accepted");
    let k = LockKey::new("ttl-edge").unwrap();
    let beyond = lock_redis::LONGEST_TTL + Duration::from_millis(1);
    let err = redis.acquire(&k, beyond).await.expect_err("too long");
    assert!(matches!(err, LockError::InvalidTtl { .. }), "{err:?}");
    let lease = redis
        .acquire(&k, lock_redis::LONGEST_TTL)
        .await
        .expect("Redis keeps the longest TTL")
        .expect("free key");
    assert!(matches!(
        redis.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ttls_and_foreign_leases_are_refused_before_any_io() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let other = f.redis().await;
    let k = LockKey::new("input").unwrap();
    for ttl in [
        Duration::ZERO,
        Duration::from_micros(1500),
        lock_redis::DEFAULT_MAX_TTL * 2,
    ] {
        let err = redis.acquire(&k, ttl).await.expect_err("bad ttl");
        assert!(matches!(err, LockError::InvalidTtl { .. }), "{err:?}");
        let err = redis
            .acquire_many(std::slice::from_ref(&k), ttl)
            .await
            .expect_err("bad ttl");
        assert!(matches!(err, LockError::InvalidTtl { .. }), "{err:?}");
    }
    assert_eq!(
        command_calls(&f.server, "evalsha").await,
        0,
        "a refused call reached the server"
    );

    let lease = redis.acquire(&k, TTL).await.unwrap().unwrap();
    for err in [
        other.renew(&lease).await.err(),
        other.release(&lease).await.err(),
        other.fence(&lease).await.err(),
        other.renew_many(std::slice::from_ref(&lease)).await.err(),
    ] {
        assert!(
            matches!(err, Some(LockError::ForeignLease { .. })),
            "{err:?}"
        );
    }
    // The holder is untouched.
    assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
}

const ODD_NAMES: [&str; 5] = [
    "job {42}",
    "}{ closing first",
    "a}b{c}d 100%",
    "ünïcödé 例 名前",
    "}",
];

async fn odd_names_work(redis: &RedisBackend) {
    let mut tokens = Vec::new();
    for name in ODD_NAMES {
        let k = LockKey::new(name).unwrap();
        let lease = redis.acquire(&k, TTL).await.unwrap().expect(name);
        assert!(
            redis.acquire(&k, TTL).await.unwrap().is_none(),
            "{name}: not exclusive"
        );
        assert!(matches!(
            redis.renew(&lease).await.unwrap(),
            Renewal::Renewed { .. }
        ));
        assert_eq!(redis.fence(&lease).await.unwrap(), Fence::Current);
        let info = redis.inspect(&k).await.unwrap();
        assert_eq!(info.owner, Some(lease.owner()));
        assert_eq!(info.token, Some(lease.token()));
        tokens.push(lease.token());
        assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_braces_spaces_and_unicode_work_on_a_single_node() {
    let f = RedisFactory::start().await;
    odd_names_work(&f.redis().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_braces_spaces_and_unicode_hash_by_their_name_in_a_cluster() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    odd_names_work(&redis).await;
    let node = &f.cluster.nodes()[0];
    for name in ODD_NAMES {
        let lock = redis.redis_key(&LockKey::new(name).unwrap());
        let slot = |k: String| async move {
            harness::require(node.command(&["CLUSTER", "KEYSLOT", k.as_str()]).await).as_text()
        };
        // The slot is the hash tag's, the same whatever the prefix.
        let tagged = format!("other-prefix{}", &lock[lock.find('{').unwrap()..]);
        let (a, b) = (slot(lock.clone()).await, slot(tagged.clone()).await);
        assert!(a.is_some());
        assert_eq!(a, b, "{name:?}: {lock} and {tagged} are in different slots");
    }
}
