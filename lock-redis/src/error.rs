//! How `redis` client errors become [`LockError`]s, without the store's types, free text
//! or credentials: refused credentials and bad URLs are `Config`, a server that refuses a
//! request for now or cannot be reached is `Unavailable`, and a write whose reply was lost
//! is `OutcomeUnknown`.

use distlock_core::{DriverFailure, Effect, FailureKind, LockError};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// The backend's name, in its errors and leases.
pub(crate) const NAME: &str = "redis";

pub(crate) fn config_error(shown_url: &str, e: &RedisError) -> LockError {
    // The client library's message may quote the URL: only its kind is kept.
    LockError::Config(format!("invalid Redis URL {shown_url}: {}", e.category()))
}

pub(crate) fn connect_error(shown_url: &str, e: RedisError) -> LockError {
    // The client library's text about a connection may quote its URL: only the operating
    // system's error is kept as the source.
    classify_connect(shown_url, &e).into_error(NAME, Effect::None)
}

/// What a failure to connect was: nothing was sent.
fn classify_connect(shown_url: &str, e: &RedisError) -> DriverFailure {
    if is_auth_error(e) {
        return DriverFailure::new(
            FailureKind::Config,
            format!(
                "{shown_url}: the server refused the credentials ({})",
                e.kind_name()
            ),
        );
    }
    // Sentinels that monitor no master by the URL's name (see `conn/sentinel.rs`).
    if let Some(unknown) = e
        .detail()
        .filter(|d| e.kind() == ErrorKind::InvalidClientConfig && d.contains("no master named"))
    {
        return DriverFailure::new(FailureKind::Config, format!("{shown_url}: {unknown}"));
    }
    if let Some(tls) = crate::tls::tls_failure(e) {
        // An untrusted certificate or a TLS/plain mismatch does not go away by retrying.
        return DriverFailure::new(
            FailureKind::Config,
            format!("{shown_url}: TLS handshake failed: {tls}"),
        );
    }
    // The operating system's reason (connection refused, no route...) says what to fix;
    // its text holds no credentials, so it is shown and kept as the source. redis-rs keeps
    // it behind an `Arc` as the error's source.
    let io = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>())
        .and_then(|inner| inner.downcast_ref::<std::io::Error>());
    match io {
        Some(io) => DriverFailure::new(
            FailureKind::NotApplied,
            format!("cannot connect to {shown_url}: {io}"),
        )
        .with_source(std::io::Error::new(io.kind(), io.to_string())),
        None => DriverFailure::new(
            FailureKind::NotApplied,
            format!("cannot connect to {shown_url}: {}", e.kind_name()),
        ),
    }
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

/// `NOPERM`: the user's ACL does not allow the command (or the key, or the channel).
pub(crate) fn is_no_permission(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Server(ServerErrorKind::NoPerm))
}

/// A script's command refused by the user's ACL: `NOPERM`, or the error reply a script's
/// `redis.call` gets for a command the user lacks on servers that do not say `NOPERM`
/// there ("The user executing the script can't run this command or subcommand").
pub(crate) fn is_refused_in_script(e: &RedisError) -> bool {
    is_no_permission(e)
        || e.detail()
            .is_some_and(|d| d.contains("can't run this command or subcommand"))
}

fn is_auth_error(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm)
    ) || e.code().is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH")
}

/// Turns a client error into the public error, without the store's type or credentials.
pub(crate) fn map_error(operation: &'static str, effect: Effect, e: &RedisError) -> LockError {
    classify(operation, e).into_error(NAME, effect)
}

/// Whether a write that failed with `e` may have written: anything but a refusal before it
/// ran ([`LockError::Unavailable`]). Besides a lost reply, an error can stop a script part
/// way (a key of another type, a key the user may not write), and the script keeps what it
/// wrote before it: the attempts of a multi-key call so stopped are given back by owner id,
/// as those of a call whose reply was lost.
pub(crate) fn may_have_written(e: &LockError) -> bool {
    !matches!(e, LockError::Unavailable { .. })
}

/// What a failed request's error says about it. The client error is kept as the source
/// where its text was already shown (I/O errors and server replies); a refused
/// connection's text may name the node's URL, so it is left out.
fn classify(operation: &'static str, e: &RedisError) -> DriverFailure {
    if is_auth_error(e) {
        return DriverFailure::new(
            FailureKind::Config,
            format!(
                "the Redis server refused the credentials ({})",
                e.kind_name()
            ),
        );
    }
    if e.is_connection_refusal() {
        return DriverFailure::new(
            FailureKind::NotApplied,
            format!("{operation}: connection refused"),
        );
    }
    let failure = if e.is_timeout() || e.is_connection_dropped() || e.is_io_error() {
        DriverFailure::new(
            FailureKind::ReplyLost,
            format!("{operation}: connection lost ({e})"),
        )
    } else if is_refused_for_now(e) {
        DriverFailure::new(FailureKind::NotApplied, format!("{operation}: {e}"))
    } else {
        DriverFailure::new(FailureKind::Other, e.to_string())
    };
    failure.with_source(e.clone())
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

/// The error a server's `-<reply>` makes, as a request would return it.
#[cfg(test)]
pub(crate) fn server_error(reply: &str) -> RedisError {
    redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
        .and_then(redis::Value::extract_error)
        .expect_err("an error reply")
}

#[cfg(test)]
mod tests {
    use super::*;

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
            let err = map_error("acquire", Effect::Write("acquire"), &server_error(reply));
            assert!(
                matches!(err, LockError::Unavailable { .. }) && err.is_retryable(),
                "{reply}: {err:?}"
            );
        }
        let err = map_error(
            "acquire",
            Effect::Write("acquire"),
            &server_error("ERR unknown command"),
        );
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    }
}
