//! [`Ctx`]: the per-run context a case uses for unique keys, recorded clients, TTLs
//! fitted to the backend, checks and failure messages.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockError, LockKey, Locker, Semaphore};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::outcome::{Failure, Outcome};
use super::timing::Timing;
use crate::factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults, SessionFaults};
use crate::history::{
    CheckOptions, FencedCounter, History, Invariant, RecordingBackend, SemaphoreSpec, Violation,
    check, timeline,
};

/// The context of one case run: unique keys, recorded clients, checks and failures.
pub struct Ctx<'f> {
    case: &'static str,
    factory: &'f dyn Factory,
    prefix: String,
    history: Arc<History>,
    faults: bool,
    /// The expiry slack of the case's [`Timing`], once [`Ctx::timing`] was asked for it.
    expiry_slack: std::sync::OnceLock<Duration>,
    /// The semaphores made with [`Ctx::semaphore`], whose permits the checker counts (I6).
    semaphores: Mutex<Vec<SemaphoreSpec>>,
}

impl<'f> Ctx<'f> {
    /// A context for `case` on `factory`, with a fresh random key prefix.
    pub fn new(case: &'static str, factory: &'f dyn Factory) -> Self {
        Self {
            case,
            factory,
            prefix: format!("conformance:{:016x}:{case}", rand::random::<u64>()),
            history: Arc::new(History::new()),
            faults: false,
            expiry_slack: std::sync::OnceLock::new(),
            semaphores: Mutex::new(Vec::new()),
        }
    }

