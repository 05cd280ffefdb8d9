//! Redis backend for distlock.
//!
//! [`RedisBackend`] implements [`lock_api::LockBackend`] on one Redis node or a Redis
//! Cluster, with the `redis` crate (tokio, multiplexed connections):
//!
//! * **One round trip per operation.** Acquire, renew, release and fence are one Lua script
//!   each, run with `EVALSHA` (the script is loaded again when the server answers
//!   `NOSCRIPT`, for example after a restart or `SCRIPT FLUSH`).
//! * **Tokens that survive restarts.** Acquire sets the lock with `SET NX PX` and, only on
//!   success, issues `max(counter + 1, server time in µs)` as the token and stores it.
//! * **Batches.** `acquire_many`, `renew_many` and `release_many` send one pipeline per
//!   node, so a watchdog renews thousands of leases in one round trip.
//! * **Cluster.** A lock's two keys share a hash tag, hence a slot; redirects are followed.
//! * **Unknown outcomes.** A request without a reply within the response timeout fails with
//!   [`lock_api::LockError::OutcomeUnknown`]; an acquire then deletes, in the background and
//!   checked against its owner id, whatever it may have taken.
//!
//! [`RedisFencedResource`] gates downstream writes on tokens with one script.
//!
//! # Limits
//!
//! Redis replication is asynchronous: a failover can lose a lock that was granted (the
//! token still protects fenced writes, since the server clock keeps tokens increasing).
//! [`RedisBackendBuilder::replica_acks`] narrows that window with `WAIT`; it does not close it.
//! Passwords never appear in `Debug` output or errors.

mod backend;
mod config;
mod conn;
mod fenced;
mod keys;
mod scripts;

pub use backend::RedisBackend;
pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_TTL, DEFAULT_MIN_TTL, DEFAULT_PREFIX,
    DEFAULT_RESPONSE_TIMEOUT, RedisBackendBuilder,
};
pub use fenced::RedisFencedResource;
