//! `build()` refuses a Redis whose `maxmemory-policy` may evict lock keys (any policy but
//! `noeviction` once `maxmemory` is set), on a single node and on any master of a
//! cluster, with a `Config` error that names the setting, the node and the fix. A policy
//! that evicts nothing yet (`maxmemory 0`), or one the user may not read, is let through
//! with a warning.

mod common;

use std::fmt;
use std::sync::{Arc, Mutex};

use distlock_core::LockError;
use harness::redis::{RedisCluster, RedisServer, RedisServerBuilder};
use lock_redis::RedisBackend;
use tracing::field::{Field, Visit};
use tracing::instrument::WithSubscriber;
use tracing::{Event, Level, Metadata, span};

const PASSWORD: &str = "eviction-test-pw";
/// A memory limit (100 MiB) far above what the tests use: nothing is evicted in them.
const LIMIT: &str = "104857600";

/// A server started from `builder` with `--maxmemory-policy policy --maxmemory maxmemory`.
async fn server_with(builder: RedisServerBuilder, policy: &str, maxmemory: &str) -> RedisServer {
    let args = ["--maxmemory-policy", policy, "--maxmemory", maxmemory];
    harness::require(builder.args(args).start().await)
}

/// `build()` on `urls` (a cluster when more than one or `cluster`), with the warnings
/// lock-redis logged meanwhile.
async fn build(urls: Vec<String>, cluster: bool) -> (Result<RedisBackend, LockError>, Vec<String>) {
    let builder = RedisBackend::builder();
    let builder = if cluster {
        builder.cluster_urls(urls)
    } else {
        builder.url(urls[0].clone())
    };
    let warnings = Warnings::default();
    let built = builder.build().with_subscriber(warnings.clone()).await;
    let logged = warnings.0.lock().unwrap().clone();
    (built, logged)
}

/// The `Config` message of a refused build.
fn refusal(built: Result<RedisBackend, LockError>) -> String {
    match built {
        Err(LockError::Config(message)) => message,
        Err(other) => panic!("refused, but not with Config: {other:?}"),
        Ok(_) => panic!("the backend was built"),
    }
}

/// Asserts `message` names the setting, the policy found, the node (`node`'s address)
/// and the fix.
fn assert_names_the_policy(message: &str, policy: &str, node: &RedisServer) {
    for part in [
        format!("`maxmemory-policy {policy}`"),
        format!("`maxmemory {LIMIT}`"),
        format!("127.0.0.1:{}", node.port()),
        "`maxmemory-policy noeviction`".to_owned(),
    ] {
        assert!(message.contains(&part), "{part:?} is not in {message:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volatile_lru_with_a_memory_limit_is_refused_without_showing_the_password() {
    let builder = RedisServer::builder().password(Some(PASSWORD));
    let server = server_with(builder, "volatile-lru", LIMIT).await;
    let (built, _) = build(vec![server.url()], false).await;
    let message = refusal(built);
    assert_names_the_policy(&message, "volatile-lru", &server);
    assert!(!message.contains(PASSWORD), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allkeys_lru_with_a_memory_limit_is_refused() {
    let server = server_with(RedisServer::builder(), "allkeys-lru", LIMIT).await;
    let (built, _) = build(vec![server.url()], false).await;
    assert_names_the_policy(&refusal(built), "allkeys-lru", &server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_with_a_memory_limit_is_accepted_and_read_again_at_each_build() {
    let server = server_with(RedisServer::builder(), "noeviction", LIMIT).await;
    let (built, warnings) = build(vec![server.url()], false).await;
    built.expect("a server that never evicts is accepted");
    assert_eq!(warnings, Vec::<String>::new());

    harness::require(
        server
            .command(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
            .await,
    );
    let (built, _) = build(vec![server.url()], false).await;
    assert_names_the_policy(&refusal(built), "allkeys-lru", &server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volatile_lru_without_a_memory_limit_is_accepted_with_one_warning() {
    let server = server_with(RedisServer::builder(), "volatile-lru", "0").await;
    let (built, warnings) = build(vec![server.url()], false).await;
    built.expect("nothing is evicted without a memory limit");
    let eviction: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("maxmemory-policy"))
        .collect();
    assert_eq!(eviction.len(), 1, "{warnings:?}");
    for part in [
        "volatile-lru",
        "`maxmemory`",
        "`maxmemory-policy noeviction`",
    ] {
        assert!(
            eviction[0].contains(part),
            "{part:?} is not in {eviction:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_may_not_run_info_is_accepted_with_a_warning() {
    let user = harness::require(common::readme_user(PASSWORD).without_rule("+info"));
    let builder = RedisServer::builder().user(user.clone());
    let server = server_with(builder, "allkeys-lru", LIMIT).await;
    let url = server.url_as(user.name()).expect("the user exists");
    let (built, warnings) = build(vec![url], false).await;
    built.expect("a policy that cannot be read is not refused");
    let unread: Vec<&String> = warnings
        .iter()
        .filter(|w| w.contains("cannot read `maxmemory-policy`"))
        .collect();
    assert_eq!(unread.len(), 1, "{warnings:?}");
    assert!(unread[0].contains("NOPERM"), "{unread:?}");
    assert!(!unread[0].contains(PASSWORD), "{unread:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_one_evicting_master_is_refused_from_any_seed() {
    let cluster = harness::require(RedisCluster::start().await);
    let evicting = &cluster.nodes()[2];
    for (name, value) in [("maxmemory-policy", "allkeys-lru"), ("maxmemory", LIMIT)] {
        harness::require(evicting.command(&["CONFIG", "SET", name, value]).await);
    }
    // The seed is another master: every master is read, not only those given.
    let seed = cluster.nodes()[0].url();
    let (built, _) = build(vec![seed], true).await;
    let message = refusal(built);
    assert_names_the_policy(&message, "allkeys-lru", evicting);
    for other in &cluster.nodes()[..2] {
        assert!(
            !message.contains(&format!(":{}", other.port())),
            "{message}"
        );
    }
}

/// Records the message of every warning (or error) lock-redis logs.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::WARN && metadata.target().starts_with("lock_redis")
    }

    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, event: &Event<'_>) {
        struct Message(String);
        impl Visit for Message {
            fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().unwrap().push(message.0);
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}
