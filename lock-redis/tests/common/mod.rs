//! Factories and helpers shared by the Redis tests: every test starts its own servers
//! through the test harness; nothing relies on a Redis that is already running.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults};
use distlock_core::{Lease, LockBackend, LockKey};
use harness::{
    ShiftedClock,
    proxy::FaultProxy,
    redis::{RedisCluster, RedisServer, RedisServerBuilder, RedisUser},
};
use lock_redis::RedisBackend;
use suite_faults::ProxyGroup;

/// The response timeout the tests use: short, so blackholes are noticed quickly.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_millis(300);

/// A single `redis-server`, reached through a fault proxy, run under a wall clock the
/// cases may step.
pub struct RedisFactory {
    pub server: Arc<RedisServer>,
    pub clock: Arc<ShiftedClock>,
    pub proxy: Arc<FaultProxy>,
    /// The factory's name in the suite's messages and summary.
    name: &'static str,
    /// The ACL user clients log in as; the default user when `None`.
    login: Option<RedisUser>,
}

impl RedisFactory {
    /// A server with the harness's defaults (no persistence), clients as the default user.
    pub async fn start() -> Self {
        Self::start_with("redis", RedisServer::builder(), None).await
    }

    /// A server started from `builder`, with `login` added to its users when given, whose
    /// clients log in as `login`; `name` names the factory in the suite's summary.
    pub async fn start_with(
        name: &'static str,
        builder: RedisServerBuilder,
        login: Option<RedisUser>,
    ) -> Self {
        let builder = match &login {
            Some(user) => builder.user(user.clone()),
            None => builder,
        };
        let clock = harness::require(ShiftedClock::new());
        let server = harness::require(builder.clock(&clock).start().await);
        let proxy = harness::require(FaultProxy::start(server.addr()).await);
        Self {
            server: Arc::new(server),
            clock: Arc::new(clock),
            proxy: Arc::new(proxy),
            name,
            login,
        }
    }

    /// `redis://` URL through the proxy, with the login's name and password if any.
    pub fn url(&self) -> String {
        match &self.login {
            Some(user) => user.url(self.proxy.addr()),
            None => format!("redis://{}/", self.proxy.addr()),
        }
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
        self.name
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        // The suite delays the link by a fifth of a 250 ms TTL each way; the first call
        // of a script also loads it, three round trips in all.
        Arc::new(self.redis_with(Duration::from_secs(1)).await)
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(suite_faults::link(self.proxy.clone()))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(suite_faults::server(self.server.clone()))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        let probe = server_clock(self.server.clone());
        Some(suite_faults::clock(self.clock.clone(), vec![probe]))
    }
}

/// A 3-master Redis Cluster, every node under one wall clock the cases may step. Without
/// proxies the client talks to every node directly; [`Self::behind_proxies`] puts a fault
/// proxy in front of each node.
pub struct RedisClusterFactory {
    pub cluster: Arc<RedisCluster>,
    pub clock: Arc<ShiftedClock>,
    /// One per node, in the order of the cluster's nodes; empty when there are none.
    pub proxies: Option<Arc<ProxyGroup>>,
}

impl RedisClusterFactory {
    pub async fn start() -> Self {
        let (cluster, clock) = cluster_under_a_clock().await;
        Self {
            cluster,
            clock,
            proxies: None,
        }
    }

    /// A cluster whose nodes clients reach only through a fault proxy each: every node
    /// announces its proxy's port (`cluster-announce-port`), so the slot map sends clients
    /// there, while the cluster bus stays direct. Link faults then hit every client
    /// connection and none between the nodes.
    pub async fn behind_proxies() -> Self {
        let (cluster, clock) = cluster_under_a_clock().await;
        let mut proxies = Vec::new();
        for node in cluster.nodes() {
            let proxy = harness::require(FaultProxy::start(node.addr()).await);
            let port = proxy.port().to_string();
            harness::require(
                node.command(&["CONFIG", "SET", "cluster-announce-port", &port])
                    .await,
            );
            proxies.push(proxy);
        }
        // Every node must have heard every new port before a client asks for the map.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for node in cluster.nodes() {
            loop {
                let nodes = harness::require(node.command(&["CLUSTER", "NODES"]).await)
                    .as_text()
                    .unwrap_or_default();
                if proxies
                    .iter()
                    .all(|p| nodes.contains(&format!(":{}@", p.port())))
                {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the proxies' ports were not gossiped within 30 s"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Self {
            cluster,
            clock,
            proxies: Some(Arc::new(ProxyGroup::new(proxies))),
        }
    }

    /// The URLs clients start from: the proxies', or the nodes' when there are none.
    fn seeds(&self) -> Vec<String> {
        match &self.proxies {
            None => self.cluster.urls(),
            Some(proxies) => proxies
                .iter()
                .map(|p| format!("redis://{}/", p.addr()))
                .collect(),
        }
    }

    pub async fn redis(&self) -> RedisBackend {
        RedisBackend::builder()
            .cluster_urls(self.seeds())
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

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        self.proxies
            .clone()
            .map(|proxies| proxies as Arc<dyn LinkFaults>)
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(suite_faults::cluster(self.cluster.clone()))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        let nodes = (0..self.cluster.nodes().len())
            .map(|i| {
                let cluster = self.cluster.clone();
                let probe: suite_faults::ClockProbe = Box::new(move || {
                    let cluster = cluster.clone();
                    Box::pin(async move { server_time(&cluster.nodes()[i]).await })
                });
                probe
            })
            .collect();
        Some(suite_faults::clock(self.clock.clone(), nodes))
    }
}

/// What `server` reads as its wall clock (`TIME`).
pub fn server_clock(server: Arc<RedisServer>) -> suite_faults::ClockProbe {
    Box::new(move || {
        let server = server.clone();
        Box::pin(async move { server_time(&server).await })
    })
}

/// The server's wall clock, from `TIME`.
pub async fn server_time(server: &RedisServer) -> std::time::SystemTime {
    let reply = harness::require(server.command(&["TIME"]).await);
    let harness::redis::RespValue::Array(Some(parts)) = reply else {
        panic!("TIME answered {reply:?}");
    };
    let [secs, micros] = [0, 1].map(|i| {
        parts[i]
            .as_text()
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("TIME answered {parts:?}"))
    });
    std::time::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
}

