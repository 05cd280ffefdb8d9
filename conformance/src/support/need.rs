//! What a case needs from a factory beyond a store ([`Need`]), and how a factory is
//! checked for it.

use std::fmt;
use std::time::Duration;

use distlock_core::LockKey;

use super::timing::fit_ttl;
use crate::factory::Factory;

/// What a case needs from a factory beyond a store. A case runs only where the factory
/// has every need: [`Case::run`](crate::suite::Case::run) checks before the case starts, and
/// [`crate::conformance_tests`] stamps a case only for a factory declared with its needs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Need {
    /// Link faults: [`Factory::link`] is `Some` (`link_faults` in the macro).
    LinkFaults,
    /// Server faults: [`Factory::server`] is `Some` (`server_faults`).
    ServerFaults,
    /// [`LockBackend::inspect`] works: [`Capabilities::inspect`] (`inspect`).
    ///
    /// [`LockBackend::inspect`]: distlock_core::LockBackend::inspect
    /// [`Capabilities::inspect`]: distlock_core::Capabilities::inspect
    Inspect,
    /// Every [`Factory::backend`] call returns a separate backend instance, so a lease of
    /// one is foreign to another (`distinct_clients`).
    DistinctClients,
    /// The backend announces releases to waiters: [`Capabilities::wakes_waiters`]
    /// (`wakes_waiters`).
    ///
    /// [`Capabilities::wakes_waiters`]: distlock_core::Capabilities::wakes_waiters
    WakesWaiters,
    /// Session faults: [`Factory::sessions`] is `Some` (`session_kill`).
    SessionKill,
    /// Fail-over: [`Factory::failover`] is `Some` (`failover`).
    Failover,
    /// A wall clock to step back: [`Factory::clock`] is `Some` (`clock_step`).
    ClockStep,
}

impl Need {
    /// Every need, in the order the macro's flags list them.
    pub const ALL: [Need; 8] = [
        Need::LinkFaults,
        Need::ServerFaults,
        Need::Inspect,
        Need::DistinctClients,
        Need::WakesWaiters,
        Need::SessionKill,
        Need::Failover,
        Need::ClockStep,
    ];

    /// The name the macro declares it with.
    pub fn name(self) -> &'static str {
        match self {
            Need::LinkFaults => "link_faults",
            Need::ServerFaults => "server_faults",
            Need::Inspect => "inspect",
            Need::DistinctClients => "distinct_clients",
            Need::WakesWaiters => "wakes_waiters",
            Need::SessionKill => "session_kill",
            Need::Failover => "failover",
            Need::ClockStep => "clock_step",
        }
    }

    /// What it is, in words for someone who runs the suite against their store.
    pub fn what(self) -> &'static str {
        match self {
            Need::LinkFaults => "a proxy between client and store that can cut the link",
            Need::ServerFaults => "control of the store's server process (pause, kill, restart)",
            Need::Inspect => "a store that reports who holds a key",
            Need::DistinctClients => "clients that are separate instances",
            Need::WakesWaiters => "a store that announces releases to waiters",
            Need::SessionKill => "a way to end the store's client sessions",
            Need::Failover => "a replica to fail over and switch over to",
            Need::ClockStep => "a wall clock the store's tokens may read, stepped back under it",
        }
    }

    /// Whether `factory` has it. For [`Need::DistinctClients`] this takes a lease on a
    /// probe key (under a random `conformance:` prefix) from each of two clients and
    /// compares the instances that granted them; a store error counts as "no".
    pub async fn met_by(self, factory: &dyn Factory) -> bool {
        match self {
            Need::LinkFaults => factory.link().is_some(),
            Need::ServerFaults => factory.server().is_some(),
            Need::Inspect => factory.backend().await.capabilities().inspect,
            Need::DistinctClients => distinct_clients(factory).await,
            Need::WakesWaiters => factory.backend().await.capabilities().wakes_waiters,
            Need::SessionKill => factory.sessions().is_some(),
            Need::Failover => factory.failover().is_some(),
            Need::ClockStep => factory.clock().is_some(),
        }
    }
}

impl fmt::Display for Need {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether two clients of `factory` are separate instances: each takes a probe key and
/// the leases name the instances that granted them.
async fn distinct_clients(factory: &dyn Factory) -> bool {
    let (a, b) = (factory.backend().await, factory.backend().await);
    let prefix = format!("conformance:{:016x}:needs", rand::random::<u64>());
    let ttl = fit_ttl(&a.capabilities(), Duration::from_secs(5));
    let (Ok(key_a), Ok(key_b)) = (
        LockKey::new(format!("{prefix}:probe-a")),
        LockKey::new(format!("{prefix}:probe-b")),
    ) else {
        return false;
    };
    let Ok(Some(lease_a)) = a.acquire(&key_a, ttl).await else {
        return false;
    };
    let lease_b = b.acquire(&key_b, ttl).await;
    let _ = a.release(&lease_a).await;
    match lease_b {
        Ok(Some(lease_b)) => {
            let _ = b.release(&lease_b).await;
            lease_b.backend_id() != lease_a.backend_id()
        }
        _ => false,
    }
}

/// The needs in `needs` that `factory` lacks.
pub async fn missing_needs(needs: &[Need], factory: &dyn Factory) -> Vec<Need> {
    let mut missing = Vec::new();
    for need in needs {
        if !need.met_by(factory).await {
            missing.push(*need);
        }
    }
    missing
}
