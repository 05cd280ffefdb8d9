//! [`MemoryFactory`]: the suite's factory over the in-memory reference backend, with
//! link faults mapped onto a [`Faults`] layer around its clients.
//!
//! Every [`Factory::backend`] call returns a new client of one shared store
//! ([`MemoryBackend::client`]) behind the factory's one `Faults`: the clients see the same
//! locks and faults but are separate backend instances, so a lease used with the wrong
//! client is refused as foreign, as with two connections to one server.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{Instrumented, Layered, LockBackend};

use crate::factory::{Factory, LinkFaults};

/// How the factory hands the backend to the cases.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layer {
    /// A client of the store behind the factory's faults, as `Arc<dyn LockBackend>`.
    Direct,
    /// Behind `distlock_core::Instrumented`, i.e. through a second `Arc<dyn LockBackend>`.
    Instrumented,
}

/// A factory whose clients are separate instances sharing one in-memory store.
#[derive(Debug, Clone)]
pub struct MemoryFactory {
    backend: Arc<MemoryBackend>,
    faults: Arc<Faults>,
    layer: Layer,
}

impl Default for MemoryFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryFactory {
    /// Clients are the backend itself.
    pub fn new() -> Self {
        Self {
            backend: Arc::new(MemoryBackend::new()),
            faults: Arc::new(Faults::default()),
            layer: Layer::Direct,
        }
    }

    /// Clients reach the backend through `Instrumented`, one more `Arc<dyn LockBackend>`
    /// layer, as a [`distlock_core::Locker`] does.
    pub fn instrumented() -> Self {
        Self {
            layer: Layer::Instrumented,
            ..Self::new()
        }
    }

    /// The first client of the shared store.
    pub fn memory(&self) -> &Arc<MemoryBackend> {
        &self.backend
    }
}

#[async_trait]
impl Factory for MemoryFactory {
    fn name(&self) -> &str {
        match self.layer {
            Layer::Direct => "memory",
            Layer::Instrumented => "memory (instrumented, dyn)",
        }
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        let direct: Arc<dyn LockBackend> = Arc::new(Layered::new(
            Arc::new(self.backend.client()),
            self.faults.clone(),
        ));
        match self.layer {
            Layer::Direct => direct,
            Layer::Instrumented => Arc::new(Instrumented::new(direct)),
        }
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(MemoryLink(self.faults.clone())))
    }
}

/// Link faults of a [`MemoryFactory`]: a cut makes every call hang without reaching the
/// store (a blackhole), a delay slows every call before it reaches the store.
#[derive(Debug)]
pub struct MemoryLink(Arc<Faults>);

#[async_trait]
impl LinkFaults for MemoryLink {
    async fn cut(&self) {
        self.0.hang();
    }

    async fn delay(&self, by: Duration) {
        self.0.delay(by);
    }

    async fn heal(&self) {
        self.0.heal();
    }
}
