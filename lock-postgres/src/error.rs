//! How `sqlx` errors become [`LockError`]s: this crate's one place that reads them.
//!
//! The split that matters to callers: a failure before a request was sent (no connection,
//! pool timeout) changed nothing and is `Unavailable`; a lost reply to a request that
//! writes is `OutcomeUnknown` (so is one of PgBouncer's own errors, SQLSTATE 08P01, unless
//! it says the request never reached a server: `query_wait_timeout`, say); a login the
//! server or PgBouncer refuses for good (user, password, database, a startup setting) is
//! `Config` naming the setting, and a missing table names `setup()`.

use std::fmt::Display;
use std::time::Duration;

use distlock_core::{DriverFailure, Effect, FailureKind, LockError};
use sqlx::error::DatabaseError;
use sqlx::postgres::{PgDatabaseError, PgSeverity};

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
    schema: &impl Display,
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
        _ => classify("connect", schema, e),
    };
    failure.into_error(backend, Effect::None)
}

/// An error from running `op`'s statement on `schema` (named in its messages).
pub(crate) fn from_sqlx(
    backend: &'static str,
    op: Operation,
    schema: &impl Display,
    e: sqlx::Error,
) -> LockError {
    classify(op.as_str(), schema, e).into_error(backend, op.effect())
}

