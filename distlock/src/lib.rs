//! distlock: distributed locks with fencing tokens for background-job workers.
//!
//! A worker takes a lock on a job before it runs it, so two workers do not run the same
//! job at once; every lock grant carries a **fencing token** that only ever grows, and
//! the store the job writes to rejects a write whose token is older than one it has
//! seen. The token is what keeps a worker that was paused or cut off past its lease
//! from doing damage: its lock may be gone without it knowing, its writes are refused.
//!
//! This facade re-exports the lock API of `distlock-core` (the [`LockBackend`] trait and its
//! contract, [`Locker`] and [`LockGuard`] with their renewal watchdog, [`Semaphore`] for
//! at most N holders at once, the [`FencedResource`] gate, [`Election`] for a fenced
//! singleton role such as a scheduler, the in-memory backend in [`memory`]) and opens any
//! backend from a URL with [`connect`]. Each store sits behind a cargo feature, and its
//! crate is re-exported under the feature's name for what a URL cannot say (builders with
//! every setting, the stores' fenced resources, PostgreSQL's SQL helpers):
//!
//! | feature | default | adds | URL forms for [`connect`] |
//! |---|---|---|---|
//! | (none) | always | [`memory`]: the in-process reference backend | `memory://` (a new store per call) |
//! | `redis` | yes | `distlock::redis` (`lock-redis`): Lua-script leases, one round trip per acquire, Redis Cluster, `RedisFencedResource` | `redis://[:password@]host[:port][/db]`, `rediss://…` (TLS), `redis+cluster://[:password@]host:port` (one seed node) |
//! | `etcd` | no | `distlock::etcd` (`lock-etcd`): etcd v3 leases and transactions, client-clock tokens that survive a snapshot restore, `EtcdFencedResource` | `etcd://[user:password@]host:port[,host:port…][?key_prefix=NAME]`, `etcds://host:port[,…]?ca=/path/ca.pem` (TLS) |
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
//! # Choosing a backend
//!
//! - **Redis** (default feature): one round trip per acquire, the fastest; tokens count up
//!   from a high-water key with the server's clock as a floor, so they keep rising when
//!   the clock steps back and across restarts and failovers. Asynchronous
//!   replication means a failover can lose a lock (fencing still holds).
//! - **etcd**: consensus behind every grant, whole-second TTLs; for when a lock must
//!   survive the loss of a server.
//! - **PostgreSQL**: next to the data the job writes, so the fencing check and the write
//!   share one transaction (`distlock::postgres::PgFencedResource`). `?mode=lease` keeps
//!   leases in a table (works behind PgBouncer with `&pooling=transaction`);
//!   `?mode=advisory` holds a session advisory lock per lease on a pinned connection.
//! - **memory**: one process only; for tests and for trying the API.
//!
//! Whatever the store, the lease is a hint and the fencing token the guarantee: a
//! worker paused past its TTL does not know it lost the lock, and only the store it
//! writes to, by refusing its older token, stops it.
//!
//! # Locking a job
//!
//! A [`Locker`] takes leases on one backend and keeps them renewed (one watchdog task
//! renews every due lease at TTL/3). [`Locker::with_lock`] runs a job under its key's
//! lock: it waits for the key (up to the locker's wait timeout, woken when the holder
//! releases), renews while the job runs, stops the job before its next step if the
//! lease is lost, and releases when it ends. [`Locker::try_lock`] does not wait: `None`
//! means another worker holds the key, and the job should be retried later.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
//! use std::time::Duration;
//! use distlock::{LockKey, Locker};
//!
//! let locker = Locker::builder(distlock::connect("memory://").await?)
//!     .ttl(Duration::from_secs(30))
//!     .build()?;
//! let key = LockKey::new("invoice:2024-001")?;
//!
//! // Wait for the key, run the job under it; the token goes with every write it makes.
//! let paid = locker
//!     .with_lock(&key, |guard| {
//!         let token = guard.token();
//!         async move { format!("paid under {token}") }
//!     })
//!     .await?;
//! assert!(paid.starts_with("paid under"));
//!
//! // Or take it without waiting, and hand the job back when it is held.
//! match locker.try_lock(&key).await? {
//!     Some(guard) => {
//!         guard.release().await?;
//!     }
//!     None => { /* another worker has it: requeue the job */ }
//! }
//! # Ok(()) }
//! ```
//!
//! # Fencing a write
//!
//! Every grant carries a [`FencingToken`] that is higher than every earlier grant's for
//! the key. The store a job writes to admits a write only with a token at least as high
//! as the highest it has seen ([`FencedResource`]; `PgFencedResource`,
//! `RedisFencedResource` and `EtcdFencedResource` in the store crates, or your own):
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
//! // Every write downstream carries the guard's token; the store checks it and writes in
//! // one step.
//! assert_eq!(ledger.write("payout:42", first, b"paid").await?, Admission::Admitted);
//! guard.release().await?;
//!
//! // The next holder gets a higher token, and then a write with the old one is refused.
//! let next = locker.lock(&key).await?;
//! assert!(next.token() > first);
//! assert!(ledger.write("payout:42", next.token(), b"refunded").await?.is_admitted());
//! let late = ledger.write("payout:42", first, b"paid").await?;
//! assert!(matches!(late, Admission::Stale { .. }));
//! assert_eq!(ledger.read("payout:42").await?.as_deref(), Some(&b"refunded"[..]));
//! next.release().await?;
//! # Ok(()) }
//! ```
//!
//! A lock is not exactly-once: a worker that crashes after its side effect but before
//! its ack leaves the job to be run again, under a new, higher token. Record an
//! idempotency key in the side effect's own transaction
//! (`distlock::postgres::IdempotencyKeys` on PostgreSQL).
//!
//! # One scheduler at a time
//!
//! [`Election`] elects one leader per role, with a token like a lock's: a cron process
//! fires its jobs only while it leads, and stamps them with the leadership's token.
//! A standby is woken by the leader's release and takes over at once.
//!
//! # At most N at once
//!
//! [`Locker::semaphore`] makes a [`Semaphore`] of N permits (at most N exports of a
//! tenant at once, say): each [`Permit`] is a lease on one of N slot keys, renewed and
//! lost like a lock's, so a crashed holder's permit comes back when its TTL runs out.
//! A permit's token rises per slot, and the tokens of different slots are not ordered:
//! fence its writes with [`Permit::fence`] (the slot's key and the token together, taken
//! by [`FencedResourceExt::write_under`] on every fenced resource), never with its token
//! under the semaphore's name, where the holder of one slot refuses the holders of the
//! others. Waiters are not served in order (a permit freed goes to whichever asks first,
//! as Redisson's semaphores do); a locker refuses a lock named like a slot
//! (`<name>:permit:<n>`).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
//! use distlock::{EnforcementMode, FencedResourceExt, LockKey, Locker, MemoryFencedResource};
//!
//! let locker = Locker::new(distlock::connect("memory://").await?)?;
//! let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
//! // At most two exports of tenant 7 at once, in every process.
//! let exports = locker.semaphore(&LockKey::new("exports:tenant-7")?, 2)?;
//! let permit = exports.acquire().await?;
//! let other = exports.acquire().await?;
//! assert!(exports.try_acquire().await?.is_none()); // full: requeue the job
//! // Each holder writes under its own permit's fence, and each is admitted.
//! assert!(ledger.write_under(&permit.fence(), b"rows 0-99").await?.is_admitted());
//! assert!(ledger.write_under(&other.fence(), b"rows 100-199").await?.is_admitted());
//! permit.release().await?;
//! other.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Inside a job queue
//!
//! With the `tower` feature, `distlock::tower::LockLayer` runs each job of a tower
//! service (an apalis worker, say) under the lock of a key its request names, and
//! `tower::LeaderLayer` runs a scheduled job only where its role's leader runs. The
//! `job-queue` package of the repository runs both on apalis with its Redis storage.
//!
//! # Running the suite
//!
//! The `conformance` crate is the suite every backend here passes: one test per case,
//! stamped by `conformance::conformance_tests!` for a backend factory and the
//! capabilities it declares, with a history checker for the invariants and deliberately
//! broken backends the suite must catch. Stamp it on your own [`LockBackend`]
//! implementation in your tests, and run it against your deployment with
//! `lockctl check URL` (under a random key prefix it cleans up).
//!
//! The `payout_worker` example (features `redis` and `postgres`) runs the whole pattern:
//! workers on Redis locks paying out jobs into a PostgreSQL ledger that checks the
//! fencing token and an idempotency key in the same transaction as the ledger insert.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod connect;
mod fenced;

