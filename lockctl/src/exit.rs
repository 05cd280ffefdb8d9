//! lockctl's exit statuses: one per kind of outcome, so that a script can tell "the store
//! said no" from "the command was wrong" from "try again".

use std::process::ExitCode;

use distlock::LockError;

/// The EXIT STATUS section of every command's help.
pub const HELP: &str = "\
Exit status:
  0  done: the lock was taken or released, the role has a leader, every case passed,
     the report was written
  1  the answer is no: the lock is held by another (acquire), not held by that owner and
     token (release), nobody leads (leader), a case failed (check), a measurement failed
     (bench)
  2  wrong input, nothing sent or changed: an unknown option, a bad key, TTL or URL, a
     store whose feature is off, credentials the store refused, a command this store
     cannot do
  3  the store could not be reached or did not answer in time: try again (an acquire cut
     off that way may hold the lock until its TTL runs out)
  4  the store failed the request (a server error)";

/// The answer is no (see [`HELP`]).
pub fn no() -> ExitCode {
    ExitCode::from(1)
}

/// Wrong input (see [`HELP`]).
pub fn wrong() -> ExitCode {
    ExitCode::from(2)
}

/// The exit status of a command that ended with `error`.
pub fn of(error: &LockError) -> ExitCode {
    match error {
        LockError::InvalidKey { .. }
        | LockError::InvalidTtl { .. }
        | LockError::Config(_)
        | LockError::Unsupported { .. }
        | LockError::ForeignLease { .. } => wrong(),
        LockError::Timeout { .. } => ExitCode::from(3),
        e if e.is_retryable() => ExitCode::from(3),
        _ => ExitCode::from(4),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_kind_of_error_has_its_status() {
        let key = distlock::LockKey::new("k").unwrap();
        for (error, code) in [
            (LockError::invalid_ttl(Duration::ZERO, "zero"), 2),
            (LockError::Config("bad url".into()), 2),
            (LockError::unavailable("redis", "connection refused"), 3),
            (
                LockError::Timeout {
                    key,
                    waited: Duration::from_secs(1),
                },
                3,
            ),
            (LockError::backend("redis", "ERR"), 4),
        ] {
            assert_eq!(of(&error), ExitCode::from(code), "{error:?}");
        }
    }
}
