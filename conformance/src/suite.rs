//! What a case returns ([`Outcome`], [`Failure`]), the registry of every case
//! ([`CASES`]), and [`Ctx`]: the per-run context a case uses for unique keys, recorded
//! clients, TTLs fitted to the backend, and failure messages.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use lock_api::{Capabilities, Lease, LockBackend, LockError, LockKey};
use tokio::time::Instant;

use crate::factory::{Factory, Failover, LinkFaults, ServerFaults, SessionFaults};
use crate::history::{
    CheckOptions, FencedCounter, History, Invariant, RecordingBackend, Violation,
};

/// How a case ended when it did not fail.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Every check held.
    Passed,
    /// Not run: the factory lacks something the case [needs](Case::needs). Only runners
    /// that take any factory ([`Case::run`], [`run_all`]) report this; the stamped tests
    /// of [`crate::conformance_tests`] are never stamped for such a case.
    Skipped {
        /// Which need is missing.
        reason: String,
    },
}

/// A failed case: which case, on which backend, what was expected, what happened.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Failure {
    /// The case's name.
    pub case: &'static str,
    /// The factory's name.
    pub backend: String,
    /// What the contract requires.
    pub expected: String,
    /// What the backend did.
    pub got: String,
    /// The invariants the case's history broke by the time it failed (empty when the
    /// history was clean): the rule behind the failure, whatever check caught it first.
    pub invariants: Vec<Invariant>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "conformance case `{}` failed on {}:\n  expected: {}\n  got: {}",
            self.case, self.backend, self.expected, self.got
        )
    }
}

impl std::error::Error for Failure {}

/// The future a case returns.
pub type CaseFuture<'a> = Pin<Box<dyn Future<Output = Result<Outcome, Failure>> + Send + 'a>>;

/// What a case needs from a factory beyond a store. A case runs only where the factory
/// has every need: [`Case::run`] checks before the case starts, and
/// [`crate::conformance_tests`] stamps a case only for a factory declared with its needs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Need {
    /// Link faults: [`Factory::link`] is `Some` (`link_faults` in the macro).
    LinkFaults,
    /// Server faults: [`Factory::server`] is `Some` (`server_faults`).
    ServerFaults,
    /// [`LockBackend::inspect`] works: [`Capabilities::inspect`] (`inspect`).
    Inspect,
    /// Every [`Factory::backend`] call returns a separate backend instance, so a lease of
    /// one is foreign to another (`distinct_clients`).
    DistinctClients,
    /// The backend announces releases to waiters: [`Capabilities::wakes_waiters`]
    /// (`wakes_waiters`).
    WakesWaiters,
    /// Session faults: [`Factory::sessions`] is `Some` (`session_kill`).
    SessionKill,
    /// Fail-over: [`Factory::failover`] is `Some` (`failover`).
    Failover,
}

