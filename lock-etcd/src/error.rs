//! Turns `etcd-client` errors into [`LockError`]s.
//!
//! The one question that matters for a lock is whether a request may have taken effect.
//! A request that never left (no connection, no leader) is [`LockError::Unavailable`]. A
//! write whose reply was lost (a timeout after sending, a connection that broke mid-call,
//! etcd's own "request timed out") is [`LockError::OutcomeUnknown`], because etcd may still
//! commit it. Rejected credentials are [`LockError::Config`]: retrying cannot fix them. An
//! expired auth token is not a rejected credential: the client authenticates again.

use etcd_client::Error as EtcdError;
use lock_api::LockError;

pub(crate) const NAME: &str = "etcd";

// gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html), compared as
// integers so that no gRPC type leaks into this crate's dependencies.
const CANCELLED: i32 = 1;
const UNKNOWN: i32 = 2;
const INVALID_ARGUMENT: i32 = 3;
const NOT_FOUND: i32 = 5;
const DEADLINE_EXCEEDED: i32 = 4;
const PERMISSION_DENIED: i32 = 7;
const INTERNAL: i32 = 13;
const UNAVAILABLE: i32 = 14;
const UNAUTHENTICATED: i32 = 16;

/// Whether the failed call could have changed the store.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Effect {
    /// A read, or a write whose loss leaves no lock behind (granting an unused lease).
    None,
    /// A write to a lock key or a lease that holds one.
    Write(&'static str),
}

/// The error for a call that did not answer within the request timeout.
pub(crate) fn timed_out(effect: Effect, after: std::time::Duration) -> LockError {
    let message = format!("no reply within the request timeout of {after:?}");
    match effect {
        Effect::None => LockError::unavailable(NAME, message),
        Effect::Write(operation) => LockError::OutcomeUnknown {
            backend: NAME,
            operation,
            message,
        },
    }
}

/// Converts an `etcd-client` error, knowing what the failed call could have changed.
pub(crate) fn convert(error: EtcdError, effect: Effect) -> LockError {
    match error {
        EtcdError::GRpcStatus(status) => {
            from_status(i32::from(status.code()), status.message(), effect)
        }
        // Building the channel or connecting failed: nothing was sent.
        EtcdError::TransportError(e) => {
            LockError::unavailable(NAME, format!("cannot connect: {e}"))
        }
        EtcdError::IoError(e) => LockError::unavailable(NAME, format!("I/O error: {e}")),
        EtcdError::InvalidUri(e) => LockError::Config(format!("invalid etcd endpoint: {e}")),
        EtcdError::InvalidArgs(e) | EtcdError::EndpointError(e) => {
            LockError::Config(format!("invalid etcd client settings: {e}"))
        }
        other => LockError::backend(NAME, other),
    }
}

fn from_status(code: i32, message: &str, effect: Effect) -> LockError {
    if message.contains(INVALID_AUTH_TOKEN) {
        // An expired token, still refused after the client authenticated again and resent
        // the call (another call may have raced it): etcd checks the token before proposing,
        // so nothing was applied, and the next call authenticates afresh.
        return LockError::unavailable(NAME, format!("the auth token expired: {message}"));
    }
    if is_auth_failure(code, message) {
        return LockError::Config(format!(
            "etcd refused the credentials (check the user name and password, and that the \
             user may access the key prefix): {message}"
        ));
    }
    if code == NOT_FOUND && message.contains("lease not found") {
        // A put on a lease that expired in the meantime: etcd refused the whole request.
        return LockError::unavailable(
            NAME,
            format!("the lease expired before the request reached etcd: {message}"),
        );
    }
    let lost_reply = match code {
        CANCELLED | DEADLINE_EXCEEDED => true,
        UNAVAILABLE => !never_sent_message(message),
        // The client library reports a connection that broke mid-call this way.
        UNKNOWN | INTERNAL if is_broken_connection(message) => true,
        _ => return LockError::backend(NAME, format!("etcd error (code {code}): {message}")),
    };
    match effect {
        Effect::Write(operation) if lost_reply => LockError::OutcomeUnknown {
            backend: NAME,
            operation,
            message: message.to_owned(),
        },
        _ => LockError::unavailable(NAME, message.to_owned()),
    }
}

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

/// Errors of the HTTP/2 transport under a call: the connection was reset or closed.
fn is_broken_connection(message: &str) -> bool {
    const BROKEN: [&str; 5] = [
        "transport error",
        "h2 protocol error",
        "connection reset",
        "broken pipe",
        "connection closed",
    ];
    let message = message.to_ascii_lowercase();
    BROKEN.iter().any(|m| message.contains(m))
}

/// True when `error` proves the request never reached a member that could apply it, so it
/// may be sent to another member even if it is a write.
pub(crate) fn never_sent(error: &EtcdError) -> bool {
    match error {
        EtcdError::GRpcStatus(status) => {
            i32::from(status.code()) == UNAVAILABLE && never_sent_message(status.message())
        }
        EtcdError::TransportError(_) => true,
        _ => false,
    }
}

/// `Unavailable` errors that prove the request was never proposed: the client could not
/// connect, or the member it reached has no leader (etcd checks that before proposing).
fn never_sent_message(message: &str) -> bool {
    const NOT_SENT: [&str; 5] = [
        "no leader",
        "error trying to connect",
        "tcp connect error",
        "Connection refused",
        "connection refused",
    ];
    NOT_SENT.iter().any(|m| message.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_whose_reply_was_lost_is_outcome_unknown_and_a_read_is_unavailable() {
        let write = from_status(
            UNAVAILABLE,
            "etcdserver: request timed out",
            Effect::Write("acquire"),
        );
        assert!(matches!(
            write,
            LockError::OutcomeUnknown {
                operation: "acquire",
                ..
            }
        ));
        let read = from_status(UNAVAILABLE, "etcdserver: request timed out", Effect::None);
        assert!(matches!(read, LockError::Unavailable { .. }));
        let deadline = from_status(DEADLINE_EXCEEDED, "deadline", Effect::Write("renew"));
        assert!(matches!(deadline, LockError::OutcomeUnknown { .. }));
    }

    #[test]
    fn a_request_that_never_left_is_unavailable_even_for_a_write() {
        for message in [
            "etcdserver: no leader",
            "tcp connect error: Connection refused",
        ] {
            let e = from_status(UNAVAILABLE, message, Effect::Write("acquire"));
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
            Effect::None,
        );
        assert!(matches!(&e, LockError::Config(m) if m.contains("credentials")));
        assert!(!e.is_retryable());
        assert!(matches!(
            from_status(
                PERMISSION_DENIED,
                "etcdserver: permission denied",
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
            Effect::Write("acquire"),
        );
        assert!(matches!(e, LockError::Unavailable { .. }), "{e:?}");
        assert!(e.is_retryable());
    }

    #[test]
    fn a_connection_broken_mid_call_is_retryable() {
        let e = from_status(UNKNOWN, "transport error", Effect::Write("release"));
        assert!(matches!(e, LockError::OutcomeUnknown { .. }));
        assert!(from_status(UNKNOWN, "transport error", Effect::None).is_retryable());
    }

    #[test]
    fn other_server_errors_are_backend_errors() {
        let e = from_status(
            INVALID_ARGUMENT,
            "etcdserver: too many operations in txn request",
            Effect::None,
        );
        assert!(matches!(e, LockError::Backend { .. }));
    }
}
