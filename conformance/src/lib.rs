//! The conformance suite every distlock backend runs.
//!
//! - [`cases`]: one `pub async fn` per case, each taking a [`Factory`] of clients on the
//!   store under test; [`CASES`] lists them all for runners such as `lockctl check`.
//! - [`conformance_tests!`]: stamps one test per case a backend can run, by the
//!   capabilities its invocation declares ([`Need`]), and a test that prints the count.
//! - [`history`]: the recorder every case writes its calls into, and the checker of the
//!   invariants I1–I6.
//! - [`memory`]: the factory over the in-memory reference backend; [`broken`]:
//!   deliberately wrong backends, one bug each, the suite must fail on.
//! - [`summary`]: the per-backend and per-variant lines a CI run prints at its end.
//!
//! The real servers the backends run it against (redis-server, etcd, PostgreSQL) and the
//! fault proxy live in the separate `harness` crate, a dev-dependency of the backends: this
//! crate needs no server and no client library.
//!
//! Cases use keys under a random per-run prefix (`conformance:<random>:<case>:...`), so
//! several cases may share a server and a live deployment is only touched under that
//! prefix; they release what they take. A case that needs more than a store (link or
//! server faults, inspection, distinct clients) is not stamped for a backend without it,
//! and never returns early: nothing passes without having run.

pub mod broken;
pub mod cases;
mod deaf;
pub mod factory;
pub mod history;
#[macro_use]
mod macros;
pub mod memory;
mod registry;
pub mod suite;
pub mod summary;
mod support;

pub use deaf::Deaf;
pub use factory::{ClockFaults, Factory, Failover, LinkFaults, ServerFaults, SessionFaults};
pub use registry::{CASES, Case, CaseReport, run_all};
pub use support::{Failure, Need, Outcome};
