//! The etcd [`Factory`] for the conformance suite and the fault tests: real etcd servers
//! from the harness, every client connected through a [`FaultProxy`] so the link can be cut.
//!
//! Servers are shared between the tests running at the same time (each suite case runs on
//! its own runtime, so sharing goes through a reference count, not a runtime): the first
//! test to need one starts it, and it is killed when the last test holding it ends. A
//! factory that injects server faults owns a private server instead.

#![allow(dead_code)]

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::WithFencedResource;
use conformance::{ClockFaults, Factory, LinkFaults, ServerFaults};
use distlock_core::{EnforcementMode, LockBackend, LockError};
use harness::etcd::{EtcdCluster, EtcdServer};
use harness::proxy::FaultProxy;
use harness::require;
use lock_etcd::EtcdBackend;
use suite_faults::ProxyGroup;
use tokio::sync::Mutex;
use tokio::time::{Instant, sleep};

/// Request timeout of the suite's clients: shorter than the 2 s TTL, so a cut link turns
/// into errors before a lease runs out.
pub const SUITE_REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);

static SINGLE: Mutex<Weak<EtcdServer>> = Mutex::const_new(Weak::new());
static CLUSTER: Mutex<Weak<EtcdCluster>> = Mutex::const_new(Weak::new());

/// The single-member server shared by the tests running now.
pub async fn shared_single() -> Arc<EtcdServer> {
    let mut slot = SINGLE.lock().await;
    if let Some(server) = slot.upgrade() {
        return server;
    }
    let server = Arc::new(require(EtcdServer::start().await));
    *slot = Arc::downgrade(&server);
    server
}

/// The 3-member cluster shared by the tests running now.
pub async fn shared_cluster() -> Arc<EtcdCluster> {
    let mut slot = CLUSTER.lock().await;
    if let Some(cluster) = slot.upgrade() {
        return cluster;
    }
    let cluster = Arc::new(require(EtcdCluster::start().await));
    *slot = Arc::downgrade(&cluster);
    cluster
}

