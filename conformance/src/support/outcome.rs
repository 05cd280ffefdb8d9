//! What a case returns when it did not fail ([`Outcome`]) and when it did ([`Failure`]).

use std::fmt;

use crate::history::Invariant;

/// How a case ended when it did not fail.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Every check held.
    Passed,
    /// Not run: the factory lacks something the case [needs](crate::suite::Case::needs). Only runners
    /// that take any factory ([`Case::run`](crate::suite::Case::run), [`run_all`](crate::suite::run_all)) report this; the stamped tests
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