pub use connect::{SCHEMES, Scheme, URL_ENV, connect, connect_from_env, setup};
pub use fenced::fenced_resource;
// The user's surface: taking, keeping and giving back locks and permits; elections; fencing the
// downstream store; the in-memory store; the errors and the metric names.
pub use distlock_core::{
    Admission, Capabilities, Claim, ELECTION_PREFIX, Election, ElectionBuilder, EnforcementMode,
    Fence, FencedResource, FencedResourceExt, FencingToken, Leader, Leadership, Lease, LeaseStatus,
    LockBackend, LockError, LockGuard, LockInfo, LockKey, Locker, LockerBuilder, MAX_KEY_BYTES,
    MAX_PERMITS, MemoryFencedResource, OwnerId, Permit, Permits, QUEUE_KEY_PREFIX, Release,
    Renewal, RetryPolicy, Semaphore, WriteFence, election_key, memory, redact_url, telemetry,
    url_userinfo_is_ambiguous,
};

/// What implementing a store, or a layer around one, needs beyond the user's surface:
/// building leases and their validity, the shared fencing decision, error conversion,
/// release notifications, and the forwarding layer.
pub mod backend {
    pub use distlock_core::wake;
    pub use distlock_core::{
        BackendId, BackendLayer, BoxError, DRIFT_FACTOR, DriverFailure, Effect, FailureKind,
        Instrumented, Layered, VALIDITY_MARGIN, async_trait, builder_from_env, decide,
        url_from_env, valid_until,
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

#[cfg(feature = "apalis")]
#[cfg_attr(docsrs, doc(cfg(feature = "apalis")))]
pub mod apalis;

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
