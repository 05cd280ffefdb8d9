//! How `sqlx` errors become [`LockError`]s: this crate's one place that reads them.
//!
//! The split that matters to callers: a failure before a request was sent (no connection,
//! pool timeout, refused login) changed nothing and is `Unavailable`; a lost reply to a
//! request that writes is `OutcomeUnknown`; a missing table names `setup()`.

use std::time::Duration;

use distlock_core::{DriverFailure, Effect, FailureKind, LockError};

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
    /// `PgFencedResource`'s fenced write.
    Write,
    /// `PgFencedResource`'s read of a value.
    Read,
    RecordKey,
    Purge,
    /// The advisory backend's check that connections keep their server sessions.
    CheckPooling,
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
            Self::Write => "fenced write",
            Self::Read => "fenced read",
            Self::RecordKey => "record",
            Self::Purge => "purge",
            Self::CheckPooling => "pooling check",
        }
    }

    /// What the request can change in the store: a lost reply to a write leaves its
    /// effect unknown.
    fn effect(self) -> Effect {
        match self {
            Self::Fence | Self::Inspect | Self::Read | Self::CheckPooling => Effect::None,
            _ => Effect::Write(self.as_str()),
        }
    }
}

/// An error from getting a connection: nothing was sent. The client's error is kept as
/// the source: it comes after the connect options were parsed, so it holds no URL.
pub(crate) fn from_connect(
    backend: &'static str,
    schema: &Schema,
    pool_size: u32,
    connect_timeout: Duration,
    e: sqlx::Error,
) -> LockError {
    let failure = match &e {
        sqlx::Error::PoolTimedOut => DriverFailure::new(
            FailureKind::NotApplied,
            format!(
                "no connection within {connect_timeout:?}: the server is down or unreachable, \
                 or all {pool_size} pooled connections are busy"
            ),
        )
        .with_source(e),
        sqlx::Error::Io(io) => {
            DriverFailure::new(FailureKind::NotApplied, format!("cannot connect: {io}"))
                .with_source(e)
        }
        sqlx::Error::Tls(tls) => DriverFailure::new(
            FailureKind::NotApplied,
            format!("TLS handshake failed: {tls}"),
        )
        .with_source(e),
        _ => classify(Operation::Inspect, schema, e),
    };
    failure.into_error(backend, Effect::None)
}

/// An error from running `op`'s statement.
pub(crate) fn from_sqlx(
    backend: &'static str,
    op: Operation,
    schema: &Schema,
    e: sqlx::Error,
) -> LockError {
    classify(op, schema, e).into_error(backend, op.effect())
}

/// What a `sqlx` error says about `op`'s request. Server replies, I/O and TLS errors are
/// kept as the source; a configuration error's text may quote the URL, so it is not.
fn classify(op: Operation, schema: &Schema, e: sqlx::Error) -> DriverFailure {
    let name = op.as_str();
    let failure = match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                // undefined_table, invalid_schema_name: the tables were never created.
                "42P01" | "3F000" => {
                    return DriverFailure::new(
                        FailureKind::Config,
                        format!(
                            "the tables of schema `{schema}` do not exist ({}): create them \
                             once per database before using the backend, with \
                             `distlock::setup(url)`, `lockctl setup URL`, or the backend's \
                             `setup()`",
                            db.message()
                        ),
                    );
                }
                // invalid_password, invalid_authorization_specification, invalid_catalog_name
                "28P01" | "28000" | "3D000" => {
                    return DriverFailure::new(
                        FailureKind::Config,
                        format!("PostgreSQL refused the login: {}", db.message()),
                    );
                }
                "42501" => {
                    return DriverFailure::new(
                        FailureKind::Config,
                        format!(
                            "{name} on schema `{schema}` is not permitted: {}",
                            db.message()
                        ),
                    );
                }
                // too_many_connections, admin_shutdown, crash_shutdown, cannot_connect_now,
                // serialization_failure, deadlock_detected, query_canceled
                "53300" | "57P01" | "57P02" | "57P03" | "40001" | "40P01" | "57014" => {
                    DriverFailure::new(FailureKind::NotApplied, format!("{name}: {}", db.message()))
                }
                _ => {
                    return DriverFailure::new(
                        FailureKind::Other,
                        format!("{name}: {}", db.message()),
                    );
                }
            }
        }
        sqlx::Error::Io(io) => DriverFailure::new(
            FailureKind::ReplyLost,
            format!("{name}: connection failed: {io}"),
        ),
        sqlx::Error::Protocol(m) => DriverFailure::new(
            FailureKind::ReplyLost,
            format!("{name}: protocol error: {m}"),
        ),
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => DriverFailure::new(
            FailureKind::NotApplied,
            format!("{name}: no connection available"),
        ),
        sqlx::Error::Tls(tls) => DriverFailure::new(
            FailureKind::NotApplied,
            format!("{name}: TLS failed: {tls}"),
        ),
        sqlx::Error::Configuration(c) => {
            return DriverFailure::new(FailureKind::Config, c.to_string());
        }
        other => DriverFailure::new(FailureKind::Other, other.to_string()),
    };
    failure.with_source(e)
}

/// A request was sent and no reply came back in `after`.
pub(crate) fn timed_out(backend: &'static str, op: Operation, after: Duration) -> LockError {
    DriverFailure::new(
        FailureKind::ReplyLost,
        format!("{}: no reply within {after:?}", op.as_str()),
    )
    .into_error(backend, op.effect())
}

/// True when the error means the connection itself is gone or unusable.
/// Whether the server ended the session (`57P*`: shutdown, `pg_terminate_backend`, idle
/// timeout): a session lock it held is gone, and no statement ran after that.
pub(crate) fn session_ended(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("57P")))
}

pub(crate) fn connection_broken(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_)
    ) || session_ended(e)
}
