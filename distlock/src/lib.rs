//! distlock: distributed locks with fencing tokens for background-job workers.
//!
//! A worker takes a lock on a job before it runs it, so two workers do not run the same
//! job at once; every lock grant carries a **fencing token** that only ever grows, and
//! the store the job writes to rejects a write whose token is older than one it has
//! seen. The token is what keeps a worker that was paused or cut off past its lease
//! from doing damage: its lock may be gone without it knowing, its writes are refused.
//!
//! This facade re-exports the lock API of `distlock-core` (the [`LockBackend`] trait and its
//! contract, [`Locker`] and [`LockGuard`] with their renewal watchdog, the
//! [`FencedResource`] gate, [`Election`] for a fenced singleton role such as a scheduler,
//! the in-memory backend in [`memory`]) and opens any backend from a URL with
//! [`connect`]. Each store sits behind a cargo feature, and its crate is re-exported
//! under the feature's name for what a URL cannot say (builders with every setting, the
//! stores' fenced resources, PostgreSQL's SQL helpers):
//!
//! | feature | default | adds | URL forms for [`connect`] |
//! |---|---|---|---|
//! | (none) | always | [`memory`]: the in-process reference backend | `memory://` (a new store per call) |
//! | `redis` | yes | `distlock::redis` (`lock-redis`): Lua-script leases, one round trip per acquire, Redis Cluster, `RedisFencedResource` | `redis://[:password@]host[:port][/db]`, `rediss://…` (TLS), `redis+cluster://[:password@]host:port` (one seed node) |
//! | `etcd` | no | `distlock::etcd` (`lock-etcd`): etcd v3 leases and transactions, client-clock tokens that survive a snapshot restore, `EtcdFencedResource` | `etcd://[user:password@]host:port[,host:port…][?prefix=NAME]`, `etcds://host:port[,…]?ca=/path/ca.pem` (TLS) |
//! | `postgres` | no | `distlock::postgres` (`lock-postgres`): lease-table and advisory-lock backends, `PgFencedResource`, `IdempotencyKeys` | `postgres://user[:password]@host[:port]/db[?mode=lease\|advisory&schema=NAME&pool_size=N&pooling=session\|transaction]` (also `postgresql://`) |
//!
//! A URL whose feature is off fails with a [`LockError::Config`] that names the feature.
//! PostgreSQL needs its tables created once per database, never implicitly by
//! [`connect`]: call [`setup`] (or run `lockctl setup URL`) when deploying.
//! [`redact_url`] shows a URL without its password; no error of [`connect`] contains it.
//! [`connect_from_env`] opens the URL in `DISTLOCK_URL`; each store's builder reads its
//! own URL with `from_url`, or from the environment with `from_env`
//! (`DISTLOCK_REDIS_URL`, `DISTLOCK_ETCD_URL`, `DISTLOCK_POSTGRES_URL`).
//!
//! # Example
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
//! use std::time::Duration;
//! use distlock::{Admission, EnforcementMode, FencedResource, LockKey, Locker, MemoryFencedResource};
//!
//! // In production: distlock::connect("redis://10.0.0.5:6379").await?
//! let backend = distlock::connect("memory://").await?;
//! let locker = Locker::builder(backend).ttl(Duration::from_secs(5)).build()?;
//! let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
//!
//! let key = LockKey::new("payout:42")?;
//! let guard = locker.lock(&key).await?;
//! let first = guard.token();
//! // Every write downstream carries the guard's token; the store checks it.
//! assert_eq!(ledger.admit("payout:42", first).await?, Admission::Admitted);
//! guard.release().await?;
//!
//! // The next holder gets a higher token, and then a write with the old one is refused.
//! let next = locker.lock(&key).await?;
//! assert!(next.token() > first);
//! assert!(ledger.admit("payout:42", next.token()).await?.is_admitted());
//! assert!(matches!(ledger.admit("payout:42", first).await?, Admission::Stale { .. }));
//! next.release().await?;
//! # Ok(()) }
//! ```
//!
//! The `payout_worker` example (features `redis` and `postgres`) runs the whole pattern:
//! workers on Redis locks paying out jobs into a PostgreSQL ledger that checks the
//! fencing token and an idempotency key in the same transaction as the ledger insert.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod connect;

pub use connect::{SCHEMES, Scheme, URL_ENV, connect, connect_from_env, setup};
// The user's surface: taking, keeping and giving back locks; elections; fencing the
// downstream store; the in-memory store; the errors and the metric names.
pub use distlock_core::{
    Admission, Capabilities, ELECTION_PREFIX, Election, ElectionBuilder, EnforcementMode, Fence,
    FencedResource, FencingToken, Leader, Leadership, Lease, LeaseStatus, LockBackend, LockError,
    LockGuard, LockInfo, LockKey, Locker, LockerBuilder, MAX_KEY_BYTES, MemoryFencedResource,
    OwnerId, Release, Renewal, RetryPolicy, election_key, memory, redact_url, telemetry,
    url_userinfo_is_ambiguous,
};

/// What implementing a store, or a layer around one, needs beyond the user's surface:
/// building leases and their validity, the shared fencing decision, error conversion,
/// release notifications, and the forwarding layer.
pub mod backend {
    pub use distlock_core::wake;
    pub use distlock_core::{
        BackendId, BackendLayer, BoxError, DRIFT_FACTOR, DriverFailure, Effect, FailureKind,
        Instrumented, Layered, VALIDITY_MARGIN, async_trait, decide, url_from_env, valid_until,
    };
}
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use lock_etcd as etcd;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use lock_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use lock_redis as redis;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