/// Runs `call` until it gives something other than a retryable error, or panics at `deadline`.
pub async fn until_answered<T, F, Fut>(what: &str, deadline: Instant, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    loop {
        match call().await {
            Ok(v) => return v,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// What keeps the servers of a factory alive.
enum Servers {
    Single(Arc<EtcdServer>),
    Cluster(Arc<EtcdCluster>),
}

/// Clients on one etcd single node or cluster, through one proxy per member.
pub struct EtcdFactory {
    name: &'static str,
    servers: Servers,
    proxies: Arc<ProxyGroup>,
    request_timeout: Duration,
    private: bool,
    /// The wall clock this process, and so its clients, runs under, when a test steps it.
    clock: Option<Arc<harness::ShiftedClock>>,
}

impl EtcdFactory {
    /// On the shared single node.
    pub async fn single() -> Self {
        Self::on(Servers::Single(shared_single().await), "etcd").await
    }

    /// On the shared 3-member cluster.
    pub async fn cluster() -> Self {
        Self::on(Servers::Cluster(shared_cluster().await), "etcd-cluster").await
    }

    /// On a single node of its own, whose process the test may pause, kill and restart.
    pub async fn private_single() -> Self {
        let server = Arc::new(require(EtcdServer::start().await));
        Self::on(Servers::Single(server), "etcd (private)")
            .await
            .owned()
    }

    /// On a 3-member cluster of its own.
    pub async fn private_cluster() -> Self {
        let cluster = Arc::new(require(EtcdCluster::start().await));
        Self::on(Servers::Cluster(cluster), "etcd-cluster (private)")
            .await
            .owned()
    }

    async fn on(servers: Servers, name: &'static str) -> Self {
        let upstreams = match &servers {
            Servers::Single(s) => vec![s.addr()],
            Servers::Cluster(c) => c.members().iter().map(EtcdServer::addr).collect(),
        };
        let mut proxies = Vec::with_capacity(upstreams.len());
        for upstream in upstreams {
            proxies.push(require(FaultProxy::start(upstream).await));
        }
        Self {
            name,
            servers,
            proxies: Arc::new(ProxyGroup::new(proxies)),
            request_timeout: SUITE_REQUEST_TIMEOUT,
            private: false,
            clock: None,
        }
    }

    fn owned(mut self) -> Self {
        self.private = true;
        self
    }

    /// Steps `clock`, the wall clock of this process (run under it with
    /// [`harness::rerun_under`]), as the clients' clock: the one etcd's tokens may read.
    pub fn with_client_clock(mut self, clock: harness::ShiftedClock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Uses another request timeout for the clients made from now on.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The proxy endpoints the clients connect to.
    pub fn endpoints(&self) -> Vec<String> {
        self.proxies
            .iter()
            .map(|p| format!("http://{}", p.addr()))
            .collect()
    }

    /// The proxies, one per member, in member order.
    pub fn proxies(&self) -> &[FaultProxy] {
        &self.proxies
    }

    /// The single server, if this factory runs on one.
    pub fn single_server(&self) -> Option<&EtcdServer> {
        match &self.servers {
            Servers::Single(s) => Some(s),
            Servers::Cluster(_) => None,
        }
    }

    /// The cluster, if this factory runs on one.
    pub fn cluster_servers(&self) -> Option<&EtcdCluster> {
        match &self.servers {
            Servers::Single(_) => None,
            Servers::Cluster(c) => Some(c),
        }
    }

    /// A concrete client (for tests that need more than `dyn LockBackend`).
    pub async fn etcd(&self) -> EtcdBackend {
        match EtcdBackend::builder()
            .endpoints(self.endpoints())
            .key_prefix("distlock-test")
            .request_timeout(self.request_timeout)
            .connect_timeout(Duration::from_secs(2))
            .build()
            .await
        {
            Ok(backend) => backend,
            Err(e) => panic!(
                "cannot build an etcd backend on {:?}: {e}",
                self.endpoints()
            ),
        }
    }

    /// This factory, its fenced-counter workload writing through an enforcing
    /// [`lock_etcd::EtcdFencedResource`] on its servers.
    pub async fn with_fenced_resource(self) -> WithFencedResource<EtcdFactory> {
        let fenced =
            lock_etcd::EtcdFencedResource::new(&self.etcd().await, EnforcementMode::Enforce);
        WithFencedResource::new(self, fenced)
    }
}

#[async_trait]
impl Factory for EtcdFactory {
    fn name(&self) -> &str {
        self.name
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(self.etcd().await)
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(self.proxies.clone())
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        // What the clients read: this process's wall clock.
        let probe: suite_faults::ClockProbe =
            Box::new(|| Box::pin(async { std::time::SystemTime::now() }));
        Some(suite_faults::clock(self.clock.clone()?, vec![probe]))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        // Faults on a shared server would hit the other tests using it.
        match &self.servers {
            Servers::Single(s) if self.private => Some(suite_faults::server(s.clone())),
            Servers::Cluster(c) if self.private => Some(Arc::new(LeaderFaults {
                cluster: c.clone(),
                faulted: Mutex::new(None),
            })),
            _ => None,
        }
    }
}

/// Process faults on the leader of a private cluster: `pause` and `kill` hit the member
/// leading at that moment (the others elect a new leader), `resume` and `restart` bring
/// back the member last faulted.
pub struct LeaderFaults {
    cluster: Arc<EtcdCluster>,
    faulted: Mutex<Option<usize>>,
}

impl LeaderFaults {
    async fn leader(&self) -> &EtcdServer {
        let index = require(self.cluster.leader_index().await);
        *self.faulted.lock().await = Some(index);
        &self.cluster.members()[index]
    }

    async fn faulted(&self) -> &EtcdServer {
        let index = self
            .faulted
            .lock()
            .await
            .expect("a member paused or killed first");
        &self.cluster.members()[index]
    }
}

#[async_trait]
impl ServerFaults for LeaderFaults {
    async fn pause(&self) {
        require(self.leader().await.pause());
    }

    async fn resume(&self) {
        require(self.faulted().await.resume());
    }

    async fn kill(&self) {
        require(self.leader().await.kill());
    }

    async fn restart(&self) {
        require(self.faulted().await.restart().await);
    }
}
