//! The registry of every case ([`CASES`]), and running cases by name ([`case`]) or all
//! of them ([`run_all`]). It names every case of [`crate::cases`], which use the
//! suite's support (`support`), never the registry.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use crate::factory::Factory;
use crate::support::{Failure, Need, Outcome, missing_needs};

/// The future a case returns.
pub type CaseFuture<'a> = Pin<Box<dyn Future<Output = Result<Outcome, Failure>> + Send + 'a>>;

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
                    let needs: &'static [Need] = &[$(__conformance_need!($need)),*];
                    Box::pin(gated(needs, factory, crate::cases::$case(factory)))
                }
            )*
        }

        /// Every case, in the order the suite runs them.
        pub const CASES: &[Case] = &[$(Case {
            name: stringify!($case),
            needs: &[$(__conformance_need!($need)),*],
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
    let needed: Vec<_> = missing
        .iter()
        .map(|n| format!("{} ({})", n.what(), n.name()))
        .collect();
    Ok(Outcome::Skipped {
        reason: format!("not run here: it needs {}", needed.join(" and ")),
    })
}

__conformance_cases!([registry]);

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

#[cfg(test)]
mod tests {
    use super::*;

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
