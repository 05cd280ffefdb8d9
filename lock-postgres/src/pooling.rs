//! [`PgPooling`]: whether client connections keep their server sessions (the check both
//! backends run to find out when the settings say they do is in `session_check.rs`).
//!
//! Behind a proxy that pools server sessions per transaction (PgBouncer `pool_mode =
//! transaction` or `statement`), consecutive statements of one client connection may run
//! in different server sessions, and a server session runs the statements of many client
//! connections. Whatever a session keeps between statements is then shared or lost: named
//! prepared statements, session settings, `LISTEN`, session-level advisory locks.

/// Whether each client connection keeps one server session ([`PgBuilder::pooling`],
/// `?pooling=` in a URL).
///
/// [`PgBuilder::pooling`]: crate::PgBuilder::pooling
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PgPooling {
    /// Each client connection keeps its server session from login to logout: a direct
    /// connection, or a pool in session mode (PgBouncer `pool_mode = session`). The
    /// default (`pooling=session`). Statements are prepared once per connection and sent
    /// with their values as bind parameters; release wake-ups use `LISTEN`.
    ///
    /// Each connection of the pool sets, when it opens, `statement_timeout` and
    /// `idle_in_transaction_session_timeout` to the request time limit for its session:
    /// a statement waiting on a row another transaction keeps locked is cancelled by the
    /// server when its client gives up (instead of a backend left waiting for nobody, and
    /// taking the row once it is free), and a transaction on the pool (setup's, or the
    /// application's on [`PgLeaseBackend::pool`](crate::PgLeaseBackend::pool)) whose
    /// client stalls is ended, with its row locks, after the limit.
    ///
    /// Before its first call (or in `connect()`, before it opens the pool) a backend
    /// checks that sessions are kept, and refuses to work with [`LockError::Config`](distlock_core::LockError::Config) when
    /// they are not.
    #[default]
    Session,
    /// A proxy between client and server pools server sessions per transaction
    /// (PgBouncer `pool_mode = transaction`), so nothing may rely on a server session
    /// outliving a statement (`pooling=transaction`). Lease table only: the advisory
    /// backend refuses it, since an advisory lock is its session.
    ///
    /// Every lease-table statement runs unnamed (prepared for that call only), its values
    /// bind parameters as always, inside an explicit transaction of its own, so the
    /// pooler keeps one server session for it from `BEGIN` to `COMMIT`: four round trips
    /// per call instead of one. The `BEGIN` sets `idle_in_transaction_session_timeout`,
    /// `statement_timeout` and `lock_timeout` to the request time limit for that transaction, so a client
    /// that stalls mid-transaction, or a statement waiting on another's row lock, holds
    /// nothing on the server for longer than the call waits for its reply. Releases do not wake waiters in this process (`LISTEN`
    /// needs a session): [`Capabilities::wakes_waiters`](distlock_core::Capabilities) is
    /// false and waiters poll with their backoff. Releases still announce themselves to
    /// processes that listen on a direct connection to the same schema.
    Transaction,
}

impl PgPooling {
    /// The URL's value: `session` or `transaction`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Transaction => "transaction",
        }
    }
}