    /// The factory.
    pub fn factory(&self) -> &'f dyn Factory {
        self.factory
    }

    /// The history every client of this context records into.
    pub fn history(&self) -> &Arc<History> {
        &self.history
    }

    /// Marks the run as one with injected faults (see [`CheckOptions::faults`]).
    pub fn with_faults(&mut self) {
        self.faults = true;
    }

    /// A key unique to this run: `conformance:<random>:<case>:<name>`.
    pub fn key(&self, name: &str) -> Result<LockKey, Failure> {
        LockKey::new(format!("{}:{name}", self.prefix))
            .map_err(|e| self.fail(format!("a valid key for {name:?}"), e))
    }

    /// The semaphore `name` (a key of this run) of `permits` permits on `locker`, whose
    /// permits the history checker counts (I6).
    pub fn semaphore(
        &self,
        locker: &Locker,
        name: &str,
        permits: u32,
    ) -> Result<Semaphore, Failure> {
        let name = self.key(name)?;
        let semaphore = self.ok("Locker::semaphore", locker.semaphore(&name, permits))?;
        let spec = SemaphoreSpec { name, permits };
        let mut declared = self.semaphores.lock();
        if !declared.contains(&spec) {
            declared.push(spec);
        }
        Ok(semaphore)
    }

    /// A new client from the factory whose calls are recorded in the history.
    pub async fn client(&self) -> Arc<dyn LockBackend> {
        Arc::new(RecordingBackend::new(
            self.factory.backend().await,
            self.history.clone(),
        ))
    }

    /// A failure of this case. It also names the invariants the history recorded so far
    /// breaks, if any: the rule behind a wrong answer.
    pub fn fail(&self, expected: impl fmt::Display, got: impl fmt::Display) -> Failure {
        let violations = self.history.check(&self.check_options());
        let mut got = got.to_string();
        if !violations.is_empty() {
            got = format!("{got}\n  and the history shows:\n{}", listing(&violations));
        }
        self.failure(expected.to_string(), got, &violations)
    }

    fn failure(&self, expected: String, got: String, violations: &[Violation]) -> Failure {
        let mut invariants: Vec<Invariant> = violations.iter().map(|v| v.invariant).collect();
        invariants.sort_unstable();
        invariants.dedup();
        Failure {
            case: self.case,
            backend: self.factory.name().to_owned(),
            expected,
            got,
            invariants,
        }
    }

    fn check_options(&self) -> CheckOptions {
        CheckOptions {
            faults: self.faults,
            expiry_slack: self
                .expiry_slack
                .get()
                .copied()
                .unwrap_or(CheckOptions::default().expiry_slack),
            semaphores: self.semaphores.lock().clone(),
        }
    }

    /// The fenced counter of the read-modify-write workload, on the factory's own fenced
    /// resource if it has one, else in memory; its writes are recorded in the history.
    pub fn counter(&self) -> FencedCounter {
        match self.factory.fenced_resource() {
            Some(resource) => FencedCounter::on(resource, self.history.clone()),
            None => FencedCounter::new(self.history.clone()),
        }
    }

    /// The workload's fenced counter in memory, whatever the factory has: for a case that
    /// restarts the store, which may lose the values written to it.
    pub fn counter_in_memory(&self) -> FencedCounter {
        FencedCounter::new(self.history.clone())
    }

    /// The factory's link faults; the case must need [`Need::LinkFaults`](super::Need::LinkFaults).
    pub fn link(&self) -> Result<Arc<dyn LinkFaults>, Failure> {
        self.factory
            .link()
            .ok_or_else(|| self.fail("the factory to have link faults", "none"))
    }

    /// The factory's server faults; the case must need [`Need::ServerFaults`](super::Need::ServerFaults).
    pub fn server(&self) -> Result<Arc<dyn ServerFaults>, Failure> {
        self.factory
            .server()
            .ok_or_else(|| self.fail("the factory to have server faults", "none"))
    }

    /// The factory's session faults; the case must need [`Need::SessionKill`](super::Need::SessionKill).
    pub fn sessions(&self) -> Result<Arc<dyn SessionFaults>, Failure> {
        self.factory
            .sessions()
            .ok_or_else(|| self.fail("the factory to have session faults", "none"))
    }

    /// The factory's fail-over; the case must need [`Need::Failover`](super::Need::Failover).
    pub fn failover(&self) -> Result<Arc<dyn Failover>, Failure> {
        self.factory
            .failover()
            .ok_or_else(|| self.fail("the factory to fail over", "none"))
    }

    /// The factory's wall clock; the case must need [`Need::ClockStep`](super::Need::ClockStep).
    pub fn clock(&self) -> Result<Arc<dyn ClockFaults>, Failure> {
        self.factory
            .clock()
            .ok_or_else(|| self.fail("the factory to step a clock", "none"))
    }

    /// Fails with `expected` / `got()` unless `holds`.
    pub fn ensure<G: fmt::Display>(
        &self,
        holds: bool,
        expected: impl fmt::Display,
        got: impl FnOnce() -> G,
    ) -> Result<(), Failure> {
        if holds {
            Ok(())
        } else {
            Err(self.fail(expected, got()))
        }
    }

    /// The value of a call that must not fail.
    pub fn ok<T>(&self, what: &str, result: Result<T, LockError>) -> Result<T, Failure> {
        result.map_err(|e| self.fail(format!("{what} to succeed"), format!("error: {e}")))
    }

    /// Acquires `key` on `client`; it must be free.
    pub async fn take(
        &self,
        client: &Arc<dyn LockBackend>,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Lease, Failure> {
        let what = format!("acquire of the free key {key}");
        match self.ok(&what, client.acquire(key, ttl).await)? {
            Some(lease) => Ok(lease),
            None => Err(self.fail(
                format!("{what} to grant a lease"),
                "Ok(None): the key is held",
            )),
        }
    }

    /// Checks that `key` is held: an acquire by `client` returns `Ok(None)`.
    pub async fn expect_held(
        &self,
        client: &Arc<dyn LockBackend>,
        key: &LockKey,
        ttl: Duration,
        why: &str,
    ) -> Result<(), Failure> {
        let got = self.ok("acquire", client.acquire(key, ttl).await)?;
        if let Some(lease) = got {
            let _ = client.release(&lease).await;
            return Err(self.fail(
                format!("{key} still held ({why}), so acquire returns Ok(None)"),
                format!("a lease with token {}", lease.token()),
            ));
        }
        Ok(())
    }

    /// Polls until `client` acquires `key`, failing once an acquire sent at or after
    /// `deadline` is refused (a refusal sent before it and answered after it, on a loaded
    /// machine, does not show the key held past the deadline).
    pub async fn take_by(
        &self,
        client: &Arc<dyn LockBackend>,
        key: &LockKey,
        ttl: Duration,
        deadline: Instant,
        why: &str,
    ) -> Result<Lease, Failure> {
        let started = Instant::now();
        loop {
            let sent = Instant::now();
            if let Some(lease) = self.ok("acquire", client.acquire(key, ttl).await)? {
                return Ok(lease);
            }
            if sent >= deadline {
                return Err(self.fail(
                    format!("{key} to be free {why}"),
                    format!(
                        "still held when asked {:?} after the first try",
                        sent - started
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The timing for `client`'s capabilities.
    pub fn timing(&self, client: &Arc<dyn LockBackend>) -> Timing {
        let timing = Timing::for_capabilities(&client.capabilities());
        let _ = self.expiry_slack.set(timing.expiry_slack);
        timing
    }

    /// Checks the history against I1–I6.
    pub fn check_history(&self, timing: &Timing) -> Result<(), Failure> {
        let _ = self.expiry_slack.set(timing.expiry_slack);
        // One snapshot: the history printed is the one checked.
        let events = self.history.settled();
        let options = CheckOptions {
            expiry_slack: timing.expiry_slack,
            ..self.check_options()
        };
        let violations = check(&events, &options);
        if violations.is_empty() {
            return Ok(());
        }
        Err(self.failure(
            "a history that meets I1-I6".to_owned(),
            format!(
                "{} violation(s):\n{}\n  the history (µs from the first call):\n{}",
                violations.len(),
                listing(&violations),
                timeline(&events, HISTORY_SHOWN)
            ),
            &violations,
        ))
    }

    /// Checks the history and passes.
    pub fn pass(&self, timing: &Timing) -> Result<Outcome, Failure> {
        self.check_history(timing)?;
        Ok(Outcome::Passed)
    }
}

/// How many events a failed history check prints: every event of most cases.
const HISTORY_SHOWN: usize = 400;

/// The first few violations, one per line: they show the pattern, and a broken backend
/// can produce hundreds.
fn listing(violations: &[Violation]) -> String {
    const SHOWN: usize = 8;
    let mut listed: Vec<String> = violations
        .iter()
        .take(SHOWN)
        .map(|v| format!("    {v}"))
        .collect();
    if violations.len() > SHOWN {
        listed.push(format!("    ... and {} more", violations.len() - SHOWN));
    }
    listed.join("\n")
}