/// A 3-master cluster whose nodes share one wall clock.
async fn cluster_under_a_clock() -> (Arc<RedisCluster>, Arc<ShiftedClock>) {
    let clock = harness::require(ShiftedClock::new());
    let cluster = harness::require(RedisCluster::builder().clock(&clock).start().await);
    (Arc::new(cluster), Arc::new(clock))
}

/// A 3-master Redis Cluster with a replica per master, whose masters the cases may fail
/// over to their replicas.
pub struct RedisFailoverFactory {
    clients: RedisClusterFactory,
    failover: Arc<ReplicaPromotion>,
}

impl RedisFailoverFactory {
    pub async fn start() -> Self {
        let clients = RedisClusterFactory::start().await;
        let mut replicas = Vec::new();
        for master in clients.cluster.nodes() {
            replicas.push(harness::require(
                clients.cluster.start_replica(master).await,
            ));
        }
        let failover = Arc::new(ReplicaPromotion {
            cluster: clients.cluster.clone(),
            replicas,
            keys: clients.redis().await,
        });
        Self { clients, failover }
    }

    pub async fn redis(&self) -> RedisBackend {
        self.clients.redis().await
    }
}

#[async_trait]
impl Factory for RedisFailoverFactory {
    fn name(&self) -> &str {
        "redis-cluster (replicas)"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.clients.backend().await
    }

    fn failover(&self) -> Option<Arc<dyn Failover>> {
        Some(self.failover.clone())
    }
}

/// Kills the master of a key and waits until its replica serves the key's slot.
struct ReplicaPromotion {
    cluster: Arc<RedisCluster>,
    /// One per master, in the order of the cluster's nodes.
    replicas: Vec<RedisServer>,
    /// Names the Redis keys of a lock key.
    keys: RedisBackend,
}

#[async_trait]
impl Failover for ReplicaPromotion {
    async fn fail_over(&self, key: &LockKey) {
        let redis_key = self.keys.redis_key(key);
        let master = harness::require(self.cluster.node_for_key(redis_key.as_bytes()).await);
        let index = self
            .cluster
            .nodes()
            .iter()
            .position(|n| n.port() == master.port())
            .expect("the key's master is a node of the cluster");
        let replica = &self.replicas[index];
        // The replica has every write the master acknowledged before it dies.
        harness::require(master.command(&["WAIT", "1", "5000"]).await);
        harness::require(master.kill());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let role = replica.command(&["ROLE"]).await.ok().and_then(|r| match r {
                harness::redis::RespValue::Array(Some(items)) => {
                    items.into_iter().next().and_then(|i| i.as_text())
                }
                _ => None,
            });
            if role.as_deref() == Some("master") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "replica {} was not promoted within 30 s",
                replica.port()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        harness::require(self.cluster.wait_healthy(Duration::from_secs(30)).await);
    }
}

/// The user of README's `ACL SETUSER` line (key prefix `distlock`, the default), with
/// `password`.
pub fn readme_user(password: &str) -> RedisUser {
    harness::require(RedisUser::from_doc(
        include_str!("../../../README.md"),
        password,
    ))
}

/// Acquires every one of `keys` (all free) in one `acquire_many`; the leases, in order.
pub async fn acquire_all(redis: &RedisBackend, keys: &[LockKey], ttl: Duration) -> Vec<Lease> {
    redis
        .acquire_many(keys, ttl)
        .await
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect()
}

/// A master and a replica of it.
pub async fn master_and_replica() -> (RedisServer, RedisServer) {
    let master = harness::require(RedisServer::start().await);
    let replica = harness::require(
        RedisServer::builder()
            .replica_of(master.addr())
            .start()
            .await,
    );
    (master, replica)
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

/// Calls of `command` (lowercase) over every node of `cluster`.
pub async fn cluster_calls(cluster: &RedisCluster, command: &str) -> u64 {
    let mut total = 0;
    for node in cluster.nodes() {
        total += command_calls(node, command).await;
    }
    total
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
