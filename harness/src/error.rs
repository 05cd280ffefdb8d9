//! [`HarnessError`], everything that can go wrong while starting, probing or controlling a
//! test server, and [`require`], which turns one into a test failure.

use std::time::Duration;

/// Everything that can go wrong while starting, probing or controlling a test server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// A server or client binary is not installed.
    #[error(
        "`{name}` was not found on PATH or in the expected directories; \
         install the Debian package `{hint}` (apt-get install -y {hint})"
    )]
    MissingBinary {
        /// The binary that was looked for, e.g. `redis-server`.
        name: String,
        /// The Debian package that provides it, e.g. `redis-server`.
        hint: String,
    },
    /// An I/O operation failed (creating a directory, spawning, connecting...).
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A server did not pass its readiness probe before the deadline.
    #[error("{what} did not become ready within {waited:?}: {detail}")]
    NotReady {
        /// The server, e.g. `redis-server on 127.0.0.1:40001`.
        what: String,
        /// How long the harness waited.
        waited: Duration,
        /// The last probe failure.
        detail: String,
    },
    /// A server process exited while the harness expected it to run.
    #[error("{what} exited unexpectedly ({status}); last log lines:\n{log}")]
    Exited {
        /// The server.
        what: String,
        /// The exit status.
        status: String,
        /// The tail of the server's log file.
        log: String,
    },
    /// A helper command (`redis-cli`, `initdb`, `psql`, ...) failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// The exit status.
        status: String,
        /// Its standard error (and standard output when stderr was empty).
        stderr: String,
    },
    /// An operation against a server took too long (for example, the server is paused).
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// The operation.
        what: String,
        /// The time limit that was exceeded.
        after: Duration,
    },
    /// A client library (`redis`, `etcd-client`) failed to reach a server or had a request
    /// refused.
    #[error("{what}: {source}")]
    Client {
        /// The server and the operation.
        what: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A server answered something the harness did not expect.
    #[error("unexpected reply from {what}: {detail}")]
    Protocol {
        /// The server or operation.
        what: String,
        /// What was wrong with the reply.
        detail: String,
    },
    /// Sending a signal to a server failed.
    #[error("sending {signal} to {what} failed: {source}")]
    Signal {
        /// The server.
        what: String,
        /// The signal name.
        signal: String,
        /// The OS error.
        #[source]
        source: nix::errno::Errno,
    },
    /// The harness was used in a way it does not support, or the machine lacks something
    /// (no free port, no `postgres` OS user, a process that is not running...).
    #[error("{0}")]
    Setup(String),
}

impl HarnessError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        HarnessError::Io {
            context: context.into(),
            source,
        }
    }

    #[cfg(any(feature = "redis", feature = "etcd"))]
    pub(crate) fn client(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HarnessError::Client {
            what: what.into(),
            source: Box::new(source),
        }
    }
}

/// Unwraps a harness result in a test, panicking with a clear message otherwise.
///
/// This is the "fail, never skip" policy: a missing server binary makes the test fail with
/// the name of the Debian package to install.
#[track_caller]
pub fn require<T>(r: Result<T, HarnessError>) -> T {
    match r {
        Ok(v) => v,
        Err(HarnessError::MissingBinary { name, hint }) => panic!(
            "harness: required binary `{name}` is missing: install the Debian package \
             `{hint}` (apt-get install -y {hint}). The conformance suite fails instead of \
             skipping when a server is missing."
        ),
        Err(e) => panic!("harness: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "apt-get install -y etcd-server")]
    fn require_panics_with_the_package_name() {
        require::<()>(Err(HarnessError::MissingBinary {
            name: "etcd".into(),
            hint: "etcd-server".into(),
        }));
    }
}
