//! Turns `etcd-client` errors into [`LockError`]s.
//!
//! The one question that matters for a lock is whether a request may have taken effect.
//! A request that never left (no connection, no leader) is [`LockError::Unavailable`]. A
//! write whose reply was lost (a timeout after sending, a connection that broke mid-call,
//! etcd's own "request timed out") is [`LockError::OutcomeUnknown`], because etcd may still
//! commit it. Rejected credentials are [`LockError::Config`]: retrying cannot fix them. An
//! expired auth token is not a rejected credential: the client authenticates again.

use std::io::ErrorKind;

pub(crate) use distlock_core::Effect;
use distlock_core::{DriverFailure, FailureKind, LockError};
use etcd_client::Error as EtcdError;

pub(crate) const NAME: &str = "etcd";

// gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html), compared as
// integers so that no gRPC type leaks into this crate's dependencies.
const CANCELLED: i32 = 1;
#[cfg(test)]
const UNKNOWN: i32 = 2;
const INVALID_ARGUMENT: i32 = 3;
const NOT_FOUND: i32 = 5;
const DEADLINE_EXCEEDED: i32 = 4;
const PERMISSION_DENIED: i32 = 7;
const RESOURCE_EXHAUSTED: i32 = 8;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// The error for a call that did not answer within the request timeout.
pub(crate) fn timed_out(effect: Effect, after: std::time::Duration) -> LockError {
    let message = format!("no reply within the request timeout of {after:?}");
    DriverFailure::new(FailureKind::ReplyLost, message).into_error(NAME, effect)
}

/// Converts an `etcd-client` error, knowing what the failed call could have changed.
pub(crate) fn convert(error: EtcdError, effect: Effect) -> LockError {
    classify(error).into_error(NAME, effect)
}

/// What an `etcd-client` error says about the failed request. The client's error is kept
/// as the source: endpoints never hold credentials (the builder refuses them), so its
/// text cannot either.
fn classify(error: EtcdError) -> DriverFailure {
    match error {
        EtcdError::GRpcStatus(status) => {
            let code = i32::from(status.code());
            classify_status(code, status.message(), Link::under(&status)).with_source(status)
        }
        // Building the channel or connecting failed: nothing was sent.
        EtcdError::TransportError(e) => {
            DriverFailure::new(FailureKind::NotApplied, format!("cannot connect: {e}"))
                .with_source(e)
        }
        EtcdError::IoError(e) => {
            DriverFailure::new(FailureKind::NotApplied, format!("I/O error: {e}")).with_source(e)
        }
        EtcdError::InvalidUri(e) => {
            DriverFailure::new(FailureKind::Config, format!("invalid etcd endpoint: {e}"))
        }
        EtcdError::InvalidArgs(e) | EtcdError::EndpointError(e) => DriverFailure::new(
            FailureKind::Config,
            format!("invalid etcd client settings: {e}"),
        ),
        other => DriverFailure::new(FailureKind::Other, other.to_string()).with_source(other),
    }
}

/// What lies under a gRPC status: the server's answer, or the client's own connection
/// failing. The client builds a status from a transport failure and keeps that failure as
/// its source; a status the server sent has none.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Link {
    /// The server answered with the status.
    Answered,
    /// No connection could be made (refused, no route): the request never left.
    NotConnected,
    /// The connection failed under the call (reset, closed, an HTTP/2 error).
    Broken,
}

impl Link {
    /// Reads the source chain of `status` for the transport error under it.
    fn under(status: &(dyn std::error::Error + 'static)) -> Self {
        let mut cause = status.source();
        if cause.is_none() {
            return Self::Answered;
        }
        while let Some(e) = cause {
            if e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::HostUnreachable
                        | ErrorKind::NetworkUnreachable
                        | ErrorKind::AddrNotAvailable
                )
            }) {
                return Self::NotConnected;
            }
            cause = e.source();
        }
        Self::Broken
    }
}

