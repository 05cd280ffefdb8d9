//! Redis Sentinel for tests: `redis-sentinel` processes ([`RedisSentinel`]), each with its
//! own `sentinel.conf` on a free 127.0.0.1 port, and the deployment users run
//! ([`SentinelDeployment`]): a master, a replica and three Sentinels with quorum 2, with
//! short detection and failover times, optionally with a [`FaultProxy`] in front of each
//! data node ([`SentinelDeploymentBuilder::behind_proxies`]).

use std::net::SocketAddr;
use std::time::Duration;

use super::builder::RedisServerBuilder;
use super::node::RedisServer;
use super::resp::{COMMAND_TIMEOUT, RespValue, resp_command};
use crate::binary::find_binary;
use crate::error::HarnessError;
use crate::ports::{free_port, loopback, start_on_free_ports};
use crate::probe::wait_until_ready;
use crate::process::Spec;
use crate::proxy::FaultProxy;
use crate::server::{Server, ServerKind};
use crate::temp::temp_dir;

/// The name the Sentinels of a [`SentinelDeployment`] monitor its master by.
pub const MASTER_NAME: &str = "locks";
/// How long a master may be unreachable before a Sentinel thinks it down
/// (`down-after-milliseconds`).
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);
/// `failover-timeout`: how long a failover may take before another Sentinel may start one
/// (twice this), and how long replicas may take to follow the new master.
pub const FAILOVER_TIMEOUT: Duration = Duration::from_secs(3);
/// The Sentinels' quorum: how many must agree that the master is down.
pub const QUORUM: usize = 2;

/// A `redis-sentinel` process on 127.0.0.1 with its own temp dir; killed and removed on drop.
pub type RedisSentinel = Server<Sentinel>;

/// What a `redis-sentinel` adds to [`Server`]: its port.
#[derive(Debug)]
pub struct Sentinel {
    port: u16,
}

impl ServerKind for Sentinel {
    const READY_TIMEOUT: Duration = Duration::from_secs(15);
    const PROBE_INTERVAL: Duration = Duration::from_millis(20);

    fn client_port(&self) -> u16 {
        self.port
    }

    async fn probe(server: &RedisSentinel) -> Result<(), String> {
        let info = resp_command(server.addr(), None, &["INFO", "server"], COMMAND_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?
            .as_text()
            .unwrap_or_default();
        let ours = server.pid().map(|pid| format!("process_id:{pid}\r\n"));
        match ours {
            Some(ours) if info.contains(&ours) && info.contains("redis_mode:sentinel") => Ok(()),
            _ => Err(format!(
                "another process answers on {} (not our Sentinel)",
                server.addr()
            )),
        }
    }
}

impl RedisSentinel {
    /// Starts a Sentinel monitoring `master` as [`MASTER_NAME`] with [`QUORUM`],
    /// [`DOWN_AFTER`] and [`FAILOVER_TIMEOUT`].
    pub async fn start(master: SocketAddr) -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once(master)).await
    }

    async fn start_once(master: SocketAddr) -> Result<Self, HarnessError> {
        let program = find_binary("redis-sentinel", &[])?;
        let port = free_port()?;
        let dir = temp_dir("distlock-sentinel-")?;
        let name = MASTER_NAME;
        // Sentinel rewrites its configuration file, which must therefore be its own.
        let conf = dir.path().join("sentinel.conf");
        let text = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\nlogfile \"\"\ndir {dir}\n\
             sentinel monitor {name} {ip} {mport} {QUORUM}\n\
             sentinel down-after-milliseconds {name} {down}\n\
             sentinel failover-timeout {name} {failover}\n\
             sentinel parallel-syncs {name} 1\n",
            dir = dir.path().display(),
            ip = master.ip(),
            mport = master.port(),
            down = DOWN_AFTER.as_millis(),
            failover = FAILOVER_TIMEOUT.as_millis(),
        );
        std::fs::write(&conf, text)
            .map_err(|e| HarnessError::io(format!("writing {}", conf.display()), e))?;
        let spec = Spec {
            what: format!("redis-sentinel on 127.0.0.1:{port}"),
            program,
            args: vec![conf.into_os_string()],
            envs: Vec::new(),
            cwd: dir.path().to_path_buf(),
            user: None,
            log: dir.path().join("sentinel.log"),
        };
        let server = Server::spawn(spec, Sentinel { port }, dir)?;
        server.wait_ready().await?;
        Ok(server)
    }

    /// The port clients ask the Sentinel on.
    pub fn port(&self) -> u16 {
        self.kind().port
    }

    /// Sends one command, waiting at most [`COMMAND_TIMEOUT`].
    pub async fn command<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<RespValue, HarnessError> {
        resp_command(self.addr(), None, args, COMMAND_TIMEOUT).await
    }

    /// The master's address as this Sentinel knows it (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub async fn master_addr(&self) -> Result<SocketAddr, HarnessError> {
        let reply = self
            .command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME])
            .await?;
        texts(&reply)
            .join(":")
            .parse()
            .map_err(|_| HarnessError::io("reading the master's address", bad_reply(&reply)))
    }

    /// A field of `SENTINEL MASTER` (`num-other-sentinels`, `num-slaves`, `flags`...).
    pub async fn master_field(&self, field: &str) -> Result<String, HarnessError> {
        let reply = self.command(&["SENTINEL", "MASTER", MASTER_NAME]).await?;
        let fields = texts(&reply);
        fields
            .iter()
            .position(|f| f == field)
            .and_then(|i| fields.get(i + 1).cloned())
            .ok_or_else(|| HarnessError::io(format!("reading {field}"), bad_reply(&reply)))
    }
}