/// What a `sqlx` error says about the request `name` names (an operation, or `connect`).
/// Server replies, I/O and TLS errors are kept as the source; a configuration error's
/// text may quote the URL, so it is not.
fn classify(name: &str, schema: &impl Display, e: sqlx::Error) -> DriverFailure {
    let failure = match &e {
        sqlx::Error::Database(db) => {
            if let Some(refused) = refused_login(db.as_ref()) {
                return refused;
            }
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
                "42501" => {
                    return DriverFailure::new(
                        FailureKind::Config,
                        format!(
                            "{name} on schema `{schema}` is not permitted: {}",
                            db.message()
                        ),
                    );
                }
                // protocol_violation: from PgBouncer, its own errors (the server sends no
                // such error to a client that keeps to the protocol). It closes the
                // client's connection after each.
                "08P01" => DriverFailure::new(
                    pgbouncer_error(db.message()),
                    format!("{name}: PgBouncer: {}", db.message()),
                ),
                // too_many_connections, admin_shutdown, crash_shutdown, cannot_connect_now,
                // serialization_failure, deadlock_detected, query_canceled,
                // lock_not_available (`lock_timeout`: the transaction rolled back)
                "53300" | "57P01" | "57P02" | "57P03" | "40001" | "40P01" | "57014" | "55P03" => {
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

/// A refusal of the connection itself, by the server or by PgBouncer in front of it, for
/// a reason that stays until a setting changes: the URL's user, password, database or
/// startup settings, or the pooler's configuration. `Config`, naming what to change.
/// These come only while a connection logs in, whichever call opened it.
fn refused_login(db: &dyn DatabaseError) -> Option<DriverFailure> {
    let message = db.message();
    let fatal = db
        .try_downcast_ref::<PgDatabaseError>()
        .is_some_and(|e| e.severity() == PgSeverity::Fatal);
    let refusal = match db.code()?.as_ref() {
        // invalid_password, invalid_authorization_specification, invalid_catalog_name
        "28P01" | "28000" | "3D000" => format!(
            "PostgreSQL refused the login: {message} (the URL's user, password and database)"
        ),
        // insufficient_privilege at login: no CONNECT privilege on the database.
        "42501" if fatal => {
            format!("PostgreSQL refused the login: {message} (the URL's user and database)")
        }
        // undefined_object, invalid_parameter_value at login: a setting the startup
        // packet carries (`options`) that the server does not know or accept.
        "42704" | "22023" if fatal => format!(
            "PostgreSQL refused a setting the connection sends: {message}. The URL's \
             `options[NAME]` parameters and the PGOPTIONS environment variable set them"
        ),
        // PgBouncer's own errors all carry protocol_violation.
        "08P01" => pgbouncer_refusal(message)?,
        _ => return None,
    };
    Some(DriverFailure::new(FailureKind::Config, refusal))
}

/// What to change when PgBouncer refuses a connection with `message` for a reason of
/// configuration; `None` for its other errors.
fn pgbouncer_refusal(message: &str) -> Option<String> {
    const TRACKED: &str = "it accepts only the startup parameters it tracks \
        (client_encoding, DateStyle, TimeZone, standard_conforming_strings, \
        application_name) and those its ignore_startup_parameters setting lists";
    const OPTIONS: &str = "distlock sends `options` only for the URL's `options[NAME]` \
        parameters and the PGOPTIONS environment variable: leave them out (set those \
        settings for the role instead, with ALTER ROLE … SET), or list `options` in \
        ignore_startup_parameters, which makes PgBouncer drop them";
    const LOGIN: &[&str] = &[
        "no such user",
        "password authentication failed",
        "SASL authentication failed",
        "\"trust\" authentication failed",
        "login rejected",
        "certificate authentication failed",
        "LDAP authentication failed",
    ];
    if let Some(parameter) = message.strip_prefix("unsupported startup parameter: ") {
        let hint = if parameter == "options" {
            OPTIONS
        } else {
            "List it in ignore_startup_parameters"
        };
        return Some(format!(
            "PgBouncer refused the startup parameter `{parameter}` ({message}): {TRACKED}. \
             {hint}"
        ));
    }
    if message.starts_with("unsupported startup parameter in options")
        || message.starts_with("unsupported options startup parameter")
    {
        return Some(format!(
            "PgBouncer refused a setting of the startup parameter `options` ({message}). \
             {OPTIONS}"
        ));
    }
    if message.starts_with("no such database") {
        return Some(format!(
            "PgBouncer refused the login ({message}): the URL's database must be a name of \
             the [databases] section of PgBouncer's configuration"
        ));
    }
    if LOGIN.iter().any(|m| message.starts_with(m)) {
        return Some(format!(
            "PgBouncer refused the login ({message}): check the URL's user and password \
             against PgBouncer's auth_file or auth_query"
        ));
    }
    if message.starts_with("SSL required") {
        return Some(format!(
            "PgBouncer refused the login ({message}): set sslmode=require in the URL"
        ));
    }
    None
}

/// What one of PgBouncer's own errors (not a configuration refusal) says about the
/// request: `NotApplied` for those it sends before any server session got the request
/// (every session stayed busy for `query_wait_timeout`, none could be opened, too many
/// clients, a client idle too long); otherwise (`query_timeout`, `server conn crashed?`,
/// `idle transaction timeout`, ...) the request may have run: `ReplyLost`.
fn pgbouncer_error(message: &str) -> FailureKind {
    const NOT_SENT: &[&str] = &[
        "query_wait_timeout",
        "pgbouncer cannot connect to server",
        "server login has been failing",
        "no more connections allowed",
        "client_idle_timeout",
    ];
    if NOT_SENT.iter().any(|m| message.starts_with(m)) {
        FailureKind::NotApplied
    } else {
        FailureKind::ReplyLost
    }
}

/// A request was sent and no reply came back in `after`.
pub(crate) fn timed_out(backend: &'static str, op: Operation, after: Duration) -> LockError {
    DriverFailure::new(
        FailureKind::ReplyLost,
        format!("{}: no reply within {after:?}", op.as_str()),
    )
    .into_error(backend, op.effect())
}

/// Whether the server ended the session (`57P*`: shutdown, `pg_terminate_backend`, idle
/// timeout): a session lock it held is gone, and no statement ran after that.
pub(crate) fn session_ended(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c.starts_with("57P")))
}

/// True when the error means the connection itself is gone or unusable: it is closed
/// rather than given back to the pool.
pub(crate) fn connection_broken(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_)
    ) || session_ended(e)
        || pgbouncer_closed(e)
}

/// Whether PgBouncer sent one of its own errors (SQLSTATE 08P01), after which it closes
/// the client's connection.
fn pgbouncer_closed(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c == "08P01"))
}
