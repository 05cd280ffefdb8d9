//! The load generator, the concurrency sweep and the capacity report of distlock: what
//! `lockctl bench` runs against deployments given by URL, and what the `benchmarks` crate
//! builds its criterion benches and capacity report on, beside the raw-client baselines
//! and peers it alone depends on.
//!
//! * [`subject`]: what is measured, behind one [`subject::Subject`] interface (one
//!   acquire + release cycle per call);
//! * [`handoff`]: one key, many waiters: release-to-grant time with and without the
//!   backend's release notifications;
//! * [`load`]: closed-loop load at a given concurrency, with latency histograms;
//! * [`plan`]: how much a run measures, full or quick;
//! * [`target`]: one target of the report, judged on a run;
//! * [`scenarios`]: the measurements of the capacity report (concurrency sweep, one
//!   contended key, batches, memory per held guard) and the targets they are judged by;
//! * [`waited`]: releases with a waiter on every key against releases nobody waits for,
//!   in alternating rounds;
//! * [`permits`]: semaphore permit cycles against lock cycles, in alternating rounds;
//! * [`full_semaphore`]: a full semaphore at N = 1, 64 and 1024, its waits and refusals
//!   against a lock's, in alternating rounds;
//! * [`report`]: the markdown report, the CSV and the SVG charts;
//! * [`cpu`]: CPU time of this process and of a server's processes;
//! * [`affinity`]: pinning a server and this process to CPUs of their own;
//! * [`placement`]: the Redis pairs with the server and the client sharing cores and
//!   pinned apart, with CPU per cycle;
//! * [`machine`]: the machine and server versions printed at the top of the report;
//! * [`deployment`]: the sweep against deployments given by URL (`lockctl bench`).
//!
//! Numbers are only compared within one run: the servers share the machine's cores with
//! the client, so absolute times move from run to run while ratios hold.

pub mod affinity;
mod cells;
pub mod cpu;
pub mod deployment;
mod error;
pub mod full_semaphore;
pub mod handoff;
pub mod load;
pub mod machine;
#[cfg(test)]
mod memory_subject;
pub mod permits;
pub mod placement;
pub mod plan;
pub mod report;
pub mod scenarios;
pub mod subject;
pub mod target;
pub mod waited;

pub use error::BenchError;
