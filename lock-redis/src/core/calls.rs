//! The pieces of a script call that need nothing of the connection: the arguments of a
//! lease call, how a batch's items are grouped into multi-key calls and how the replies of
//! those calls are spread back over the items, and what an acquire sent twice answers.

use distlock_core::Lease;
use redis::{ErrorKind, RedisError, RedisResult, Value};
use tracing::debug;

use crate::conn::{Call, reply_error};
use crate::error::KindName;
use crate::scripts::Lua;

/// What a lease call sends besides the value the lease holds its key with.
#[derive(Clone, Copy)]
pub(crate) enum Extra {
    /// The lease's TTL in milliseconds (renewals).
    Ttl,
    /// The lease's token, and the high-water key as a second key (fence checks).
    Token,
    /// Nothing per lease, and after the leases the announcing command
    /// ([`super::Core::announce_arg`]): releases.
    Release,
}

/// `<owner id>:<token>`, what the lock key holds while `lease` holds it, and the argument
/// `extra` adds after it, if any.
pub(crate) fn lease_args(lease: &Lease, extra: Extra) -> (String, Option<String>) {
    let token = lease.token().get();
    let value = format!("{}:{token}", lease.owner());
    match extra {
        Extra::Ttl => (value, Some(lease.ttl().as_millis().to_string())),
        Extra::Token => (value, Some(token.to_string())),
        Extra::Release => (value, None),
    }
}

/// The reply of an acquire sent again after its first send's connection dropped. The first
/// send may have run: an error of the second (refused for now, no connection, LOADING or
/// READONLY on a server met after a restart or a switchover) says only that the second did
/// not run, so the first send's error stands, an unknown outcome, and the caller cleans up
/// what the first may have taken.
pub(crate) fn resent<T>(first: RedisError, again: redis::RedisResult<T>) -> redis::RedisResult<T> {
    again.map_err(|e| {
        debug!(error = %e.kind_name(), "the acquire sent again failed too; its outcome is unknown");
        first
    })
}

/// One multi-key call per group: `item(i, keys, args)` adds item `i`'s keys and arguments.
pub(crate) fn grouped_calls(
    script: &'static Lua,
    groups: &[Vec<usize>],
    mut item: impl FnMut(usize, &mut Vec<String>, &mut Vec<Vec<u8>>),
) -> Vec<Call> {
    groups
        .iter()
        .map(|group| {
            let mut keys = Vec::with_capacity(group.len());
            let mut args = Vec::with_capacity(group.len() * 2);
            for &i in group {
                item(i, &mut keys, &mut args);
            }
            Call { script, keys, args }
        })
        .collect()
}

/// One reply per item from the replies of the grouped calls: a call's array is split over
/// its items (an error inside it is its item's own); a call's error is each of its items' error.
pub(crate) fn spread(
    groups: &[Vec<usize>],
    replies: Vec<RedisResult<Value>>,
    items: usize,
) -> Vec<RedisResult<Value>> {
    let mut out: Vec<Option<RedisResult<Value>>> = (0..items).map(|_| None).collect();
    for (group, reply) in groups.iter().zip(replies) {
        match reply.and_then(reply_error) {
            Ok(Value::Array(values)) if values.len() == group.len() => {
                for (&i, value) in group.iter().zip(values) {
                    out[i] = Some(value.extract_error());
                }
            }
            other => {
                let e = other.err().unwrap_or_else(|| {
                    RedisError::from((ErrorKind::Client, "a batch script sent a malformed reply"))
                });
                for &i in group {
                    out[i] = Some(Err(e.clone()));
                }
            }
        }
    }
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(RedisError::from((ErrorKind::Client, "no reply")))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{map_error, server_error};
    use distlock_core::{Effect, LockError};

    /// Whatever stops the resend, the first send may have run: the acquire's outcome is
    /// unknown (so its caller cleans up), never `Unavailable`.
    #[test]
    fn a_resend_that_fails_leaves_the_first_sends_outcome_unknown() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "test"));
        for again in [
            io(std::io::ErrorKind::ConnectionRefused),
            server_error("LOADING Redis is loading the dataset in memory"),
            server_error("READONLY You can't write against a read only replica."),
            server_error("BUSY Redis is busy running a script."),
            server_error("MASTERDOWN Link with MASTER is down"),
        ] {
            let alone = map_error("acquire", Effect::Write("acquire"), &again);
            assert!(matches!(alone, LockError::Unavailable { .. }), "{alone:?}");
            let first = io(std::io::ErrorKind::BrokenPipe);
            let e = resent::<()>(first, Err(again)).expect_err("the resend failed");
            let e = map_error("acquire", Effect::Write("acquire"), &e);
            assert!(matches!(e, LockError::OutcomeUnknown { .. }), "{e:?}");
        }
        let first = io(std::io::ErrorKind::BrokenPipe);
        assert_eq!(resent(first, Ok(7)).unwrap(), 7);
    }
}
