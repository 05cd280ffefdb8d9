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

use crate::factory::Factory;
use crate::history::{CheckOptions, History, RecordingBackend};

/// How a case ended when it did not fail.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Every check held.
    Passed,
    /// The backend does not declare the capability the case needs.
    Skipped {
        /// Which capability is missing.
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

/// One registered case: its name and a function that runs it.
#[derive(Clone, Copy)]
pub struct Case {
    /// The case's name (the name of its function in [`crate::cases`]).
    pub name: &'static str,
    /// Runs the case against a factory.
    pub run: for<'a> fn(&'a dyn Factory) -> CaseFuture<'a>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

macro_rules! registry {
    ([] $($case:ident),* $(,)?) => {
        /// One function per case with the [`Case::run`] signature.
        mod boxed {
            use super::{CaseFuture, Factory};
            $(
                pub(super) fn $case(factory: &dyn Factory) -> CaseFuture<'_> {
                    Box::pin(crate::cases::$case(factory))
                }
            )*
        }

        /// Every case, in the order the suite runs them.
        pub const CASES: &[Case] = &[$(Case { name: stringify!($case), run: boxed::$case }),*];
    };
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
    use crate::suite::CASES;

    /// Runs the case `name` on a fresh multi-threaded runtime (two workers, like
    /// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]`) and panics with
    /// the failure message if it fails.
    pub fn run_case<F, Fut>(name: &str, make_factory: Fut)
    where
        F: Factory,
        Fut: Future<Output = F>,
    {
        let Some(case) = CASES.iter().find(|c| c.name == name) else {
            panic!("no conformance case is called `{name}`");
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start a tokio runtime: {e}"));
        runtime.block_on(async {
            let factory = make_factory.await;
            match (case.run)(&factory).await {
                Ok(super::Outcome::Passed) => {}
                Ok(super::Outcome::Skipped { reason }) => {
                    println!(
                        "conformance case `{name}` skipped on {}: {reason}",
                        factory.name()
                    );
                }
                Err(failure) => panic!("{failure}"),
            }
        });
    }
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

    /// A failure of this case.
    pub fn fail(&self, expected: impl fmt::Display, got: impl fmt::Display) -> Failure {
        Failure {
            case: self.case,
            backend: self.factory.name().to_owned(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
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
        Timing::for_capabilities(&client.capabilities())
    }

    /// Checks the history against I1–I5.
    pub fn check_history(&self, timing: &Timing) -> Result<(), Failure> {
        let violations = self.history.check(&CheckOptions {
            faults: self.faults,
            expiry_slack: timing.expiry_slack,
        });
        if violations.is_empty() {
            return Ok(());
        }
        // The first few show the pattern; a broken backend can produce hundreds.
        const SHOWN: usize = 8;
        let mut listed: Vec<String> = violations
            .iter()
            .take(SHOWN)
            .map(|v| format!("    {v}"))
            .collect();
        if violations.len() > SHOWN {
            listed.push(format!("    ... and {} more", violations.len() - SHOWN));
        }
        Err(self.fail(
            "a history that meets I1-I5",
            format!("{} violation(s):\n{}", violations.len(), listed.join("\n")),
        ))
    }

    /// Checks the history and passes.
    pub fn pass(&self, timing: &Timing) -> Result<Outcome, Failure> {
        self.check_history(timing)?;
        Ok(Outcome::Passed)
    }
}

/// A skipped outcome.
pub fn skip(reason: impl Into<String>) -> Outcome {
    Outcome::Skipped {
        reason: reason.into(),
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