impl Need {
    /// Every need, in the order the macro's flags list them.
    pub const ALL: [Need; 7] = [
        Need::LinkFaults,
        Need::ServerFaults,
        Need::Inspect,
        Need::DistinctClients,
        Need::WakesWaiters,
        Need::SessionKill,
        Need::Failover,
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

/// One registered case: its name, its needs, and a function that runs it.
#[derive(Clone, Copy)]
pub struct Case {
    /// The case's name (the name of its function in [`crate::cases`]).
    pub name: &'static str,
    /// What the case needs from the factory.
    pub needs: &'static [Need],
    /// Runs the case against a factory; [`Outcome::Skipped`] without running it when the
    /// factory lacks one of its needs.
    pub run: for<'a> fn(&'a dyn Factory) -> CaseFuture<'a>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

macro_rules! registry {
    ([] $($case:ident: [$($need:ident),*]),* $(,)?) => {
        /// One function per case with the [`Case::run`] signature.
        mod boxed {
            use super::{CaseFuture, Factory, Need, gated};
            $(
                pub(super) fn $case(factory: &dyn Factory) -> CaseFuture<'_> {
                    let needs: &'static [Need] = &[$(crate::__conformance_need!($need)),*];
                    Box::pin(gated(needs, factory, crate::cases::$case(factory)))
                }
            )*
        }

        /// Every case, in the order the suite runs them.
        pub const CASES: &[Case] = &[$(Case {
            name: stringify!($case),
            needs: &[$(crate::__conformance_need!($need)),*],
            run: boxed::$case,
        }),*];
    };
}

/// Runs `case` if `factory` has every need, else reports which it lacks.
async fn gated(
    needs: &[Need],
    factory: &dyn Factory,
    case: impl Future<Output = Result<Outcome, Failure>>,
) -> Result<Outcome, Failure> {
    let missing = missing_needs(needs, factory).await;
    if missing.is_empty() {
        return case.await;
    }
    let names: Vec<_> = missing.iter().map(|n| n.name()).collect();
    Ok(Outcome::Skipped {
        reason: format!("the factory lacks {}", names.join(", ")),
    })
}

crate::__conformance_cases!([registry]);

/// The case called `name`, if there is one.
pub fn case(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

/// The result of one case in [`run_all`].
#[derive(Debug)]
pub struct CaseReport {
    /// The case's name.
    pub name: &'static str,
    /// Its result.
    pub result: Result<Outcome, Failure>,
    /// How long it ran.
    pub took: Duration,
}

/// Runs every case whose name contains `filter` (all when empty), one after another.
///
/// Cases run one at a time because the link-fault cases cut every client of the
/// factory: a case running beside them would see faults it did not ask for.
pub async fn run_all(factory: &dyn Factory, filter: &str) -> Vec<CaseReport> {
    let mut reports = Vec::new();
    for case in CASES.iter().filter(|c| c.name.contains(filter)) {
        let started = Instant::now();
        let result = (case.run)(factory).await;
        reports.push(CaseReport {
            name: case.name,
            result,
            took: started.elapsed(),
        });
    }
    reports
}

/// Support for [`crate::conformance_tests`]; not a stable API.
#[doc(hidden)]
pub mod macro_support {
    use std::future::Future;

    use crate::factory::Factory;
    use crate::suite::{CASES, Need, Outcome, missing_needs};

    /// A multi-threaded runtime with two workers, like
    /// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]`.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start a tokio runtime: {e}"))
    }

    /// Runs the case `name` on a fresh runtime and panics with the failure message if it
    /// fails. A stamped case the factory cannot run fails too: the invocation declared a
    /// capability the factory does not have.
    pub fn run_case<F, Fut>(name: &str, make_factory: Fut)
    where
        F: Factory,
        Fut: Future<Output = F>,
    {
        let Some(case) = CASES.iter().find(|c| c.name == name) else {
            panic!("no conformance case is called `{name}`");
        };
        runtime().block_on(async {
            let factory = make_factory.await;
            match (case.run)(&factory).await {
                Ok(Outcome::Passed) => {}
                Ok(Outcome::Skipped { reason }) => panic!(
                    "conformance case `{name}` was stamped for {} but cannot run there ({reason}): \
                     the conformance_tests! invocation declares a capability the factory lacks",
                    factory.name()
                ),
                Err(failure) => panic!("{failure}"),
            }
        });
    }

    /// The stamped test `conformance_stamped_cases`: prints which cases the macro stamped
    /// for this factory and which it did not (and why), and fails unless the declared
    /// capabilities are exactly what the factory has and the stamped set is exactly the
    /// cases whose needs it meets.
    pub fn stamped_cases<F, Fut>(make_factory: Fut, declared: &[Need], stamped: &[(&str, bool)])
    where
        F: Factory,
        Fut: Future<Output = F>,
    {
        stamped_cases_needing(make_factory, declared, None, stamped);
    }

    /// [`stamped_cases`] for an invocation that stamps, with `only: Some(need)`, only the
    /// cases that need `need`.
    pub fn stamped_cases_needing<F, Fut>(
        make_factory: Fut,
        declared: &[Need],
        only: Option<Need>,
        stamped: &[(&str, bool)],
    ) where
        F: Factory,
        Fut: Future<Output = F>,
    {
        runtime().block_on(async {
            let factory = make_factory.await;
            let mut errors = Vec::new();
            let mut has = Vec::new();
            for need in Need::ALL {
                let met = need.met_by(&factory).await;
                if met {
                    has.push(need);
                }
                // With `only`, a capability none of the selected cases needs is not
                // declared: the invocation stamps nothing that depends on it.
                let relevant = only.is_none_or(|only| {
                    CASES
                        .iter()
                        .any(|c| c.needs.contains(&only) && c.needs.contains(&need))
                });
                match (met, declared.contains(&need)) {
                    (true, false) if relevant => errors.push(format!(
                        "the factory has `{need}` but the invocation does not declare it, so \
                         the cases that need it are not stamped"
                    )),
                    (false, true) => errors.push(format!(
                        "the invocation declares `{need}` but the factory does not have it"
                    )),
                    _ => {}
                }
            }
            let mut not_stamped = Vec::new();
            for case in CASES {
                if only.is_some_and(|need| !case.needs.contains(&need)) {
                    let is_stamped = stamped.iter().any(|(n, s)| *n == case.name && *s);
                    if is_stamped && errors.is_empty() {
                        errors.push(format!(
                            "`{}` is stamped although it does not need the only capability \
                             asked for",
                            case.name
                        ));
                    }
                    continue;
                }
                let is_stamped = stamped.iter().any(|(n, s)| *n == case.name && *s);
                let missing = missing_needs(case.needs, &factory).await;
                if !is_stamped {
                    let names: Vec<_> = case.needs.iter().map(|n| n.name()).collect();
                    not_stamped.push(format!("{} (needs {})", case.name, names.join(", ")));
                }
                if is_stamped != missing.is_empty() && errors.is_empty() {
                    errors.push(format!(
                        "`{}` is {}stamped although the factory {} its needs",
                        case.name,
                        if is_stamped { "" } else { "not " },
                        if missing.is_empty() {
                            "meets"
                        } else {
                            "lacks some of"
                        },
                    ));
                }
            }
            let count = stamped.iter().filter(|(_, s)| *s).count();
            let caps: Vec<_> = has.iter().map(|n| n.name()).collect();
            let considered = CASES
                .iter()
                .filter(|c| only.is_none_or(|need| c.needs.contains(&need)))
                .count();
            let mut summary = format!(
                "conformance on {}: {count} of {considered} cases{} stamped and run \
                 (capabilities: {}; fenced counter on {})",
                factory.name(),
                only.map(|need| format!(" needing {need}"))
                    .unwrap_or_default(),
                if caps.is_empty() {
                    "none".to_owned()
                } else {
                    caps.join(", ")
                },
                if factory.fenced_resource().is_some() {
                    "the backend's own fenced resource"
                } else {
                    "an in-memory fenced resource"
                },
            );
            for line in &not_stamped {
                summary.push_str(&format!("\n  not stamped: {line}"));
            }
            crate::summary::record("backends", &summary);
            assert_eq!(stamped.len(), CASES.len(), "every case is listed once");
            assert!(
                errors.is_empty(),
                "on {}: {}",
                factory.name(),
                errors.join("; ")
            );
        });
    }
}

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

/// TTLs and waits fitted to a backend's capabilities, so the same case runs on a store
/// with millisecond TTLs and on one with whole-second TTLs.
#[derive(Clone, Debug)]
pub struct Timing {
    /// The TTL the cases use: 500 ms, or the store's minimum rounded up to its granularity.
    pub ttl: Duration,
    /// How long after a TTL runs out the store may take to notice (expiry lag).
    pub expiry_slack: Duration,
}

impl Timing {
    /// The timing for a backend with `caps`.
    pub fn for_capabilities(caps: &Capabilities) -> Self {
        let ttl = fit_ttl(caps, Duration::from_millis(500));
        Self {
            ttl,
            // Stores expire leases on their own schedule (etcd checks every 500 ms):
            // half a TTL, at least 200 ms, past the deadline is still "on time".
            expiry_slack: (ttl / 2).max(Duration::from_millis(200)),
        }
    }

