//! Whether the suite catches a broken backend: [`run_each`] runs every case on it,
//! [`Caught`] says which cases failed and which invariants their failures name, and
//! [`Caught::lacks`] what of an expected catch is missing.
//!
//! `tests/broken.rs` checks this crate's [`BrokenKind`](super::BrokenKind) variants with
//! them; a backend outside the workspace checks a broken variant of its own the same way,
//! against the row of [`CAUGHT_BY`](super::CAUGHT_BY) for the same bug or against its own
//! list of cases:
//!
//! ```no_run
//! use conformance::broken::{BrokenFactory, BrokenKind, Caught, run_each};
//!
//! # async fn f() {
//! let kind = BrokenKind::ReleaseWithoutOwnerCheck;
//! let results = run_each(move || BrokenFactory::with_kind(kind)).await;
//! let caught = Caught::of(&results);
//! let row = kind.caught_by();
//! assert_eq!(caught.lacks(row.cases, row.invariants), Vec::<String>::new());
//! println!("{kind:?}: {caught}");
//! # }
//! ```

use std::collections::BTreeSet;
use std::fmt;

use futures::future::join_all;

use crate::factory::Factory;
use crate::history::Invariant;
use crate::registry::CASES;
use crate::support::{Failure, Outcome};

/// The name and result of every case in [`CASES`], each run on a fresh factory from
/// `make`, all at once: a case's link and server faults reach only its own factory's
/// store, and the longest case sets the time the whole run takes.
///
/// A case whose needs the factory lacks is [`Outcome::Skipped`] without running. Each
/// case runs in a task of its own on the current tokio runtime; a panicking case panics
/// here.
pub async fn run_each<F>(make: impl Fn() -> F) -> Vec<(&'static str, Result<Outcome, Failure>)>
where
    F: Factory + 'static,
{
    let runs = CASES.iter().map(|case| {
        let factory = make();
        tokio::spawn(async move { (case.name, (case.run)(&factory).await) })
    });
    join_all(runs)
        .await
        .into_iter()
        .map(|joined| joined.unwrap_or_else(|e| panic!("a case panicked: {e}")))
        .collect()
}

/// What caught a backend: the cases that failed on it and the invariants their failures
/// name. Displays as `N of M cases {..}; invariants {..}`.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Caught {
    /// The cases that ran, passed or failed (not the skipped ones).
    pub ran: usize,
    /// The cases that failed.
    pub cases: BTreeSet<&'static str>,
    /// The invariants the history checker reported in any failing case.
    pub invariants: BTreeSet<Invariant>,
}

impl Caught {
    /// What the results of [`run_each`] show.
    pub fn of(results: &[(&'static str, Result<Outcome, Failure>)]) -> Self {
        let mut caught = Self::default();
        for (name, result) in results {
            match result {
                Ok(Outcome::Passed) => caught.ran += 1,
                Ok(Outcome::Skipped { .. }) => {}
                Err(failure) => {
                    caught.ran += 1;
                    caught.cases.insert(name);
                    caught.invariants.extend(failure.invariants.iter().copied());
                }
            }
        }
        caught
    }

    /// What is missing for a catch that must fail `cases` and name `invariants`: one
    /// line per such case that passed (or did not run) and per invariant no failure
    /// names, and one if nothing failed at all. Empty when the backend was caught as
    /// required.
    pub fn lacks(&self, cases: &[&str], invariants: &[Invariant]) -> Vec<String> {
        let mut lacks = Vec::new();
        if self.cases.is_empty() {
            lacks.push(format!("passes every case of the {} that ran", self.ran));
        }
        for case in cases.iter().filter(|c| !self.cases.contains(*c)) {
            lacks.push(format!("is not caught by `{case}`"));
        }
        for invariant in invariants.iter().filter(|i| !self.invariants.contains(i)) {
            lacks.push(format!("no failure names {invariant}"));
        }
        lacks
    }
}

impl fmt::Display for Caught {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} cases {:?}; invariants {:?}",
            self.cases.len(),
            self.ran,
            self.cases,
            self.invariants
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(case: &'static str, invariants: Vec<Invariant>) -> Failure {
        Failure {
            case,
            backend: "test".into(),
            expected: "x".into(),
            got: "y".into(),
            invariants,
        }
    }

    #[test]
    fn counts_what_ran_and_names_what_is_missing() {
        let results = [
            ("a", Ok(Outcome::Passed)),
            (
                "b",
                Ok(Outcome::Skipped {
                    reason: "no".into(),
                }),
            ),
            ("c", Err(failure("c", vec![Invariant::I4]))),
        ];
        let caught = Caught::of(&results);
        assert_eq!(caught.ran, 2);
        assert_eq!(caught.to_string(), r#"1 of 2 cases {"c"}; invariants {I4}"#);
        assert!(caught.lacks(&["c"], &[Invariant::I4]).is_empty());
        assert_eq!(
            caught.lacks(&["a", "c"], &[Invariant::I1]),
            ["is not caught by `a`", "no failure names I1"]
        );
        assert_eq!(
            Caught::of(&results[..2]).lacks(&[], &[]),
            ["passes every case of the 1 that ran"]
        );
    }
}
