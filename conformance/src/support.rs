//! What every case works with: what it returns ([`Outcome`], [`Failure`]), what it needs
//! beyond a store ([`Need`]), and [`Ctx`]: the per-run context a case uses for unique
//! keys, recorded clients, TTLs fitted to the backend ([`Timing`]), and failure messages.
//! The cases import these from here; users see them in [`crate::suite`].

mod ctx;
mod need;
mod outcome;
mod timing;

pub use ctx::Ctx;
pub use need::{Need, missing_needs};
pub use outcome::{Failure, Outcome};
pub use timing::{Timing, fit_ttl};
