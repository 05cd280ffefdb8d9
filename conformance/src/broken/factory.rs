//! [`BrokenFactory`]: separate [`BrokenBackend`] clients on one shared store, and the
//! fault controls the cases need (link, server, session and clock faults, failover).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{BackendId, LockBackend, LockKey};

use super::{BrokenBackend, BrokenKind, NAME, Store};
use crate::factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults, SessionFaults};

/// A factory whose clients are separate [`BrokenBackend`] instances on one shared store,
/// with link and server faults.
#[derive(Debug, Clone)]
pub struct BrokenFactory {
    kind: Option<BrokenKind>,
    store: Arc<Store>,
}

impl Default for BrokenFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl BrokenFactory {
    /// A factory with the [`BrokenKind::ReleaseWithoutOwnerCheck`] bug, for tests that
    /// need some broken backend.
    pub fn new() -> Self {
        Self::with_kind(BrokenKind::ReleaseWithoutOwnerCheck)
    }

    /// A factory over a fresh store with the bug `kind`.
    pub fn with_kind(kind: BrokenKind) -> Self {
        Self {
            kind: Some(kind),
            store: Arc::default(),
        }
    }

    /// A factory over a fresh store with no bug: the control that passes the suite.
    pub fn control() -> Self {
        Self {
            kind: None,
            store: Arc::default(),
        }
    }

    /// The bug its backends have, if any.
    pub fn kind(&self) -> Option<BrokenKind> {
        self.kind
    }
}

#[async_trait]
impl Factory for BrokenFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(BrokenBackend {
            id: BackendId::next(),
            kind: self.kind,
            store: self.store.clone(),
        })
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn server(&self) -> Option<Arc<dyn ServerFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn sessions(&self) -> Option<Arc<dyn SessionFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn failover(&self) -> Option<Arc<dyn Failover>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        Some(Arc::new(BrokenFaults(self.clone())))
    }
}

/// The fault controls of a [`BrokenFactory`]'s store.
#[derive(Debug)]
struct BrokenFaults(BrokenFactory);

#[async_trait]
impl LinkFaults for BrokenFaults {
    async fn cut(&self) {
        self.0.store.set(&self.0.store.cut, true);
    }

    async fn delay(&self, by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0.store.delay_micros.store(micros, Ordering::SeqCst);
    }

    async fn heal(&self) {
        self.0.store.delay_micros.store(0, Ordering::SeqCst);
        self.0.store.set(&self.0.store.cut, false);
    }
}

#[async_trait]
impl ServerFaults for BrokenFaults {
    async fn pause(&self) {
        self.0.store.set(&self.0.store.paused, true);
    }

    async fn resume(&self) {
        self.0.store.set(&self.0.store.paused, false);
    }

    async fn kill(&self) {
        self.0.store.set(&self.0.store.killed, true);
    }

    async fn restart(&self) {
        let store = &self.0.store;
        if self.0.kind == Some(BrokenKind::PermitHoldersForgottenAfterRestart) {
            // The bug: the leases were durable, who holds the permit slots was not.
            *store.forgotten.lock() = store.permits.lock().clone();
            store.set(&store.killed, false);
            return;
        }
        for state in store.keys.lock().values_mut() {
            state.holder = None;
            if self.0.kind == Some(BrokenKind::TokenDropsAfterRestart) {
                // The bug: the counters were not durable.
                state.last_token = 0;
            }
        }
        store.set(&store.killed, false);
    }
}

#[async_trait]
impl SessionFaults for BrokenFaults {
    /// Every holder's session ends: the locks go with them, the counters stay.
    async fn terminate(&self) {
        for state in self.0.store.keys.lock().values_mut() {
            state.holder = None;
        }
    }
}

#[async_trait]
impl ClockFaults for BrokenFaults {
    async fn step_back(&self, by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.0
            .store
            .clock_behind_micros
            .fetch_add(micros, Ordering::SeqCst);
    }
}

#[async_trait]
impl Failover for BrokenFaults {
    /// The store is one node whose replica has every write: a fail-over changes nothing
    /// the clients see.
    async fn fail_over(&self, _key: &LockKey) {}

    /// As [`Failover::fail_over`]: nothing the clients see changes.
    async fn switch_over(&self, _key: &LockKey) {}
}