    /// The instant by which the store must have expired a lease whose last grant or
    /// renewal completed at `completed`.
    pub fn expired_by(&self, completed: Instant) -> Instant {
        completed + self.ttl + self.ttl / 50 + self.expiry_slack
    }
}

/// `want`, raised to the store's minimum, rounded up to its granularity, capped at its
/// maximum.
pub fn fit_ttl(caps: &Capabilities, want: Duration) -> Duration {
    let ttl = want.max(caps.min_ttl);
    let grain = caps.ttl_granularity.as_nanos();
    let ttl = if grain > 1 {
        let n = ttl.as_nanos().div_ceil(grain) * grain;
        Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
    } else {
        ttl
    };
    ttl.min(caps.max_ttl)
}

/// The context of one case run: unique keys, recorded clients, checks and failures.
pub struct Ctx<'f> {
    case: &'static str,
    factory: &'f dyn Factory,
    prefix: String,
    history: Arc<History>,
    faults: bool,
    /// The expiry slack of the case's [`Timing`], once [`Ctx::timing`] was asked for it.
    expiry_slack: std::sync::OnceLock<Duration>,
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

    /// The factory's link faults; the case must need [`Need::LinkFaults`].
    pub fn link(&self) -> Result<Arc<dyn LinkFaults>, Failure> {
        self.factory
            .link()
            .ok_or_else(|| self.fail("the factory to have link faults", "none"))
    }

