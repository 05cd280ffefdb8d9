//! The conformance suite's faults ([`LinkFaults`], [`ServerFaults`], [`SessionFaults`],
//! [`ClockFaults`])
//! dealt through the test harness's proxies and servers, so every backend's test factory
//! hands out the same ones instead of a wrapper of its own. A crate of its own, so that the
//! harness depends on nothing of the workspace and the suite on nothing unpublished.
//!
//! Link faults act on a [`FaultProxy`] ([`link`]) or on one proxy per node, faulted together
//! ([`ProxyGroup`]); server faults act on a server's process group ([`server`], or every
//! node of a Redis Cluster: [`cluster`]); session faults end the sessions of the test role
//! on a PostgreSQL server ([`sessions`]). A fault that cannot be applied fails the test
//! (through [`harness::require`]): a fault that silently did nothing would let a case pass
//! having tested nothing.

use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use conformance::factory::{ClockFaults, LinkFaults, ServerFaults, SessionFaults};
use futures::future::BoxFuture;
use harness::postgres::{PostgresServer, USER};
use harness::proxy::FaultProxy;
use harness::{Server, ServerKind, require};

/// Link faults on the connections through `proxy`.
pub fn link(proxy: Arc<FaultProxy>) -> Arc<dyn LinkFaults> {
    Arc::new(Link(proxy))
}

/// Process faults on `server`: `SIGSTOP`, `SIGCONT`, `SIGKILL` to its process group, and
/// a start on the same port and data directory.
pub fn server<K: ServerKind>(server: Arc<Server<K>>) -> Arc<dyn ServerFaults> {
    Arc::new(Process(server))
}

/// Server faults on every node of a Redis Cluster at once: the whole store paused, killed
/// or restarted (each node keeps its `nodes.conf`, so the cluster forms again).
#[cfg(feature = "redis")]
pub fn cluster(cluster: Arc<harness::redis::RedisCluster>) -> Arc<dyn ServerFaults> {
    Arc::new(Cluster(cluster))
}

/// What a process under a [`harness::ShiftedClock`] reads as the wall clock: a server's
/// own answer (`TIME`, `clock_timestamp()`), or this process's clock.
pub type ClockProbe = Box<dyn Fn() -> BoxFuture<'static, SystemTime> + Send + Sync>;

/// Clock faults on the processes started under `clock` (servers, through their builders'
/// `clock`, or a client process run with [`harness::rerun_under`]). After each step every
/// probe must read the stepped clock, within [`CLOCK_SLACK`]: a shim that did not take
/// (a server started without it, a process that does not read the clock through libc)
/// fails the test instead of letting a case pass with nothing stepped.
pub fn clock(clock: Arc<harness::ShiftedClock>, probes: Vec<ClockProbe>) -> Arc<dyn ClockFaults> {
    assert!(
        !probes.is_empty(),
        "a stepped clock needs a process to check"
    );
    Arc::new(Clock { clock, probes })
}

/// How far a probe's reading may be from the stepped clock's: the time a probe's round
/// trip takes on a loaded machine, far below any step a case makes.
pub const CLOCK_SLACK: Duration = Duration::from_secs(5);

struct Clock {
    clock: Arc<harness::ShiftedClock>,
    probes: Vec<ClockProbe>,
}

#[async_trait]
impl ClockFaults for Clock {
    async fn step_back(&self, by: Duration) {
        require(self.clock.step_back(by));
        for probe in &self.probes {
            let read = probe().await;
            let expected = require(self.clock.now());
            let off = read
                .duration_since(expected)
                .unwrap_or_else(|e| e.duration());
            assert!(
                off < CLOCK_SLACK,
                "a process under the stepped clock reads {read:?}, {off:?} away from the \
                 clock's {expected:?}: the step did not reach it"
            );
        }
    }
}

/// Session faults on `server`: the sessions of the test role ended.
pub fn sessions(server: Arc<PostgresServer>) -> Arc<dyn SessionFaults> {
    Arc::new(Sessions(server))
}

struct Link(Arc<FaultProxy>);

#[async_trait]
impl LinkFaults for Link {
    async fn cut(&self) {
        self.0.blackhole();
    }
    async fn delay(&self, by: std::time::Duration) {
        self.0.delay(by);
    }
    async fn heal(&self) {
        self.0.heal();
    }
}

/// Proxies faulted together: one per node of a cluster, so a link fault hits every
/// client connection at once.
#[derive(Debug)]
pub struct ProxyGroup(Vec<FaultProxy>);

impl ProxyGroup {
    /// The group of `proxies`, in the order given.
    pub fn new(proxies: Vec<FaultProxy>) -> Self {
        Self(proxies)
    }
}

impl Deref for ProxyGroup {
    type Target = [FaultProxy];
    fn deref(&self) -> &[FaultProxy] {
        &self.0
    }
}

#[async_trait]
impl LinkFaults for ProxyGroup {
    async fn cut(&self) {
        self.0.iter().for_each(FaultProxy::blackhole);
    }
    async fn delay(&self, by: std::time::Duration) {
        self.0.iter().for_each(|p| p.delay(by));
    }
    async fn heal(&self) {
        self.0.iter().for_each(FaultProxy::heal);
    }
}

struct Process<K: ServerKind>(Arc<Server<K>>);

#[async_trait]
impl<K: ServerKind> ServerFaults for Process<K> {
    async fn pause(&self) {
        require(self.0.pause());
    }
    async fn resume(&self) {
        require(self.0.resume());
    }
    async fn kill(&self) {
        require(self.0.kill());
    }
    async fn restart(&self) {
        require(self.0.restart().await);
    }
}

#[cfg(feature = "redis")]
struct Cluster(Arc<harness::redis::RedisCluster>);

#[cfg(feature = "redis")]
#[async_trait]
impl ServerFaults for Cluster {
    async fn pause(&self) {
        self.0.nodes().iter().for_each(|n| require(n.pause()));
    }
    async fn resume(&self) {
        self.0.nodes().iter().for_each(|n| require(n.resume()));
    }
    async fn kill(&self) {
        self.0.nodes().iter().for_each(|n| require(n.kill()));
    }
    async fn restart(&self) {
        for node in self.0.nodes() {
            require(node.restart().await);
        }
        require(self.0.wait_healthy(Duration::from_secs(30)).await);
    }
}

struct Sessions(Arc<PostgresServer>);

#[async_trait]
impl SessionFaults for Sessions {
    async fn terminate(&self) {
        let ended = require(self.0.terminate_sessions(USER).await);
        // The factory's clients hold sessions, so ending none means the fault did nothing.
        assert!(ended > 0, "no session of the test role to end");
    }
}
