//! etcd v3 backend for distlock: every lock is a key attached to its own lease, taken and
//! checked in transactions, and the key's `create_revision` is the fencing token.
//!
//! ```no_run
//! # async fn demo() -> Result<(), distlock_core::LockError> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use distlock_core::{LockKey, Locker};
//! use lock_etcd::EtcdBackend;
//!
//! let backend = EtcdBackend::builder().endpoint("http://127.0.0.1:2379").build().await?;
//! let locker = Locker::builder(Arc::new(backend)).ttl(Duration::from_secs(10)).build()?;
//! let guard = locker.lock(&LockKey::new("payout:42")?).await?;
//! // ... attach guard.token() to every write ...
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Guarantees and limits
//!
//! - Tokens are etcd revisions: strictly increasing per key (and cluster-wide), durable
//!   across restarts and leader changes.
//! - TTLs are whole seconds and at least the cluster's minimum lease TTL (2 s with etcd's
//!   default 1 s election timeout). Other TTLs are refused with `InvalidTtl`, never rounded.
//! - A lock may outlive its TTL in etcd (lease expiry is checked every 500 ms, and a leader
//!   change extends every lease); the client's validity window always ends first.
//! - [`EtcdFencedResource`] gates downstream writes stored in etcd on the token.
//! - Keys: `<prefix>/locks/<name>` (the lock, on its lease), `<prefix>/tokens/<name>` (its
//!   `mod_revision` is the newest token, so it is known while the lock is free; one small
//!   key per lock name, kept forever, like a fence counter), and, for the fenced resource,
//!   `<prefix>/fenced/<resource>` and `<prefix>/data/<resource>`. A name's `%` and `/` are
//!   percent-encoded (`%25`, `%2F`), so every prefix and name has keys of its own (prefix
//!   `app` with name `x/locks/y` and prefix `app/locks/x` with name `y` would otherwise
//!   share one); names without those characters appear as they are.
//! - Members: every endpoint gets its own connection. Calls stick to the member that last
//!   answered; a call that could not reach a member (connection refused, no leader) goes to
//!   the next one, each at most once. A call that may have reached a member (a timeout, a
//!   connection broken mid-call) is never repeated: its error goes to the caller (for a
//!   write, `OutcomeUnknown`), and the next call starts at the next member.
//! - `purge` deletes a lock's key and its token key in one transaction and revokes its
//!   lease. Tokens are cluster-wide revisions, so the key's next token is still above
//!   every token it had before.
//! - Cost: an acquire is two round trips (grant the lease, then the transaction); release,
//!   renew and fence are one. A contended acquire revokes its unused lease in the background.
//! - Waiters in `Locker::lock` are woken when the key is deleted (released, revoked, or
//!   its lease expired), through one watch per backend on the deletes of its lock keys,
//!   opened with the first waiter and kept until the backend is dropped. After the stream
//!   breaks it watches again and wakes a waiter of every watched key; each waiter keeps its
//!   backoff as the fallback.

mod backend;
mod config;
mod error;
mod fenced;
mod keys;
mod members;
mod releases;
mod url;

pub use backend::EtcdBackend;
pub use config::{DEFAULT_KEY_PREFIX, ETCD_MAX_LEASE_TTL, EtcdBuilder};
pub use fenced::EtcdFencedResource;
pub use url::ETCD_URL_ENV;