    /// The factory's server faults; the case must need [`Need::ServerFaults`].
    pub fn server(&self) -> Result<Arc<dyn ServerFaults>, Failure> {
        self.factory
            .server()
            .ok_or_else(|| self.fail("the factory to have server faults", "none"))
    }

    /// The factory's session faults; the case must need [`Need::SessionKill`].
    pub fn sessions(&self) -> Result<Arc<dyn SessionFaults>, Failure> {
        self.factory
            .sessions()
            .ok_or_else(|| self.fail("the factory to have session faults", "none"))
    }

    /// The factory's fail-over; the case must need [`Need::Failover`].
    pub fn failover(&self) -> Result<Arc<dyn Failover>, Failure> {
        self.factory
            .failover()
            .ok_or_else(|| self.fail("the factory to fail over", "none"))
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

    /// Polls until `client` acquires `key`, failing at `deadline`.
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
            if let Some(lease) = self.ok("acquire", client.acquire(key, ttl).await)? {
                return Ok(lease);
            }
            if Instant::now() >= deadline {
                return Err(self.fail(
                    format!("{key} to be free {why}"),
                    format!("still held after {:?}", started.elapsed()),
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

    /// Checks the history against I1–I5.
    pub fn check_history(&self, timing: &Timing) -> Result<(), Failure> {
        let _ = self.expiry_slack.set(timing.expiry_slack);
        let violations = self.history.check(&CheckOptions {
            faults: self.faults,
            expiry_slack: timing.expiry_slack,
        });
        if violations.is_empty() {
            return Ok(());
        }
        Err(self.failure(
            "a history that meets I1-I5".to_owned(),
            format!(
                "{} violation(s):\n{}",
                violations.len(),
                listing(&violations)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_fit_the_store() {
        let ms = Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        assert_eq!(
            Timing::for_capabilities(&ms).ttl,
            Duration::from_millis(500)
        );
        let secs = Capabilities::new(
            Duration::from_secs(1),
            Duration::from_secs(2),
            Duration::from_secs(60),
        );
        assert_eq!(Timing::for_capabilities(&secs).ttl, Duration::from_secs(2));
        let coarse = Capabilities::new(
            Duration::from_millis(100),
            Duration::from_millis(1),
            Duration::from_secs(60),
        );
        assert_eq!(
            fit_ttl(&coarse, Duration::from_millis(201)),
            Duration::from_millis(300)
        );
    }

    #[test]
    fn every_case_is_registered_once() {
        assert!(CASES.len() >= 20, "only {} cases", CASES.len());
        let mut names: Vec<_> = CASES.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CASES.len());
        assert!(case("contention_loses_no_update").is_some());
    }
}