fn classify_status(code: i32, message: &str, link: Link) -> DriverFailure {
    if message.contains(INVALID_AUTH_TOKEN) {
        // An expired token, still refused after the client authenticated again and resent
        // the call (another call may have raced it): etcd checks the token before proposing,
        // so nothing was applied, and the next call authenticates afresh.
        return DriverFailure::new(
            FailureKind::NotApplied,
            format!("the auth token expired: {message}"),
        );
    }
    if is_auth_failure(code, message) {
        return DriverFailure::new(
            FailureKind::Config,
            format!(
                "etcd refused the credentials (check the user name and password, and that the \
                 user may access the key prefix): {message}"
            ),
        );
    }
    if code == NOT_FOUND && message.contains("lease not found") {
        // A put on a lease that expired in the meantime: etcd refused the whole request.
        return DriverFailure::new(
            FailureKind::NotApplied,
            format!("the lease expired before the request reached etcd: {message}"),
        );
    }
    if code == RESOURCE_EXHAUSTED && message.contains(TOO_MANY_REQUESTS) {
        // The member's applied index lags its committed index: etcd refuses new requests
        // before proposing them, so nothing was applied, and the overload passes. (Its
        // other `ResourceExhausted`, "database space exceeded", needs an operator and
        // stays final.)
        return DriverFailure::new(
            FailureKind::NotApplied,
            format!("etcd is overloaded and refused the request: {message}"),
        );
    }
    if code == RESOURCE_EXHAUSTED && message.contains(NO_SPACE) {
        // etcd checks its quota before proposing and again as it applies: a write that
        // passed the first check while others filled the database is stored all the same
        // and still answered this way. So a write's outcome is unknown. It stays refused
        // until an operator frees space and disarms the alarm.
        return DriverFailure::new(
            FailureKind::ReplyLost,
            format!(
                "etcd's database reached its space quota (--quota-backend-bytes) and etcd \
                 refuses every write until an operator compacts, defragments and disarms the \
                 NOSPACE alarm: {message}"
            ),
        );
    }
    let lost_reply = match code {
        CANCELLED | DEADLINE_EXCEEDED => true,
        UNAVAILABLE => !never_sent_status(code, message, link),
        // A status the client built over its own connection failing, whatever its code:
        // tonic turns h2's reason into the code (INTERNAL_ERROR is `Internal`,
        // ENHANCE_YOUR_CALM `ResourceExhausted`, as when h2 closes a connection after too
        // many streams it reset itself), and the call may have reached the server.
        _ if link != Link::Answered => true,
        _ => {
            return DriverFailure::new(
                FailureKind::Other,
                format!("etcd error (code {code}): {message}"),
            );
        }
    };
    let kind = if lost_reply {
        FailureKind::ReplyLost
    } else {
        FailureKind::NotApplied
    };
    DriverFailure::new(kind, message)
}

/// What an overloaded etcd member answers (`ErrTooManyRequests`), before proposing.
const TOO_MANY_REQUESTS: &str = "too many requests";

/// What etcd answers to a write once its database reached its quota (`ErrNoSpace`).
const NO_SPACE: &str = "database space exceeded";

/// What etcd answers to a request whose auth token it does not know (expired, or issued
/// before the member restarted).
const INVALID_AUTH_TOKEN: &str = "invalid auth token";

/// Authentication and authorization failures. etcd reports a wrong password as
/// `InvalidArgument`, so the message is read as well as the code.
fn is_auth_failure(code: i32, message: &str) -> bool {
    const AUTH_MESSAGES: [&str; 4] = [
        "authentication failed",
        "user name is empty",
        "user name not found",
        "permission denied",
    ];
    code == UNAUTHENTICATED
        || code == PERMISSION_DENIED
        || (code == INVALID_ARGUMENT && AUTH_MESSAGES.iter().any(|m| message.contains(m)))
}

/// True when `error` proves the request never reached a member that could apply it, so it
/// may be sent to another member even if it is a write.
pub(crate) fn never_sent(error: &EtcdError) -> bool {
    match error {
        EtcdError::GRpcStatus(status) => never_sent_status(
            i32::from(status.code()),
            status.message(),
            Link::under(status),
        ),
        EtcdError::TransportError(_) => true,
        _ => false,
    }
}

