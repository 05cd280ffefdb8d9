//! Redis backend for distlock.
//!
//! [`RedisBackend`] implements [`distlock_core::LockBackend`] on one Redis node or a Redis
//! Cluster, with the `redis` crate (tokio, multiplexed connections):
//!
//! * **One round trip per operation.** Acquire, renew, release and fence are one Lua script
//!   each, run with `EVALSHA` (the script is loaded again when the server answers
//!   `NOSCRIPT`, for example after a restart or `SCRIPT FLUSH`).
//! * **Tokens that never go back.** Acquire sets the lock with `SET NX PX` to
//!   `<owner id>:<token>`, the token being one more than the highest granted before (a
//!   high-water key per server, or per hash slot on a Cluster, that never expires), or
//!   the server's clock in µs when that is higher. Tokens keep increasing when the
//!   server's clock steps back, and across restarts (whatever persistence brings back),
//!   `FLUSHALL` and failovers, as long as the clock of the server that grants next has
//!   moved past the tokens the store lost.
//! * **Batches.** `acquire_many`, `renew_many` and `release_many` send one pipeline per
//!   node of multi-key script calls (one per hash slot in a cluster, at most 128 locks
//!   each), so a watchdog renews thousands of leases in one round trip and a few script
//!   calls. On a single node `acquire_many` sends each call as soon as it is built, so the
//!   server runs one while the client builds the next (new owner ids, arguments). In a
//!   cluster, the
//!   items of a node that does not answer (dead, or silent past the request timeout)
//!   while another node does are `None` / [`distlock_core::Renewal::Unreachable`] /
//!   [`distlock_core::Release::Unreachable`]; when no node answers, the call fails.
//! * **Coalescing.** A script call costs the server a few microseconds whatever it does,
//!   and under concurrency that cost, not the network, caps throughput; so on a single
//!   node, `acquire` and `release` calls that arrive together go together as one
//!   multi-key script call, and so do a semaphore's permit attempts (one call per
//!   semaphore, served in the order they came), each caller getting its own result,
//!   without a timer: a
//!   caller that finds no call of its kind in flight sends at once; one that finds some
//!   yields to the runtime once and takes along the calls that arrive meanwhile; while
//!   [`SENT_AT_ONCE`] calls of a kind are on their way, later ones wait and go together
//!   when one returns.
//! * **Cluster.** A lock's key has a hash tag, so batches group keys by slot; redirects
//!   are followed.
//!   The cluster client sends a request again after a connection error, so the scripts
//!   are safe to run twice (an acquire sent again with its owner id returns its token),
//!   except release, which goes over a second connection that never resends (a second
//!   run would say `NotHeld`): a lost reply is then an unknown outcome.
//! * **Unknown outcomes.** A request without a reply within the request timeout fails with
//!   [`distlock_core::LockError::OutcomeUnknown`]; an acquire then deletes, in the background and
//!   checked against its owner id, whatever it may have taken.
//! * **Connections made again.** On a single node, a reply that says the node is a replica
//!   now (`READONLY` after a switchover) and a request given up in silence (a connection
//!   that died without a reset) make the backend connect again, so an address that
//!   follows the master (a virtual IP, a DNS name, a proxy) leads the next calls to it;
//!   a call a replica refused is sent once more over the new connection. The release
//!   listener pings when it has heard nothing for a request timeout. Every connection
//!   has `TCP_NODELAY` and TCP keepalive.
//!
//! * **Tools.** `adopt` rebuilds a lease from an owner id and token (the scripts check
//!   both, so a wrong pair changes nothing); `purge` deletes a lock's key with one `DEL`.
//!
//! [`RedisFencedResource`] gates downstream writes on tokens with one script.
//!
//! # Limits
//!
//! Redis 5.0 or newer is needed (older servers refuse the acquire script's write after
//! `TIME`): [`RedisBackendBuilder::build`] checks the version of the node, or of every
//! master of a cluster, and fails with [`distlock_core::LockError::Config`] on an older one.
//!
//! Redis replication is asynchronous: a failover can lose a lock that was granted (the
//! token still protects fenced writes: the promoted replica's clock floors the tokens it
//! grants above those it missed).
//! [`RedisBackendBuilder::replica_acks`] narrows that window with `WAIT`; it does not close it.
//! Passwords never appear in `Debug` output or errors.
//!
//! # TLS
//!
//! `rediss://` URLs connect over TLS with rustls and its `ring` crypto provider, which
//! [`RedisBackendBuilder::build`] installs as rustls's process-wide default when the
//! application has not chosen one. A private CA is trusted with
//! [`RedisBackendBuilder::tls_ca_pem`]; see [`RedisBackendBuilder`] for `#insecure`.

mod backend;
mod coalesce;
mod config;
mod conn;
mod connect;
mod core;
mod error;
mod eviction;
mod fenced;
mod keys;
mod permits;
mod releases;
mod scripts;
mod tcp;
mod tls;
mod url;
mod version;

pub use self::core::ACKED_CONNECTIONS;
pub use self::url::DEFAULT_SENTINEL_PORT;
pub use backend::{RedisBackend, SENT_AT_ONCE};
pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX, DEFAULT_MAX_TTL, DEFAULT_MIN_TTL,
    DEFAULT_REQUEST_TIMEOUT, REDIS_URL_ENV, RedisBackendBuilder,
};
// The names before 0.1.0, kept for those who used them.
#[allow(deprecated)]
pub use config::{DEFAULT_PREFIX, DEFAULT_RESPONSE_TIMEOUT};
pub use connect::LONGEST_TTL;
pub use fenced::RedisFencedResource;

use distlock_core::LockError;

// The builder's last step stands here, above the builder (config.rs) and the backend
// (backend.rs): the backend is made from the builder's settings, so the builder's module
// does not name the backend.
impl RedisBackendBuilder {
    /// Validates the options and connects.
    ///
    /// Fails with [`LockError::Config`] for a malformed URL or one with a query parameter,
    /// a bad prefix or bad TTL bounds, or refused credentials, and with
    /// [`LockError::Unavailable`] when no server answers.
    ///
    /// It also reads each node's eviction policy (`INFO memory`; every master of a
    /// cluster) and fails with [`LockError::Config`] naming the node when Redis may evict
    /// keys: any `maxmemory-policy` but `noeviction` with a `maxmemory` limit set. An
    /// evicted lock key is a lock granted twice, with nothing to say so; set
    /// `maxmemory-policy noeviction`. Such a policy with no limit (`maxmemory 0`, which
    /// evicts nothing until a limit is set), and a policy the user may not read (no
    /// `+info`), are let through with a warning. The policy is read only here.
    pub async fn build(self) -> Result<RedisBackend, LockError> {
        self.validate()?;
        RedisBackend::connect(self).await
    }
}
