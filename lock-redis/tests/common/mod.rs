//! Factories and helpers shared by the Redis tests: every test starts its own servers
//! through the conformance harness; nothing relies on a Redis that is already running.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::{Factory, LinkFaults, ServerFaults};
use conformance::harness::{
    self,
    proxy::FaultProxy,
    redis::{RedisCluster, RedisServer},
};
use lock_api::LockBackend;
use lock_redis::RedisBackend;

/// The response timeout the tests use: short, so blackholes are noticed quickly.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_millis(300);

/// A single `redis-server`, reached through a fault proxy.
pub struct RedisFactory {
    pub server: Arc<RedisServer>,
    pub proxy: Arc<FaultProxy>,
}

impl RedisFactory {
    pub async fn start() -> Self {
        let server = harness::require(RedisServer::start().await);
        let proxy = harness::require(FaultProxy::start(server.addr()).await);
        Self {
            server: Arc::new(server),
            proxy: Arc::new(proxy),
        }
    }

    /// `redis://` URL through the proxy.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.proxy.addr())
    }

    /// A client with the short [`RESPONSE_TIMEOUT`], for the fault tests.
    pub async fn redis(&self) -> RedisBackend {
        self.redis_with(RESPONSE_TIMEOUT).await
    }

    pub async fn redis_with(&self, response_timeout: Duration) -> RedisBackend {
        RedisBackend::builder()
            .url(self.url())
            .response_timeout(response_timeout)
            .build()
            .await
            .expect("connect to the test server")
    }

    /// `(command, calls)` from `INFO commandstats`, e.g. `("evalsha", 3)`.
    pub async fn calls(&self, command: &str) -> u64 {
        command_calls(&self.server, command).await
    }
}

#[async_trait]
impl Factory for RedisFactory {
    fn name(&self) -> &str {
        "redis"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        // The suite delays the link by a fifth of a 250 ms TTL each way; the first call
        // of a script also loads it, three round trips in all.
        Arc::new(self.redis_with(Duration::from_secs(1)).await)
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(ProxyLink(self.proxy.clone())))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(Arc::new(ServerControl(self.server.clone())))
    }
}

/// A 3-master Redis Cluster (no proxy: the client talks to every node directly).
pub struct RedisClusterFactory {
    pub cluster: Arc<RedisCluster>,
}

impl RedisClusterFactory {
    pub async fn start() -> Self {
        Self {
            cluster: Arc::new(harness::require(RedisCluster::start().await)),
        }
    }

    pub async fn redis(&self) -> RedisBackend {
        RedisBackend::builder()
            .cluster_urls(self.cluster.urls())
            .response_timeout(Duration::from_secs(1))
            .build()
            .await
            .expect("connect to the test cluster")
    }
}

#[async_trait]
impl Factory for RedisClusterFactory {
    fn name(&self) -> &str {
        "redis-cluster"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(self.redis().await)
    }
}

struct ProxyLink(Arc<FaultProxy>);

#[async_trait]
impl LinkFaults for ProxyLink {
    async fn cut(&self) {
        self.0.blackhole();
    }
    async fn delay(&self, by: Duration) {
        self.0.delay(by);
    }
    async fn heal(&self) {
        self.0.heal();
    }
}

struct ServerControl(Arc<RedisServer>);

#[async_trait]
impl ServerFaults for ServerControl {
    async fn pause(&self) {
        harness::require(self.0.pause());
    }
    async fn resume(&self) {
        harness::require(self.0.resume());
    }
    async fn kill(&self) {
        harness::require(self.0.kill());
    }
    async fn restart(&self) {
        harness::require(self.0.restart().await);
    }
}

/// Calls of `command` (lowercase) since the server started or `CONFIG RESETSTAT`.
pub async fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let info = harness::require(server.command(&["INFO", "commandstats"]).await)
        .as_text()
        .unwrap_or_default();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A field of `INFO <section>` as a number.
pub async fn info_field(server: &RedisServer, section: &str, field: &str) -> u64 {
    let info = harness::require(server.command(&["INFO", section]).await)
        .as_text()
        .unwrap_or_default();
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}
