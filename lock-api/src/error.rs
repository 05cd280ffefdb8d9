//! The one public error type every backend converts its own errors into.

use std::time::Duration;

use crate::key::LockKey;

/// A boxed error from a store's client library, kept as the `source` of a [`LockError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong when taking, keeping or giving back a lock.
///
/// No store's own error type appears here: backends keep their private errors and
/// convert them into one of these variants. Retry decisions read [`LockError::is_retryable`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The key is empty, too long, or contains a control character.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// Why the key was refused.
        reason: String,
    },
    /// The TTL is zero, outside the backend's bounds, or finer than its granularity.
    #[error("invalid ttl {ttl:?}: {reason}")]
    InvalidTtl {
        /// The TTL that was asked for.
        ttl: Duration,
        /// Why the backend cannot honour it.
        reason: String,
    },
    /// The store could not be reached or did not answer in time; nothing was done.
    #[error("{backend} is unavailable: {message}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// What failed, without credentials.
        message: String,
        /// The client library's error, when its text cannot hold credentials.
        #[source]
        source: Option<BoxError>,
    },
    /// The request was sent but its reply was lost: it may or may not have taken effect.
    /// The caller must act as if it does not hold the lock; the key frees itself within the TTL.
    #[error("{backend}: the outcome of {operation} is unknown: {message}")]
    OutcomeUnknown {
        /// The backend's name.
        backend: &'static str,
        /// The operation whose reply was lost.
        operation: &'static str,
        /// What happened, without credentials.
        message: String,
        /// The client library's error, when its text cannot hold credentials.
        #[source]
        source: Option<BoxError>,
    },
    /// The lease is no longer held: it expired, was taken over, or could not be renewed in time.
    #[error("the lease was lost")]
    Lost,
    /// Waiting for a lock took longer than the wait timeout.
    #[error("gave up waiting for lock {key} after {waited:?}")]
    Timeout {
        /// The key that was waited for.
        key: LockKey,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The configuration is invalid (a malformed URL, a missing endpoint, bad bounds).
    #[error("configuration error: {0}")]
    Config(String),
    /// The backend does not support this operation.
    #[error("{operation} is not supported by the {backend} backend")]
    Unsupported {
        /// The operation asked for.
        operation: &'static str,
        /// The backend's name.
        backend: &'static str,
    },
    /// The lease was granted by another backend instance and cannot be used with this one.
    #[error("the lease was granted by another {backend} backend instance")]
    ForeignLease {
        /// The backend's name.
        backend: &'static str,
    },
    /// Any other error reported by the store.
    #[error("{backend} error: {source}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The store's error.
        #[source]
        source: BoxError,
    },
}

impl LockError {
    /// True when trying the same call again later may succeed: the store was unreachable,
    /// slow, or its reply was lost. Invalid input, a lost lease and configuration errors
    /// are never retryable.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::OutcomeUnknown { .. })
    }

    /// Shorthand for [`LockError::InvalidTtl`].
    pub fn invalid_ttl(ttl: Duration, reason: impl Into<String>) -> Self {
        Self::InvalidTtl {
            ttl,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`LockError::Unavailable`] without a source.
    pub fn unavailable(backend: &'static str, message: impl Into<String>) -> Self {
        Self::Unavailable {
            backend,
            message: message.into(),
            source: None,
        }
    }

    /// Shorthand for [`LockError::Unavailable`] caused by `source`, an error whose text
    /// cannot hold credentials (an I/O error, a timeout, a server's reply).
    pub fn unavailable_with_source(
        backend: &'static str,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Unavailable {
            backend,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Shorthand for [`LockError::OutcomeUnknown`] without a source.
    pub fn outcome_unknown(
        backend: &'static str,
        operation: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self::OutcomeUnknown {
            backend,
            operation,
            message: message.into(),
            source: None,
        }
    }

    /// Shorthand for [`LockError::OutcomeUnknown`] caused by `source`, an error whose text
    /// cannot hold credentials (an I/O error, a timeout, a server's reply).
    pub fn outcome_unknown_with_source(
        backend: &'static str,
        operation: &'static str,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::OutcomeUnknown {
            backend,
            operation,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Shorthand for [`LockError::Backend`].
    pub fn backend(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            backend,
            source: source.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_errors_are_retryable() {
        assert!(LockError::unavailable("memory", "down").is_retryable());
        assert!(LockError::outcome_unknown("memory", "acquire", "reply lost").is_retryable());
        assert!(!LockError::Lost.is_retryable());
        assert!(!LockError::invalid_ttl(Duration::ZERO, "zero").is_retryable());
        assert!(!LockError::Config("bad url".into()).is_retryable());
        assert!(!LockError::ForeignLease { backend: "memory" }.is_retryable());
    }
}
