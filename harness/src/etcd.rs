//! `etcd` for tests: a single member ([`EtcdServer`]) or a 3-member cluster
//! ([`EtcdCluster`]) on free 127.0.0.1 ports, each member with its own temp data dir.
//! The harness asks a member with `etcd-client`, connected to that member alone: health and
//! the leader come from the maintenance `Status` call, readiness also checks the member
//! list, so no `etcdctl` is needed.
//!
//! [`EtcdServer::start_tls`] starts a single member whose client URL is `https://` with
//! certificates the test supplies ([`EtcdTls`]); the harness reaches it over TLS, trusting
//! the test's CA.
//!
//! [`EtcdServer::start_with_auth`] and [`EtcdCluster::start_with_auth`] start members with
//! authentication enabled ([`EtcdAuth`]): a `root` user and simple tokens with a short TTL.
//!
//! [`EtcdServer::start_with_space`] starts a single member with a space quota and periodic
//! automatic compaction ([`EtcdSpace`]), as operators run it.
//!
//! [`EtcdServer::save_snapshot`] and [`EtcdServer::restore_snapshot`] back a member up and
//! bring it back with `etcdctl`, as operators do.

mod cluster;
mod member;
mod options;
mod snapshot;

pub use cluster::EtcdCluster;
pub use member::{Etcd, EtcdServer};
pub use options::{EtcdAuth, EtcdSpace, EtcdTls};
