//! [`MemoryFactory`]: the suite's factory over the in-memory reference backend, with
//! link faults mapped onto the backend's fault knobs.
//!
//! Every [`Factory::backend`] call returns a new client of one shared store
//! ([`MemoryBackend::client`]): the clients see the same locks and fault knobs but are
//! separate backend instances, so a lease used with the wrong client is refused as
//! foreign, as with two connections to one server.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::memory::MemoryBackend;
use distlock_core::{Instrumented, LockBackend};

use crate::factory::{Factory, LinkFaults};

/// How the factory hands the backend to the cases.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layer {
    /// The `MemoryBackend` itself, as `Arc<dyn LockBackend>`.
    Direct,
    /// Behind `distlock_core::Instrumented`, i.e. through a second `Arc<dyn LockBackend>`.
    Instrumented,
}

/// A factory whose clients are separate instances sharing one in-memory store.
#[derive(Debug, Clone)]
pub struct MemoryFactory {
    backend: Arc<MemoryBackend>,
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

    /// The first client of the shared store, e.g. to turn its fault knobs.
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
        let direct: Arc<dyn LockBackend> = Arc::new(self.backend.client());
        match self.layer {
            Layer::Direct => direct,
            Layer::Instrumented => Arc::new(Instrumented::new(direct)),
        }
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(MemoryLink(self.backend.clone())))
    }
}

/// Link faults of a [`MemoryFactory`]: a cut makes every call hang without reaching the
/// store (a blackhole), a delay slows every call before it reaches the store.
#[derive(Debug)]
pub struct MemoryLink(Arc<MemoryBackend>);

#[async_trait]
impl LinkFaults for MemoryLink {
    async fn cut(&self) {
        self.0.faults().hang();
    }

    async fn delay(&self, by: Duration) {
        self.0.faults().delay(by);
    }

    async fn heal(&self) {
        self.0.faults().heal();
    }
}
