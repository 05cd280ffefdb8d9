//! Real-server test harness: starts `redis-server`, `etcd` and PostgreSQL on free loopback
//! ports, each in its own temporary directory, and a TCP fault proxy, for the conformance
//! suite, the backend tests and the benchmarks.
//!
//! Nothing here relies on a service that is already running. Every server:
//!
//! * binds `127.0.0.1` only, on a port picked by [`free_port`] (or [`free_port_with_bus`]
//!   for Redis Cluster nodes, whose cluster bus listens on `port + 10000`);
//! * gets its own [`tempfile::TempDir`], removed when the server value is dropped;
//! * runs in its own process group, and `pause()` / `resume()` / `kill()` reach every process
//!   of the server's tree (PostgreSQL forks one backend per connection, each in its own
//!   session); `pause()` returns only once every thread of the tree is stopped;
//! * is checked to be *this* server when probed (Redis `process_id`, etcd peer URL,
//!   PostgreSQL socket in its own dir), and is started again on fresh ports when another
//!   process took its port first;
//! * is killed with `SIGKILL` and reaped when its value is dropped (also on a test panic,
//!   which unwinds). A test process that is itself `SIGKILL`ed leaves its servers running:
//!   there is no safe way to ask the kernel for a parent-death signal without `unsafe`.
//!
//! # Missing servers fail, they never skip
//!
//! When a server binary is missing, the start functions return
//! [`HarnessError::MissingBinary`], which names the Debian package to install. Tests call
//! [`require`] on the result, which panics with that message: the suite fails instead of
//! quietly skipping a backend.
//!
//! ```no_run
//! # async fn demo() {
//! use harness::postgres::PostgresServer;
//! let postgres = harness::require(PostgresServer::start().await);
//! println!("{}", postgres.url());
//! # }
//! ```
//!
//! Nothing in the harness panics except [`require`], which exists to turn an error into a
//! test failure; every other failure is a [`HarnessError`].
//!
//! Each server type is a [`Server`] of its kind (`PostgresServer = Server<Postgres>`), which
//! holds that lifecycle once: start, pid, pause, resume, kill, restart, stop on drop.
//!
//! # Clients
//!
//! The harness talks to its servers with real clients: the `redis` crate, `etcd-client`,
//! and PostgreSQL's own tools (`initdb`, `psql`). Each client library is behind a cargo
//! feature, so a crate compiles only what it uses:
//!
//! * `redis`: the module `redis` (single nodes, replicas, TLS, clusters);
//! * `etcd`: the module `etcd` (single members, 3-member clusters, TLS, auth); building
//!   `etcd-client` needs `protoc` (Debian package `protobuf-compiler`).
//!
//! [`postgres`], [`pgbouncer`] and [`proxy`] need no feature.
//!
//! # A wall clock tests can step
//!
//! [`ShiftedClock`] runs servers (the `clock` method of their builders) and client
//! processes ([`rerun_under`]) with their wall clock shifted or frozen, and steps it while
//! they run; monotonic clocks are untouched.

mod binary;
mod clock;
mod command;
mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod pgbouncer;
mod ports;
pub mod postgres;
mod probe;
mod process;
pub mod proxy;
#[cfg(feature = "redis")]
pub mod redis;
mod server;
mod temp;

pub use binary::{apt_package_for, binary_version, find_binary};
pub use clock::{ShiftedClock, rerun_under};
pub use error::{HarnessError, require};
pub use ports::{free_port, free_port_with_bus, loopback};
pub use probe::{Probe, ProbeOutcome, wait_until_ready};
pub use server::{Server, ServerKind};