/// The text items of an array reply; none for any other reply.
fn texts(reply: &RespValue) -> Vec<String> {
    match reply {
        RespValue::Array(Some(items)) => items.iter().filter_map(RespValue::as_text).collect(),
        _ => Vec::new(),
    }
}

fn bad_reply(reply: &RespValue) -> std::io::Error {
    std::io::Error::other(format!("unexpected Sentinel reply {reply:?}"))
}

/// A master, its replica and three Sentinels monitoring the master as [`MASTER_NAME`] with
/// quorum 2, as users deploy them. [`start`](Self::start) returns once every Sentinel knows
/// the replica and the two other Sentinels, so a failover can run.
#[derive(Debug)]
pub struct SentinelDeployment {
    /// The two data nodes: the first starts as the master.
    pub nodes: [RedisServer; 2],
    /// The three Sentinels.
    pub sentinels: Vec<RedisSentinel>,
    /// With [`SentinelDeploymentBuilder::behind_proxies`], the proxy in front of each node,
    /// in the order of [`nodes`](Self::nodes); empty otherwise.
    pub proxies: Vec<FaultProxy>,
}

/// Options for a [`SentinelDeployment`]; see [`SentinelDeployment::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct SentinelDeploymentBuilder {
    nodes: RedisServerBuilder,
    proxies: bool,
}

impl SentinelDeploymentBuilder {
    /// Starts both data nodes from `builder` (its options: a clock, arguments...); the
    /// replica is also made a replica of the master. The default is
    /// [`RedisServer::builder`]'s.
    pub fn nodes(mut self, builder: RedisServerBuilder) -> Self {
        self.nodes = builder;
        self
    }

    /// Puts a [`FaultProxy`] in front of each data node, and everyone reaches the nodes
    /// only through them: the Sentinels monitor the master's proxy, each node announces
    /// its proxy's port when it is a replica (`replica-announce-port`, so the Sentinels
    /// know a promoted replica by its proxy), and the replica follows the master's proxy.
    /// The Sentinels therefore name proxies to clients, and a fault on the proxies cuts
    /// the nodes off from clients, Sentinels and each other alike, as a network partition
    /// of the data nodes does. The Sentinels themselves are reached directly.
    pub fn behind_proxies(mut self) -> Self {
        self.proxies = true;
        self
    }

