//! PostgreSQL backends for distlock, and fencing and idempotency in SQL.
//!
//! - [`PgLeaseBackend`]: one row per lock in a lease table; acquire is one upsert on the
//!   server's clock; no connection stays pinned. Use it by default.
//! - [`PgAdvisoryBackend`]: session-level advisory locks; each held lock pins a connection,
//!   and ownership ends with the session. Not usable behind a transaction-pooling proxy.
//! - [`PgFencedResource`]: the downstream gate that rejects writes carrying an older
//!   fencing token, inside the application's own transaction.
//! - [`IdempotencyKeys`]: records `payment:{job_id}`-style keys in the same transaction
//!   as the side effect.
//!
//! Both backends are built from a [`PgBuilder`] and need their tables: call `setup()` once
//! (idempotent). Tokens survive server restarts: they live in tables, never in memory,
//! and each is at least the server's clock in microseconds (`greatest(counter + 1,
//! clock)`), so a counter that lost its last increments (asynchronous commit, failover to
//! a lagging replica) never issues a token twice.
//! The two backends keep separate state: a lease-table lock and an advisory lock on the
//! same name do not exclude each other.

mod advisory;
mod announcer;
mod client;
mod config;
mod error;
mod fenced;
mod key_row;
mod lease_table;
mod pooling;
mod releases;
mod retention;
mod schema;
mod session_check;
mod statement;
mod url;
mod waiters;

pub use advisory::PgAdvisoryBackend;
pub use announcer::ANNOUNCER_APPLICATION_NAME;
pub use config::{MAX_POOL_SIZE, PgBuilder, PgMode, URL_PARAMS, is_url_param};
pub use fenced::{DEFAULT_FENCE_TIME_LIMIT, Idempotency, IdempotencyKeys, PgFencedResource};
pub use lease_table::PgLeaseBackend;
pub use pooling::PgPooling;
pub use releases::LISTENER_APPLICATION_NAME;
pub use retention::{DEFAULT_TOKEN_RETENTION, MAX_TOKEN_RETENTION, MIN_TOKEN_RETENTION};
pub use schema::{DEFAULT_SCHEMA, Schema};
pub use url::{PARAMS, POSTGRES_URL_ENV};

/// The advisory backend's release statement, for the benchmarks' plain-SQL baseline that
/// sends the backend's own statement without the backend's code around it. Not part of the
/// API: it changes with the backend, in any release.
#[doc(hidden)]
pub const ADVISORY_UNLOCK_SQL: &str = advisory::UNLOCK;

/// The advisory backend's acquire, its token bump going to the table `tokens` (of
/// `distlock_advisory_tokens`'s columns), for the same baseline, which keeps its tokens in
/// a table of its own. Not part of the API, as [`ADVISORY_UNLOCK_SQL`].
#[doc(hidden)]
pub fn advisory_acquire_sql(tokens: &str) -> String {
    advisory::acquire_sql(tokens)
}

/// The `sqlx` this crate is built with (0.9, PostgreSQL, tokio): [`PgFencedResource::new`]
/// takes its `PgPool` and [`PgFencedResource::admit_in`] its transaction, so name its types
/// through this re-export (`lock_postgres::sqlx`, or `distlock::postgres::sqlx`) and they
/// are always the ones this crate expects.
pub use sqlx;