/// `Unavailable` statuses that prove the request was never proposed: the client could not
/// connect, or the member it reached has no leader (etcd checks that before proposing).
fn never_sent_status(code: i32, message: &str, link: Link) -> bool {
    code == UNAVAILABLE
        && match link {
            Link::NotConnected => true,
            Link::Answered => message.contains("no leader"),
            Link::Broken => false,
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_status(code: i32, message: &str, link: Link, effect: Effect) -> LockError {
        classify_status(code, message, link).into_error(NAME, effect)
    }

    /// A transport error whose source is `io`, as the client library nests them.
    #[derive(Debug)]
    struct Transport(std::io::Error);

    impl std::fmt::Display for Transport {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("transport error")
        }
    }

    impl std::error::Error for Transport {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// A status built by the client over `cause`, or sent by the server when there is none.
    #[derive(Debug)]
    struct Status(Option<Transport>);

    impl std::fmt::Display for Status {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("status")
        }
    }

    impl std::error::Error for Status {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.0.as_ref().map(|t| t as _)
        }
    }

    #[test]
    fn a_write_whose_reply_was_lost_is_outcome_unknown_and_a_read_is_unavailable() {
        let write = from_status(
            UNAVAILABLE,
            "etcdserver: request timed out",
            Link::Answered,
            Effect::Write("acquire"),
        );
        assert!(matches!(
            write,
            LockError::OutcomeUnknown {
                operation: "acquire",
                ..
            }
        ));
        let read = from_status(
            UNAVAILABLE,
            "etcdserver: request timed out",
            Link::Answered,
            Effect::None,
        );
        assert!(matches!(read, LockError::Unavailable { .. }));
        let deadline = from_status(
            DEADLINE_EXCEEDED,
            "deadline",
            Link::Answered,
            Effect::Write("renew"),
        );
        assert!(matches!(deadline, LockError::OutcomeUnknown { .. }));
    }

    #[test]
    fn a_request_that_never_left_is_unavailable_even_for_a_write() {
        for (message, link) in [
            ("etcdserver: no leader", Link::Answered),
            ("tcp connect error: Connection refused", Link::NotConnected),
        ] {
            let e = from_status(UNAVAILABLE, message, link, Effect::Write("acquire"));
            assert!(
                matches!(e, LockError::Unavailable { .. }),
                "{message}: {e:?}"
            );
        }
    }

    #[test]
    fn rejected_credentials_are_a_configuration_error_that_is_not_retried() {
        let e = from_status(
            INVALID_ARGUMENT,
            "etcdserver: authentication failed, invalid user ID or password",
            Link::Answered,
            Effect::None,
        );
        assert!(matches!(&e, LockError::Config(m) if m.contains("credentials")));
        assert!(!e.is_retryable());
        assert!(matches!(
            from_status(
                PERMISSION_DENIED,
                "etcdserver: permission denied",
                Link::Answered,
                Effect::None
            ),
            LockError::Config(_)
        ));
    }

    #[test]
    fn an_expired_auth_token_is_retryable_and_nothing_was_applied() {
        let e = from_status(
            UNAUTHENTICATED,
            "etcdserver: invalid auth token",
            Link::Answered,
            Effect::Write("acquire"),
        );
        assert!(matches!(e, LockError::Unavailable { .. }), "{e:?}");
        assert!(e.is_retryable());
    }

    #[test]
    fn a_connection_broken_mid_call_is_retryable() {
        let e = from_status(
            UNKNOWN,
            "transport error",
            Link::Broken,
            Effect::Write("release"),
        );
        assert!(matches!(e, LockError::OutcomeUnknown { .. }));
        assert!(from_status(UNKNOWN, "transport error", Link::Broken, Effect::None).is_retryable());
    }

    #[test]
    fn a_connection_the_client_closed_under_the_call_is_retryable_whatever_the_code() {
        // What tonic makes of h2's GOAWAY(ENHANCE_YOUR_CALM, "too_many_internal_resets").
        let message = "h2 protocol error: http2 error";
        let write = from_status(
            RESOURCE_EXHAUSTED,
            message,
            Link::Broken,
            Effect::Write("renew"),
        );
        assert!(
            matches!(write, LockError::OutcomeUnknown { .. }),
            "{write:?}"
        );
        let read = from_status(RESOURCE_EXHAUSTED, message, Link::Broken, Effect::None);
        assert!(matches!(read, LockError::Unavailable { .. }), "{read:?}");
    }

    #[test]
    fn an_overloaded_member_applied_nothing_and_a_full_database_leaves_a_write_unknown() {
        let e = from_status(
            RESOURCE_EXHAUSTED,
            "etcdserver: too many requests",
            Link::Answered,
            Effect::Write("acquire"),
        );
        assert!(matches!(e, LockError::Unavailable { .. }), "{e:?}");
        assert!(e.is_retryable());
        let full = from_status(
            RESOURCE_EXHAUSTED,
            "etcdserver: mvcc: database space exceeded",
            Link::Answered,
            Effect::Write("acquire"),
        );
        // A write applied as the database filled is answered this way too.
        assert!(matches!(full, LockError::OutcomeUnknown { .. }), "{full:?}");
        assert!(full.to_string().contains("--quota-backend-bytes"), "{full}");
    }

    #[test]
    fn other_server_errors_are_backend_errors() {
        let e = from_status(
            INVALID_ARGUMENT,
            "etcdserver: too many operations in txn request",
            Link::Answered,
            Effect::None,
        );
        assert!(matches!(e, LockError::Backend { .. }));
    }

    #[test]
    fn the_connection_is_read_from_the_error_under_the_status_not_from_its_text() {
        let under = |kind| Link::under(&Status(Some(Transport(std::io::Error::from(kind)))));
        assert_eq!(under(ErrorKind::ConnectionRefused), Link::NotConnected);
        assert_eq!(under(ErrorKind::HostUnreachable), Link::NotConnected);
        assert_eq!(under(ErrorKind::ConnectionReset), Link::Broken);
        assert_eq!(under(ErrorKind::BrokenPipe), Link::Broken);
        assert_eq!(Link::under(&Status(None)), Link::Answered);
        // A server's reply that merely reads like a transport failure is the server's error.
        let e = from_status(UNKNOWN, "transport error", Link::Answered, Effect::None);
        assert!(matches!(e, LockError::Backend { .. }), "{e:?}");
    }
}
