//! `redis-server` for tests: a single node ([`RedisServer`]), optionally with a TLS port
//! ([`RedisServerBuilder::tls`]) or as a replica of another ([`RedisServerBuilder::replica_of`]),
//! or a 3-master Redis Cluster ([`RedisCluster`]), each node on a free 127.0.0.1 port with
//! its own temp dir, and Redis Sentinel ([`RedisSentinel`], [`SentinelDeployment`]).
//! Commands go through the `redis` crate ([`resp_command`]), one fresh RESP2 connection per
//! command, so a test sees exactly what a client sees.

mod builder;
mod cluster;
mod node;
mod resp;
pub mod sentinel;
mod user;

pub use builder::{AppendFsync, RedisServerBuilder, RedisTls};
pub use cluster::{RedisCluster, RedisClusterBuilder, key_slot};
pub use node::{Redis, RedisServer};
pub use resp::{COMMAND_TIMEOUT, RespValue, resp_command};
pub use sentinel::{RedisSentinel, SentinelDeployment, SentinelDeploymentBuilder};
pub use user::RedisUser;
