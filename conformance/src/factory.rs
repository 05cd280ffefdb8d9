//! What a backend gives the suite: a [`Factory`] of fresh clients on one store, and,
//! where the store supports them, fault controls for the link and the server.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{FencedResource, LockBackend, LockKey};

/// Makes backend instances (clients) that all talk to the same store under test.
///
/// Cases call [`Factory::backend`] more than once when they need independent clients
/// (two workers). Keys are unique per case run, so a factory may share one server
/// between concurrent tests.
#[async_trait]
pub trait Factory: Send + Sync {
    /// A short name for messages (`"memory"`, `"redis"`, `"redis-cluster"`, ...).
    fn name(&self) -> &str;

    /// A new client on the store under test.
    async fn backend(&self) -> Arc<dyn LockBackend>;

    /// Faults on the link between the clients this factory makes and the store, if the
    /// factory can inject them (a proxy, or the memory backend's knobs).
    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        None
    }

    /// Faults on the store's server process, if the factory started it.
    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        None
    }

    /// Faults on the store's client sessions, if the factory can end them from the
    /// server side.
    fn sessions(&self) -> Option<Arc<dyn SessionFaults>> {
        None
    }

    /// Fail-over and switchover of the store's nodes to their replicas, if the factory's
    /// store has replicas it promotes (a Redis Cluster with a replica per master, a Redis
    /// master with a replica and Sentinels).
    fn failover(&self) -> Option<Arc<dyn Failover>> {
        None
    }

    /// The backend's own fenced resource (in enforce mode), if the factory has one: the
    /// fenced-counter workload then writes through it instead of an in-memory one.
    fn fenced_resource(&self) -> Option<Arc<dyn FencedResource>> {
        None
    }

    /// The wall clock the store's tokens may be read from, if the factory can step it
    /// under the running store: the server's (Redis, PostgreSQL) or the clients' (etcd).
    /// A store whose tokens never read a clock has none to step.
    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        None
    }
}

/// A factory that adds a backend's own fenced resource to another factory.
///
/// ```no_run
/// # async fn f(redis: impl conformance::Factory, resource: distlock_core::MemoryFencedResource) {
/// let factory = conformance::factory::WithFencedResource::new(redis, resource);
/// # }
/// ```
pub struct WithFencedResource<F> {
    inner: F,
    resource: Arc<dyn FencedResource>,
}

impl<F: Factory> WithFencedResource<F> {
    /// `inner`, whose fenced-counter workload writes through `resource`.
    pub fn new(inner: F, resource: impl FencedResource + 'static) -> Self {
        Self {
            inner,
            resource: Arc::new(resource),
        }
    }
}

#[async_trait]
impl<F: Factory> Factory for WithFencedResource<F> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.inner.backend().await
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        self.inner.link()
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        self.inner.server()
    }

    fn sessions(&self) -> Option<Arc<dyn SessionFaults>> {
        self.inner.sessions()
    }

    fn failover(&self) -> Option<Arc<dyn Failover>> {
        self.inner.failover()
    }

    fn fenced_resource(&self) -> Option<Arc<dyn FencedResource>> {
        Some(self.resource.clone())
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        self.inner.clock()
    }
}

/// Faults between the clients and the store. Every fault lasts until [`LinkFaults::heal`].
#[async_trait]
pub trait LinkFaults: Send + Sync {
    /// No request reaches the store and no reply comes back (a blackhole: calls hang or
    /// time out in the client).
    async fn cut(&self);
    /// Every request and reply is delayed by `by`.
    async fn delay(&self, by: Duration);
    /// Back to normal.
    async fn heal(&self);
}

/// Faults on the store's server.
#[async_trait]
pub trait ServerFaults: Send + Sync {
    /// Freezes the server (SIGSTOP).
    async fn pause(&self);
    /// Thaws a paused server (SIGCONT).
    async fn resume(&self);
    /// Kills the server (SIGKILL) without restarting it.
    async fn kill(&self);
    /// Starts a killed server again on the same address and data directory.
    async fn restart(&self);
}

/// Faults on the sessions the store keeps for its clients.
#[async_trait]
pub trait SessionFaults: Send + Sync {
    /// Ends every session of the factory's clients from the server side (PostgreSQL's
    /// `pg_terminate_backend`), as an administrator or a crashed backend would; the
    /// server keeps running.
    async fn terminate(&self);
}

/// A wall clock stepped under a running store, as NTP stepping a large offset, chrony's
/// `makestep`, a resumed VM or a repeated leap second do.
#[async_trait]
pub trait ClockFaults: Send + Sync {
    /// Steps the wall clock back by `by` (steps add up) while the store keeps running;
    /// monotonic clocks are untouched. Returns once every process the clock is for reads
    /// the stepped time.
    async fn step_back(&self, by: Duration);
}

/// Fail-over of the store's nodes.
#[async_trait]
pub trait Failover: Send + Sync {
    /// Kills the node that serves `key` and returns once the store has promoted its
    /// replica and serves `key` again: the map of which node serves what changes under the
    /// clients' live leases.
    async fn fail_over(&self, key: &LockKey);

    /// Hands the node that serves `key` over to its replica while it keeps running (a
    /// switchover, as for maintenance: Sentinel's `SENTINEL FAILOVER`, a Cluster replica's
    /// `CLUSTER FAILOVER`), and returns once the replica serves `key` and the old node
    /// follows it as a replica: clients still connected to the old node reach a node that
    /// is up and no longer takes writes.
    async fn switch_over(&self, key: &LockKey);
}