    /// Starts the master, the replica, then the Sentinels, and waits until they know each
    /// other.
    pub async fn start(self) -> Result<SentinelDeployment, HarnessError> {
        let (nodes, proxies) = if self.proxies {
            // Each proxy's port goes on its node's command line (so a restarted node
            // announces it too); the proxy is pointed at the node once it listens.
            let unused = loopback(1);
            let proxies = [
                FaultProxy::start(unused).await?,
                FaultProxy::start(unused).await?,
            ];
            let announced = |proxy: &FaultProxy| {
                ["--replica-announce-ip".to_owned(), "127.0.0.1".to_owned()]
                    .into_iter()
                    .chain([
                        "--replica-announce-port".to_owned(),
                        proxy.port().to_string(),
                    ])
            };
            let master = self
                .nodes
                .clone()
                .args(announced(&proxies[0]))
                .start()
                .await?;
            proxies[0].retarget(master.addr());
            let replica = self
                .nodes
                .args(announced(&proxies[1]))
                .replica_of(proxies[0].addr())
                .start()
                .await?;
            proxies[1].retarget(replica.addr());
            ([master, replica], Vec::from(proxies))
        } else {
            let master = self.nodes.clone().start().await?;
            let replica = self.nodes.replica_of(master.addr()).start().await?;
            ([master, replica], Vec::new())
        };
        let monitored = proxies.first().map_or(nodes[0].addr(), FaultProxy::addr);
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(RedisSentinel::start(monitored).await?);
        }
        let deployment = SentinelDeployment {
            nodes,
            sentinels,
            proxies,
        };
        for sentinel in &deployment.sentinels {
            wait_until_ready(
                sentinel.what(),
                Duration::from_secs(30),
                Duration::from_millis(100),
                || async {
                    let others = sentinel.master_field("num-other-sentinels").await;
                    let replicas = sentinel.master_field("num-slaves").await;
                    match (others, replicas) {
                        (Ok(o), Ok(r)) if o == "2" && r == "1" => Ok(()),
                        (o, r) => Err(format!("other Sentinels {o:?}, replicas {r:?}")),
                    }
                },
            )
            .await?;
        }
        Ok(deployment)
    }
}

impl SentinelDeployment {
    /// Starts the master, the replica, then the Sentinels, and waits until they know each
    /// other.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::builder().start().await
    }

    /// Options for a deployment: the data nodes' settings, proxies in front of them.
    pub fn builder() -> SentinelDeploymentBuilder {
        SentinelDeploymentBuilder::default()
    }

    /// `redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/locks`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// The node at `addr`, its own or its proxy's.
    pub fn node(&self, addr: SocketAddr) -> Option<&RedisServer> {
        let index = match self.proxies.iter().position(|p| p.addr() == addr) {
            Some(proxied) => proxied,
            None => self.nodes.iter().position(|n| n.addr() == addr)?,
        };
        self.nodes.get(index)
    }

    /// The master's address, as the first Sentinel knows it.
    pub async fn master_addr(&self) -> Result<SocketAddr, HarnessError> {
        self.sentinels[0].master_addr().await
    }

    /// Waits (at most `limit`) until every Sentinel sees the master it names up (its flags
    /// are `master` alone: not down, no failover running).
    pub async fn wait_for_master_up(&self, limit: Duration) -> Result<(), HarnessError> {
        for sentinel in &self.sentinels {
            wait_until_ready(
                sentinel.what(),
                limit,
                Duration::from_millis(50),
                || async {
                    match sentinel.master_field("flags").await {
                        Ok(flags) if flags == "master" => Ok(()),
                        other => Err(format!("the master's flags: {other:?}")),
                    }
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Waits (at most `limit`) until every Sentinel names a master other than `old`, and
    /// returns it.
    pub async fn wait_for_new_master(
        &self,
        old: SocketAddr,
        limit: Duration,
    ) -> Result<SocketAddr, HarnessError> {
        wait_until_ready(
            "the Sentinels naming a new master",
            limit,
            Duration::from_millis(10),
            || async {
                let mut named = Vec::new();
                for sentinel in &self.sentinels {
                    named.push(sentinel.master_addr().await.map_err(|e| e.to_string())?);
                }
                match named.first() {
                    Some(&new) if new != old && named.iter().all(|&a| a == new) => Ok(new),
                    _ => Err(format!("the Sentinels name {named:?}")),
                }
            },
        )
        .await
    }
}
