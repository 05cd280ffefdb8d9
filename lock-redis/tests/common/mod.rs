//! Factories and helpers shared by the Redis tests: every test starts its own servers
//! through the test harness; nothing relies on a Redis that is already running.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults};
use distlock_core::{Lease, LockBackend, LockKey};
use harness::{
    ShiftedClock,
    proxy::FaultProxy,
    redis::{
        RedisCluster, RedisServer, RedisServerBuilder, RedisUser, RespValue, SentinelDeployment,
        sentinel,
    },
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
            .request_timeout(response_timeout)
            .build()
            .await
            .expect("connect to the test server")
    }

    /// `(command, calls)` from `INFO commandstats`, e.g. `("evalsha", 3)`.
    pub async fn calls(&self, command: &str) -> u64 {
        command_calls(&self.server, command).await
    }

    /// Asserts how many times the server ran each command of `expected` since its stats
    /// were last reset (`INFO commandstats`); `during` says what ran, for the message.
    pub async fn assert_calls(&self, expected: &[(&str, u64)], during: &str) {
        for &(command, calls) in expected {
            assert_eq!(self.calls(command).await, calls, "{command} {during}");
        }
    }

    /// A backend whose replies take 200 ms each way (a round trip takes 400 ms, its
    /// request timeout is 2 s), with [`lock_redis::SENT_AT_ONCE`] calls of its own, `call(i)`,
    /// on their way: a call of the same kind that comes now is queued.
    pub async fn calls_in_flight<T, F, Fut>(
        &self,
        call: F,
    ) -> (RedisBackend, Vec<tokio::task::JoinHandle<T>>)
    where
        F: Fn(RedisBackend, usize) -> Fut,
        Fut: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let redis = self.redis_with(Duration::from_secs(2)).await;
        self.proxy.delay(Duration::from_millis(200));
        let mut in_flight = Vec::new();
        for i in 0..lock_redis::SENT_AT_ONCE {
            in_flight.push(tokio::spawn(call(redis.clone(), i)));
            // Apart, so that each is sent on its own and they fill the calls in flight.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (redis, in_flight)
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
            .request_timeout(Duration::from_secs(1))
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

impl ReplicaPromotion {
    /// The master serving `key` and its replica, once the replica has every write the
    /// master acknowledged.
    async fn replicated(&self, key: &LockKey) -> (&RedisServer, &RedisServer) {
        let redis_key = self.keys.redis_key(key);
        let master = harness::require(self.cluster.node_for_key(redis_key.as_bytes()).await);
        let index = self
            .cluster
            .nodes()
            .iter()
            .position(|n| n.port() == master.port())
            .expect("the key's master is a node of the cluster");
        let (master, replica) = (&self.cluster.nodes()[index], &self.replicas[index]);
        replicated(master, replica).await;
        (master, replica)
    }
}

/// The first item of `ROLE` (`master`, `slave`), `None` while `server` does not answer.
async fn role(server: &RedisServer) -> Option<String> {
    match server.command(&["ROLE"]).await.ok()? {
        RespValue::Array(Some(items)) => items.into_iter().next().and_then(|i| i.as_text()),
        _ => None,
    }
}

/// Waits (at most 30 s) until `server`'s role is `expected`.
async fn wait_for_role(server: &RedisServer, expected: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while role(server).await.as_deref() != Some(expected) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {} was no {expected} within 30 s",
            server.port()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[async_trait]
impl Failover for ReplicaPromotion {
    async fn fail_over(&self, key: &LockKey) {
        // The replica has every write the master acknowledged before it dies.
        let (master, replica) = self.replicated(key).await;
        harness::require(master.kill());
        wait_for_role(replica, "master").await;
        harness::require(self.cluster.wait_healthy(Duration::from_secs(30)).await);
    }

    /// `CLUSTER FAILOVER` on the replica: the master stops taking writes, the replica
    /// catches up and takes its slots over, and the old master follows it.
    async fn switch_over(&self, key: &LockKey) {
        let (master, replica) = self.replicated(key).await;
        let ok = harness::require(replica.command(&["CLUSTER", "FAILOVER"]).await);
        assert_eq!(ok.as_text().as_deref(), Some("OK"), "{ok:?}");
        wait_for_role(replica, "master").await;
        wait_for_role(master, "slave").await;
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

/// Waits (at most 5 s) until `replica` has every write `master` took so far: the
/// replica's replication offset reaches the master's as read now. (`WAIT` on a connection
/// of its own does not: it waits for that connection's writes, and a fresh one has none,
/// so it answers at once with every replica connected.)
pub async fn replicated(master: &RedisServer, replica: &RedisServer) {
    let written = info_field(master, "replication", "master_repl_offset").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let has = info_field(replica, "replication", "slave_repl_offset").await;
        if has >= written {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica {} is at offset {has}, the master {} at {written}, after 5 s",
            replica.port(),
            master.port()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
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

/// A master, its replica and three Sentinels (quorum 2), as users deploy Redis in high
/// availability: clients connect with the deployment's `redis+sentinel://` URL and find
/// the master through the Sentinels. Each data node is behind a fault proxy (the link
/// faults: a partition of the data nodes) and under one wall clock the cases may step; the
/// server faults hit both data nodes at once (the whole store paused, killed, restarted),
/// and the fail-over and switchover hand the master over to the replica while leases are
/// live.
pub struct SentinelFactory {
    pub deployment: Arc<SentinelDeployment>,
    pub clock: Arc<ShiftedClock>,
}

/// How long the Sentinels may take to name a new master: noticing a dead one, the quorum
/// agreeing, and a leader promoting the replica, then one more election should the first
/// split its votes (a Sentinel waits twice the failover timeout to start again).
pub const SENTINEL_FAILOVER_BOUND: Duration = Duration::from_millis(
    sentinel::DOWN_AFTER.as_millis() as u64
        + 2 * sentinel::FAILOVER_TIMEOUT.as_millis() as u64
        + 2_000,
);

/// How long the Sentinels may take to demote a master that runs on after a switchover: a
/// Sentinel leaves a node that reports the wrong role alone for 8 s (four of its 2 s
/// publish periods, for newer configurations to arrive) and reads a replica's `INFO`
/// every 10 s; neither is configurable.
pub const DEMOTION_BOUND: Duration = Duration::from_secs(30);

impl SentinelFactory {
    pub async fn start() -> Self {
        let clock = harness::require(ShiftedClock::new());
        let deployment = harness::require(
            SentinelDeployment::builder()
                .nodes(RedisServer::builder().clock(&clock))
                .behind_proxies()
                .start()
                .await,
        );
        Self {
            deployment: Arc::new(deployment),
            clock: Arc::new(clock),
        }
    }

    pub async fn redis(&self) -> RedisBackend {
        lock_redis::RedisBackendBuilder::from_url(&self.deployment.url())
            .expect("a valid Sentinel URL")
            // As for the single node: the suite delays the link by a fifth of a 250 ms TTL
            // each way, and a script's first call also loads it.
            .request_timeout(Duration::from_secs(1))
            .build()
            .await
            .expect("connect through the Sentinels")
    }
}

#[async_trait]
impl Factory for SentinelFactory {
    fn name(&self) -> &str {
        "redis-sentinel"
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(self.redis().await)
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(DataNodes(self.deployment.clone())))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(Arc::new(DataNodes(self.deployment.clone())))
    }

    fn failover(&self) -> Option<Arc<dyn Failover>> {
        Some(Arc::new(DataNodes(self.deployment.clone())))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        let nodes = (0..self.deployment.nodes.len())
            .map(|i| {
                let deployment = self.deployment.clone();
                let probe: suite_faults::ClockProbe = Box::new(move || {
                    let deployment = deployment.clone();
                    Box::pin(async move { server_time(&deployment.nodes[i]).await })
                });
                probe
            })
            .collect();
        Some(suite_faults::clock(self.clock.clone(), nodes))
    }
}

/// Faults on the data nodes of a [`SentinelDeployment`] behind proxies; the Sentinels are
/// never faulted.
struct DataNodes(Arc<SentinelDeployment>);

impl DataNodes {
    /// The master the Sentinels name, as a node, once its replica has every write it
    /// took. Replication is asynchronous: a write the replica has not received when the
    /// master is handed over is lost (README, "Redis Sentinel"), and `replica_acks` would
    /// not keep it either for a renewal, which it does not wait for. These faults show
    /// the clients following the master, not that loss.
    async fn replicated_master(&self) -> (SocketAddr, &RedisServer) {
        let addr = harness::require(self.0.master_addr().await);
        let master = self.0.node(addr).expect("the Sentinels name a node");
        let replica = self
            .0
            .nodes
            .iter()
            .find(|n| n.port() != master.port())
            .expect("two data nodes");
        replicated(master, replica).await;
        (addr, master)
    }

    /// Waits until every Sentinel names a master other than `old`.
    async fn new_master(&self, old: SocketAddr) -> SocketAddr {
        harness::require(
            self.0
                .wait_for_new_master(old, SENTINEL_FAILOVER_BOUND)
                .await,
        )
    }
}

#[async_trait]
impl LinkFaults for DataNodes {
    async fn cut(&self) {
        self.0.proxies.iter().for_each(FaultProxy::blackhole);
    }
    async fn delay(&self, by: Duration) {
        self.0.proxies.iter().for_each(|p| p.delay(by));
    }
    async fn heal(&self) {
        self.0.proxies.iter().for_each(FaultProxy::heal);
    }
}

#[async_trait]
impl ServerFaults for DataNodes {
    async fn pause(&self) {
        self.0
            .nodes
            .iter()
            .for_each(|n| harness::require(n.pause()));
    }
    async fn resume(&self) {
        self.0
            .nodes
            .iter()
            .for_each(|n| harness::require(n.resume()));
    }
    async fn kill(&self) {
        self.0.nodes.iter().for_each(|n| harness::require(n.kill()));
    }
    /// Both nodes start again, empty (they keep no data), the master first and the
    /// replica syncing from it; the Sentinels, which could promote no replica meanwhile,
    /// see the master they name up again.
    async fn restart(&self) {
        for node in &self.0.nodes {
            harness::require(node.restart().await);
        }
        harness::require(self.0.wait_for_master_up(Duration::from_secs(30)).await);
    }
}

#[async_trait]
impl Failover for DataNodes {
    /// The master killed: the Sentinels notice, agree and promote the replica. The old
    /// master stays down.
    async fn fail_over(&self, _key: &LockKey) {
        let (addr, master) = self.replicated_master().await;
        harness::require(master.kill());
        self.new_master(addr).await;
    }

    /// `SENTINEL FAILOVER`: the replica is promoted, and the old master, which runs on,
    /// is made its replica by the Sentinels.
    async fn switch_over(&self, _key: &LockKey) {
        let (addr, old) = self.replicated_master().await;
        let ok = harness::require(
            self.0.sentinels[0]
                .command(&["SENTINEL", "FAILOVER", sentinel::MASTER_NAME])
                .await,
        );
        assert_eq!(ok.as_text().as_deref(), Some("OK"), "{ok:?}");
        let new = self.new_master(addr).await;
        let following = format!("master_port:{}\r\n", new.port());
        harness::require(
            harness::wait_until_ready(
                "the old master following the new one",
                DEMOTION_BOUND,
                Duration::from_millis(50),
                || async {
                    let info = old
                        .command(&["INFO", "replication"])
                        .await
                        .map_err(|e| e.to_string())?
                        .as_text()
                        .unwrap_or_default();
                    if info.contains("role:slave\r\n")
                        && info.contains(&following)
                        && info.contains("master_link_status:up\r\n")
                    {
                        Ok(())
                    } else {
                        Err(info)
                    }
                },
            )
            .await,
        );
    }
}
