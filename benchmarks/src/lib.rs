//! Benchmarks and the capacity-planning report for distlock.
//!
//! Everything here measures real servers that the benchmarks start themselves from the
//! `harness` crate (`redis-server`, PostgreSQL, `etcd` on free loopback ports):
//!
//! * [`subjects`]: what is measured — each distlock backend, and beside it the raw-client
//!   baselines and the `rslock` peer it is compared with, behind one [`subjects::Subject`]
//!   interface (one acquire + release cycle per call);
//! * [`load`]: closed-loop load at a given concurrency, with latency histograms;
//! * [`plan`]: how much a run measures, full or quick;
//! * [`scenarios`]: the measurements of the capacity report (concurrency sweep, one
//!   contended key, batches, memory per held guard) and the targets they are judged by
//!   ([`target`]);
//! * [`report`]: the markdown report, the CSV and the SVG charts;
//! * [`placed`]: the Redis pairs with redis-server and the client sharing cores and
//!   pinned apart;
//! * [`machine`]: the machine and server versions printed at the top of the report;
//! * [`deployment`]: the sweep against deployments given by URL (`lockctl bench`).
//!
//! The criterion benches in `benches/` and the `capacity` binary are built on these.
//! Numbers are only compared within one run: the servers share the machine's cores with
//! the client, so absolute times move from run to run while ratios hold.

pub mod placed;
pub mod server_cost;
pub mod subjects;

pub use capacity::{BenchError, deployment, load, machine, plan, report, scenarios, target};
