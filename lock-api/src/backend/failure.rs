//! The one mapping from a store client's failure to a [`LockError`].
//!
//! Each backend reads its own client library's error and says what kind of failure it was
//! ([`FailureKind`]); the caller says what the failed call could have changed ([`Effect`]).
//! Which [`LockError`] variant that makes is decided here, once for every backend:
//!
//! | failure | [`Effect::None`] | [`Effect::Write`] |
//! |---|---|---|
//! | [`FailureKind::Config`] | `Config` | `Config` |
//! | [`FailureKind::NotApplied`] | `Unavailable` | `Unavailable` |
//! | [`FailureKind::ReplyLost`] | `Unavailable` | `OutcomeUnknown` |
//! | [`FailureKind::Other`] | `Backend` | `Backend` |

use crate::error::{BoxError, LockError};

/// What a failed call could have changed in the store, which decides what a lost reply means.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Effect {
    /// A read, or a write whose loss leaves no lock behind (granting an unused lease).
    None,
    /// A write to a lock or to a lease that holds one; the name is the operation's.
    Write(&'static str),
}

/// What a backend knows about a request that failed, read from its client library's error.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum FailureKind {
    /// Retrying cannot help until the configuration changes: refused credentials or
    /// permissions, invalid settings, missing tables.
    Config,
    /// The request was never applied: it never left (no connection), or the store refused
    /// it before running it (no leader, a replica, a failover under way, an expired token).
    NotApplied,
    /// The request may have reached the store and its reply was lost (a timeout after
    /// sending, a connection broken mid-call): a write may or may not have taken effect.
    ReplyLost,
    /// Anything else the store reported.
    Other,
}

/// A client library's failure as a backend classified it, ready to become a [`LockError`].
#[derive(Debug)]
pub struct DriverFailure {
    kind: FailureKind,
    message: String,
    source: Option<BoxError>,
}

impl DriverFailure {
    /// A failure of `kind`, described by `message` (which must not hold credentials).
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Keeps the client library's error as the source of the [`LockError`]. Only pass
    /// errors whose text cannot hold a URL or a password (I/O errors, timeouts, server
    /// replies). A [`FailureKind::Config`] failure drops it: its client text is the kind
    /// that quotes a URL.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The public error for this failure of a call with `effect`, on `backend`. An
    /// [`FailureKind::Other`] failure becomes [`LockError::Backend`] whose source is the
    /// client's error, or the message when there is none.
    pub fn into_error(self, backend: &'static str, effect: Effect) -> LockError {
        let Self {
            kind,
            message,
            source,
        } = self;
        match (kind, effect) {
            (FailureKind::Config, _) => LockError::Config(message),
            (FailureKind::ReplyLost, Effect::Write(operation)) => LockError::OutcomeUnknown {
                backend,
                operation,
                message,
                source,
            },
            (FailureKind::NotApplied | FailureKind::ReplyLost, _) => LockError::Unavailable {
                backend,
                message,
                source,
            },
            (FailureKind::Other, _) => LockError::Backend {
                backend,
                source: source.unwrap_or_else(|| message.into()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    fn io_error() -> std::io::Error {
        std::io::Error::from(std::io::ErrorKind::ConnectionReset)
    }

    #[test]
    fn a_lost_reply_is_outcome_unknown_only_for_a_write() {
        let write = DriverFailure::new(FailureKind::ReplyLost, "connection lost")
            .with_source(io_error())
            .into_error("memory", Effect::Write("acquire"));
        assert!(matches!(
            write,
            LockError::OutcomeUnknown {
                operation: "acquire",
                ..
            }
        ));
        assert!(write.source().is_some_and(|s| s.is::<std::io::Error>()));
        let read = DriverFailure::new(FailureKind::ReplyLost, "connection lost")
            .into_error("memory", Effect::None);
        assert!(matches!(read, LockError::Unavailable { source: None, .. }));
    }

    #[test]
    fn a_request_never_applied_is_unavailable_even_for_a_write() {
        let e = DriverFailure::new(FailureKind::NotApplied, "no leader")
            .into_error("memory", Effect::Write("acquire"));
        assert!(matches!(e, LockError::Unavailable { .. }) && e.is_retryable());
    }

    #[test]
    fn a_configuration_failure_never_keeps_the_client_error() {
        let e = DriverFailure::new(FailureKind::Config, "the server refused the credentials")
            .with_source("redis://user:hunter2@host")
            .into_error("memory", Effect::None);
        assert!(matches!(e, LockError::Config(_)) && e.source().is_none());
        assert!(!format!("{e} {e:?}").contains("hunter2"));
    }

    #[test]
    fn other_failures_are_backend_errors_carrying_the_client_error_or_the_message() {
        let with = DriverFailure::new(FailureKind::Other, "ignored")
            .with_source(io_error())
            .into_error("memory", Effect::None);
        assert!(
            matches!(&with, LockError::Backend { source, .. } if source.is::<std::io::Error>())
        );
        let without = DriverFailure::new(FailureKind::Other, "too many operations")
            .into_error("memory", Effect::None);
        assert_eq!(without.to_string(), "memory error: too many operations");
    }
}
