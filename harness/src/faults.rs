//! The suite's fault traits for the harness's proxy and servers, so every backend's test
//! factory hands out the same implementations instead of a wrapper of its own.
//!
//! Link faults act on a [`FaultProxy`] (or a [`ProxyGroup`], one proxy per node, faulted
//! together); server faults act on a server's process group; session faults end the
//! sessions of the test role on a PostgreSQL server. A fault that cannot be applied fails
//! the test (through [`crate::require`]): a fault that silently did nothing would let a
//! case pass having tested nothing.

use std::ops::Deref;
use std::time::Duration;

use async_trait::async_trait;
use conformance::factory::{LinkFaults, ServerFaults, SessionFaults};

use crate::postgres::{PostgresServer, USER};
use crate::proxy::FaultProxy;
use crate::{Server, ServerKind, require};

#[async_trait]
impl LinkFaults for FaultProxy {
    async fn cut(&self) {
        self.blackhole();
    }
    async fn delay(&self, by: Duration) {
        FaultProxy::delay(self, by);
    }
    async fn heal(&self) {
        FaultProxy::heal(self);
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
    async fn delay(&self, by: Duration) {
        self.0.iter().for_each(|p| p.delay(by));
    }
    async fn heal(&self) {
        self.0.iter().for_each(FaultProxy::heal);
    }
}

/// Process faults on a server: `SIGSTOP`, `SIGCONT`, `SIGKILL` to its process group, and
/// a start on the same port and data directory.
#[async_trait]
impl<K: ServerKind> ServerFaults for Server<K> {
    async fn pause(&self) {
        require(Server::pause(self));
    }
    async fn resume(&self) {
        require(Server::resume(self));
    }
    async fn kill(&self) {
        require(Server::kill(self));
    }
    async fn restart(&self) {
        require(Server::restart(self).await);
    }
}

/// Server faults on every node of a Redis Cluster at once: the whole store paused, killed
/// or restarted (each node keeps its `nodes.conf`, so the cluster forms again).
#[cfg(feature = "redis")]
#[async_trait]
impl ServerFaults for crate::redis::RedisCluster {
    async fn pause(&self) {
        self.nodes().iter().for_each(|n| require(n.pause()));
    }
    async fn resume(&self) {
        self.nodes().iter().for_each(|n| require(n.resume()));
    }
    async fn kill(&self) {
        self.nodes().iter().for_each(|n| require(n.kill()));
    }
    async fn restart(&self) {
        for node in self.nodes() {
            require(node.restart().await);
        }
        require(self.wait_healthy(Duration::from_secs(30)).await);
    }
}

#[async_trait]
impl SessionFaults for PostgresServer {
    async fn terminate(&self) {
        let ended = require(self.terminate_sessions(USER).await);
        // The factory's clients hold sessions, so ending none means the fault did nothing.
        assert!(ended > 0, "no session of the test role to end");
    }
}
