//! What a case returns ([`Outcome`], [`Failure`]), what it needs beyond a store
//! ([`Need`]), the registry of every case ([`CASES`]), and [`Ctx`]: the per-run context a
//! case uses for unique keys, recorded clients, TTLs fitted to the backend ([`Timing`]),
//! and failure messages.

mod ctx;
#[doc(hidden)]
pub mod macro_support;
mod need;
mod outcome;
mod registry;
mod timing;

pub use ctx::Ctx;
pub use need::{Need, missing_needs};
pub use outcome::{Failure, Outcome};
pub use registry::{CASES, Case, CaseFuture, CaseReport, case, run_all};
pub use timing::{Timing, fit_ttl};
