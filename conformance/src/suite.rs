//! The suite as its users reach it: what a case returns ([`Outcome`], [`Failure`]), what
//! it needs beyond a store ([`Need`]), the registry of every case ([`CASES`]), and
//! [`Ctx`]: the per-run context a case uses for unique keys, recorded clients, TTLs fitted
//! to the backend ([`Timing`]), and failure messages. The registry names the cases, which
//! use the rest, so each is defined where it stands (`registry`, `support`) and only
//! gathered here.

#[doc(hidden)]
pub mod macro_support;

pub use crate::registry::{CASES, Case, CaseFuture, CaseReport, case, run_all};
pub use crate::support::{Ctx, Failure, Need, Outcome, Timing, fit_ttl, missing_needs};
