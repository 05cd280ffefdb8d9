//! etcd v3 backend for distlock: every lock is a key attached to its own lease, taken and
//! checked in transactions, with fencing tokens that keep rising per name even through a
//! snapshot restore.
//!
//! ```no_run
//! # async fn demo() -> Result<(), distlock::LockError> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use distlock::{LockKey, Locker};
//! use distlock::etcd::EtcdBackend;
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
//! - Tokens are the granting client's wall clock in µs, or one more than the name's newest
//!   token if that is higher, recorded in the same transaction that takes the key and only
//!   if no other grant came between: strictly increasing per name, durable across
//!   restarts and leader changes. Not etcd revisions, because `etcdctl snapshot restore`
//!   brings the revision back to the snapshot's and would grant the tokens issued since
//!   again; clock tokens keep rising after a restore as long as the clients that grant read
//!   clocks later than the last token granted before it (clocks in sync to within the
//!   minutes a restore takes).
//! - TTLs are whole seconds and at least the cluster's minimum lease TTL (2 s with etcd's
//!   default 1 s election timeout). Other TTLs are refused with `InvalidTtl`, never rounded.
//! - A lock may outlive its TTL in etcd (lease expiry is checked every 500 ms, and a leader
//!   change extends every lease); the client's validity window always ends first.
//! - [`EtcdFencedResource`] gates downstream writes stored in etcd on the token.
//! - Keys: `<prefix>/locks/<name>` (the lock, on its lease, holding `<owner id>:<token>`),
//!   `<prefix>/tokens/<name>` (the newest token, 20 zero-padded digits, so it is known while
//!   the lock is free; one small key per lock name, deleted once nobody holds the name and
//!   its token is older than the token retention, or by `purge`), `<prefix>/sweeps/tokens`
//!   (when the next sweep of those is due), and, for the fenced resource,
//!   `<prefix>/fenced/<resource>` and `<prefix>/data/<resource>`. A name's `%` and `/` are
//!   percent-encoded (`%25`, `%2F`), so every prefix and name has keys of its own (prefix
//!   `app` with name `x/locks/y` and prefix `app/locks/x` with name `y` would otherwise
//!   share one); names without those characters appear as they are.
//! - Members: every endpoint gets its own connection. Calls stick to the member that last
//!   answered; a call that could not reach a member (connection refused, no leader) goes to
//!   the next one, each at most once. A call that may have reached a member (a timeout, a
//!   connection broken mid-call) is never repeated: its error goes to the caller (for a
//!   write, `OutcomeUnknown`), and the next call starts at the next member.
//! - Token retention (`EtcdBuilder::token_retention`, 24 h by default): with a lock per
//!   job id every name leaves a token key, which would grow etcd's database until its quota
//!   refuses every write. Acquires start a sweep in the background, about once per a 24th
//!   of the retention (between 1 s and 1 h) across every process sharing the prefix, that
//!   deletes the token key of each name nobody holds whose token is older than the
//!   retention by the sweeping client's clock, in transactions that check the name is
//!   still free and was not granted since it was read. The name's next token is then the
//!   clock, past the deleted one by the retention: tokens keep rising as long as no
//!   client's clock is behind another's by the retention. etcd frees the space of deleted
//!   keys once it compacts (run it with `--auto-compaction-retention`).
//! - `purge` deletes a lock's key and its token key in one transaction and revokes its
//!   lease; the key's next token then comes from the clock alone, above every token it had
//!   before under the same clock assumption as a restore.
//! - Cost: an acquire of a free key is two round trips: a linearizable read, with a lease
//!   for the lock beside it, then the transaction. The lease is a spare granted ahead in
//!   the background while locks of its TTL are taken often (the transaction is then the
//!   acquire's only consensus write), or else granted beside the read. Each lease is used
//!   by one lock and revoked on release, so every lock still expires on its own; a spare
//!   nobody uses holds no key and lapses. An acquire of a held key is the read alone and
//!   writes nothing (after such a refusal, the next acquire without a spare reads before
//!   it grants: three round trips). Release, renew and fence are one round trip. The sweep runs
//!   beside them, one request at a time (a page of 1,000 token keys read, their expired
//!   ones deleted 64 to a transaction).
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
mod tokens;
mod url;

pub use backend::EtcdBackend;
pub use backend::retention::{DEFAULT_TOKEN_RETENTION, MAX_TOKEN_RETENTION, MIN_TOKEN_RETENTION};
pub use config::{DEFAULT_KEY_PREFIX, ETCD_MAX_LEASE_TTL, EtcdBuilder};
pub use fenced::EtcdFencedResource;
pub use url::ETCD_URL_ENV;
