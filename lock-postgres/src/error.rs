//! How `sqlx` errors become [`LockError`]s: this crate's one place that reads them.
//!
//! The split that matters to callers: a failure before a request was sent (no connection,
//! pool timeout, refused login) changed nothing and is `Unavailable`; a lost reply to a
//! request that writes is `OutcomeUnknown`; a missing table names `setup()`.

use std::time::Duration;

use lock_api::LockError;

use crate::schema::Schema;

/// The call that failed, for messages and for deciding whether an outcome is unknown.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Operation {
    Setup,
    Acquire,
    Renew,
    Release,
    Fence,
    Inspect,
    Admit,
    RecordKey,
    Purge,
}

impl Operation {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Setup => "setup",
            Self::Acquire => "acquire",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Fence => "fence",
            Self::Inspect => "inspect",
            Self::Admit => "admit",
            Self::RecordKey => "record",
            Self::Purge => "purge",
        }
    }

    /// True when the request changes the store, so a lost reply leaves its effect unknown.
    fn writes(self) -> bool {
        !matches!(self, Self::Fence | Self::Inspect)
    }
}

/// An error from getting a connection: nothing was sent.
pub(crate) fn from_connect(
    backend: &'static str,
    schema: &Schema,
    pool_size: u32,
    connect_timeout: Duration,
    e: sqlx::Error,
) -> LockError {
    match e {
        sqlx::Error::PoolTimedOut => LockError::unavailable(
            backend,
            format!(
                "no connection within {connect_timeout:?}: the server is down or unreachable, \
                 or all {pool_size} pooled connections are busy"
            ),
        ),
        sqlx::Error::Io(e) => LockError::unavailable(backend, format!("cannot connect: {e}")),
        sqlx::Error::Tls(e) => {
            LockError::unavailable(backend, format!("TLS handshake failed: {e}"))
        }
        other => from_sqlx(backend, Operation::Inspect, schema, other),
    }
}

/// An error from running `op`'s statement.
pub(crate) fn from_sqlx(
    backend: &'static str,
    op: Operation,
    schema: &Schema,
    e: sqlx::Error,
) -> LockError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                // undefined_table, invalid_schema_name: the tables were never created.
                "42P01" | "3F000" => LockError::Config(format!(
                    "the tables of schema `{schema}` do not exist ({}): call `setup()` once \
                     (for example `PgLeaseBackend::setup().await`) before using the backend",
                    db.message()
                )),
                // invalid_password, invalid_authorization_specification, invalid_catalog_name
                "28P01" | "28000" | "3D000" => {
                    LockError::Config(format!("PostgreSQL refused the login: {}", db.message()))
                }
                "42501" => LockError::Config(format!(
                    "{} on schema `{schema}` is not permitted: {}",
                    op.as_str(),
                    db.message()
                )),
                // too_many_connections, admin_shutdown, crash_shutdown, cannot_connect_now,
                // serialization_failure, deadlock_detected, query_canceled
                "53300" | "57P01" | "57P02" | "57P03" | "40001" | "40P01" | "57014" => {
                    LockError::unavailable(backend, format!("{}: {}", op.as_str(), db.message()))
                }
                _ => LockError::backend(backend, format!("{}: {}", op.as_str(), db.message())),
            }
        }
        sqlx::Error::Io(e) => reply_lost(backend, op, format!("connection failed: {e}")),
        sqlx::Error::Protocol(m) => reply_lost(backend, op, format!("protocol error: {m}")),
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
            LockError::unavailable(backend, format!("{}: no connection available", op.as_str()))
        }
        sqlx::Error::Tls(e) => LockError::unavailable(backend, format!("TLS failed: {e}")),
        sqlx::Error::Configuration(e) => LockError::Config(e.to_string()),
        other => LockError::backend(backend, other),
    }
}

/// A request was sent and no reply came back in `after`.
pub(crate) fn timed_out(backend: &'static str, op: Operation, after: Duration) -> LockError {
    reply_lost(backend, op, format!("no reply within {after:?}"))
}

fn reply_lost(backend: &'static str, op: Operation, message: String) -> LockError {
    if op.writes() {
        LockError::OutcomeUnknown {
            backend,
            operation: op.as_str(),
            message,
        }
    } else {
        LockError::unavailable(backend, format!("{}: {message}", op.as_str()))
    }
}

/// True when the error means the connection itself is gone or unusable.
pub(crate) fn connection_broken(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_)
    ) || matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("57P")))
}
