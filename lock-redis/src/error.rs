//! How `redis` client errors become [`LockError`]s, without the store's types, free text
//! or credentials: refused credentials and bad URLs are `Config`, a server that refuses a
//! request for now or cannot be reached is `Unavailable`, and a write whose reply was lost
//! is `OutcomeUnknown`.

use lock_api::LockError;
use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::backend::NAME;

pub(crate) fn config_error(shown_url: &str, e: &RedisError) -> LockError {
    // The client library's message may quote the URL: only its kind is kept.
    LockError::Config(format!("invalid Redis URL {shown_url}: {}", e.category()))
}

pub(crate) fn connect_error(shown_url: &str, e: RedisError) -> LockError {
    if is_auth_error(&e) {
        return LockError::Config(format!(
            "{shown_url}: the server refused the credentials ({})",
            e.kind_name()
        ));
    }
    if let Some(tls) = crate::tls::tls_failure(&e) {
        // An untrusted certificate or a TLS/plain mismatch does not go away by retrying.
        return LockError::Config(format!("{shown_url}: TLS handshake failed: {tls}"));
    }
    LockError::unavailable(
        NAME,
        format!("cannot connect to {shown_url}: {}", e.kind_name()),
    )
}

/// True for the errors of a node that could not be asked or did not answer: a cluster
/// batch reports its items unreachable instead of failing as a whole.
pub(crate) fn is_unreachable(e: &RedisError) -> bool {
    !is_auth_error(e)
        && (e.is_connection_refusal()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_io_error()
            || is_refused_for_now(e))
}

/// True for the errors after which a release is tried again: it did not run (refused for
/// now), or its connection dropped and the store is asked whether it ran. Not a timeout:
/// a node that answers that slowly is not asked again.
pub(crate) fn is_resendable(e: &RedisError) -> bool {
    is_unreachable(e) && !e.is_timeout()
}

/// True for the errors of a request that did not run and may succeed later: no
/// connection to its cluster node, or a server that refuses it for now: a replica or a
/// demoted master (READONLY), a failover or resharding under way (MASTERDOWN,
/// CLUSTERDOWN, TRYAGAIN), a dataset being loaded (LOADING), a long script (BUSY), or
/// memory full (OOM). A script meets READONLY and OOM at its first write, so it has
/// changed nothing either.
pub(crate) fn is_refused_for_now(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ClusterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ) | ErrorKind::ClusterConnectionNotFound
    ) || e.code().is_some_and(|c| c == "BUSY" || c == "OOM")
}

fn is_auth_error(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm)
    ) || e.code().is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH")
}

/// Turns a client error into the public error, without the store's type or credentials.
pub(crate) fn map_error(operation: &'static str, changes_state: bool, e: &RedisError) -> LockError {
    if is_auth_error(e) {
        return LockError::Config(format!(
            "the Redis server refused the credentials ({})",
            e.kind_name()
        ));
    }
    if e.is_connection_refusal() {
        return LockError::unavailable(NAME, format!("{operation}: connection refused"));
    }
    if e.is_timeout() || e.is_connection_dropped() || e.is_io_error() {
        let message = format!("{operation}: connection lost ({e})");
        return if changes_state {
            LockError::OutcomeUnknown {
                backend: NAME,
                operation,
                message,
            }
        } else {
            LockError::unavailable(NAME, message)
        };
    }
    if is_refused_for_now(e) {
        return LockError::unavailable(NAME, format!("{operation}: {e}"));
    }
    LockError::backend(NAME, e.clone())
}

pub(crate) trait KindName {
    fn kind_name(&self) -> String;
}

impl KindName for RedisError {
    /// The error's category and code, never its free text (which may quote a URL).
    fn kind_name(&self) -> String {
        match self.code() {
            Some(code) => format!("{}: {code}", self.category()),
            None => self.category().to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use redis::Value;

    use super::*;

    fn server_error(reply: &str) -> RedisError {
        redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .and_then(Value::extract_error)
            .expect_err("an error reply")
    }

    #[test]
    fn transient_server_refusals_are_retryable_unavailable() {
        for reply in [
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "CLUSTERDOWN The cluster is down",
        ] {
            let err = map_error("acquire", true, &server_error(reply));
            assert!(
                matches!(err, LockError::Unavailable { .. }) && err.is_retryable(),
                "{reply}: {err:?}"
            );
        }
        let err = map_error("acquire", true, &server_error("ERR unknown command"));
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    }
}
