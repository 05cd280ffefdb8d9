//! Real-server test harness: starts `redis-server`, `etcd` and PostgreSQL on free loopback
//! ports, each in its own temporary directory, and a TCP fault proxy, for the conformance
//! suite, the backend tests and the benchmarks.
//!
//! Nothing here relies on a service that is already running. Every server:
//!
//! * binds `127.0.0.1` only, on a port picked by [`free_port`] (or [`free_port_with_bus`]
//!   for Redis Cluster nodes, whose cluster bus listens on `port + 10000`);
//! * gets its own [`tempfile::TempDir`], removed when the server value is dropped;
//! * runs in its own process group, and `pause()` / `resume()` / `kill()` reach every process
//!   of the server's tree (PostgreSQL forks one backend per connection, each in its own
//!   session); `pause()` returns only once every thread of the tree is stopped;
//! * is checked to be *this* server when probed (Redis `process_id`, etcd peer URL,
//!   PostgreSQL socket in its own dir), and is started again on fresh ports when another
//!   process took its port first;
//! * is killed with `SIGKILL` and reaped when its value is dropped (also on a test panic,
//!   which unwinds). A test process that is itself `SIGKILL`ed leaves its servers running:
//!   there is no safe way to ask the kernel for a parent-death signal without `unsafe`.
//!
//! # Missing servers fail, they never skip
//!
//! When a server binary is missing, the start functions return
//! [`HarnessError::MissingBinary`], which names the Debian package to install. Tests call
//! [`require`] on the result, which panics with that message: the suite fails instead of
//! quietly skipping a backend.
//!
//! ```no_run
//! # async fn demo() {
//! use harness::postgres::PostgresServer;
//! let postgres = harness::require(PostgresServer::start().await);
//! println!("{}", postgres.url());
//! # }
//! ```
//!
//! Nothing in the harness panics except [`require`], which exists to turn an error into a
//! test failure; every other failure is a [`HarnessError`].
//!
//! Each server type is a [`Server`] of its kind (`PostgresServer = Server<Postgres>`), which
//! holds that lifecycle once: start, pid, pause, resume, kill, restart, stop on drop.
//!
//! # Clients
//!
//! The harness talks to its servers with real clients: the `redis` crate, `etcd-client`,
//! and PostgreSQL's own tools (`initdb`, `psql`). Each client library is behind a cargo
//! feature, so a crate compiles only what it uses:
//!
//! * `redis`: the module `redis` (single nodes, replicas, TLS, clusters);
//! * `etcd`: the module `etcd` (single members, 3-member clusters, TLS, auth); building
//!   `etcd-client` needs `protoc` (Debian package `protobuf-compiler`).
//!
//! [`postgres`], [`pgbouncer`] and [`proxy`] need no feature.
//!
//! # A wall clock tests can step
//!
//! [`ShiftedClock`] runs servers (the `clock` method of their builders) and client
//! processes ([`rerun_under`]) with their wall clock shifted or frozen, and steps it while
//! they run; monotonic clocks are untouched.

mod clock;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod pgbouncer;
pub mod postgres;
mod process;
pub mod proxy;
#[cfg(feature = "redis")]
pub mod redis;
mod server;

pub use clock::{ShiftedClock, rerun_under};
pub use server::{Server, ServerKind};

use std::collections::HashSet;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

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

/// Ports handed out by this process, so that two servers started at the same time never
/// get the same port from [`free_port`].
fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Returns a TCP port on 127.0.0.1 that is free right now.
///
/// The port is found by binding `127.0.0.1:0` and closing the listener, so another process
/// could take it before the server binds it; the harness never hands out the same port
/// twice within one process, which removes the races between parallel tests.
pub fn free_port() -> Result<u16, HarnessError> {
    for _ in 0..100 {
        let listener = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| HarnessError::io("binding 127.0.0.1:0 to find a free port", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("reading the local address of a listener", e))?
            .port();
        drop(listener);
        if handed_out().lock().insert(port) {
            return Ok(port);
        }
    }
    Err(HarnessError::Setup(
        "no free port on 127.0.0.1 after 100 attempts".into(),
    ))
}

/// Returns a free port `p` on 127.0.0.1 such that `p + 10000` is free too, as a Redis
/// Cluster node needs for its cluster bus.
pub fn free_port_with_bus() -> Result<u16, HarnessError> {
    for _ in 0..200 {
        let port = free_port()?;
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if port_is_free(bus) && handed_out().lock().insert(bus) {
            return Ok(port);
        }
    }
    Err(HarnessError::Setup(
        "no free port p on 127.0.0.1 with p + 10000 also free after 200 attempts".into(),
    ))
}

/// The first line of `<binary> --version` for the binary the harness would start (found
/// as [`find_binary`] finds it, PostgreSQL's in [`postgres::pg_bin_dir`]), for reports of
/// where something was measured: `not installed` or `unknown` when it cannot be told.
pub fn binary_version(binary: &str) -> String {
    let pg_bin: Vec<PathBuf> = postgres::pg_bin_dir().into_iter().collect();
    let Ok(path) = find_binary(binary, &pg_bin) else {
        return "not installed".into();
    };
    std::process::Command::new(path)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_owned())
        })
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The Debian package that provides `binary`, used in [`HarnessError::MissingBinary`].
pub fn apt_package_for(binary: &str) -> &'static str {
    match binary {
        "redis-server" => "redis-server",
        "redis-sentinel" => "redis-sentinel",
        "redis-cli" => "redis-tools",
        "etcd" => "etcd-server",
        "etcdctl" => "etcd-client",
        "psql" | "pg_isready" => "postgresql-client-15",
        "postgres" | "initdb" | "pg_ctl" => "postgresql-15",
        "protoc" => "protobuf-compiler",
        "pgbouncer" => "pgbouncer",
        _ => "the package providing it",
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Finds an executable named `name`, first in `extra_dirs` (in order), then on `PATH`.
///
/// Returns [`HarnessError::MissingBinary`] with the Debian package name as the hint when it
/// is found nowhere.
pub fn find_binary(name: &str, extra_dirs: &[PathBuf]) -> Result<PathBuf, HarnessError> {
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    extra_dirs
        .iter()
        .chain(path_dirs.iter())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| HarnessError::MissingBinary {
            name: name.to_string(),
            hint: apt_package_for(name).to_string(),
        })
}

/// The outcome of one readiness probe, for [`wait_until_ready`].
#[derive(Debug)]
pub enum Probe<T> {
    /// Ready, with a value.
    Ready(T),
    /// Not ready yet, with a description of why.
    NotYet(String),
    /// Will never become ready: stop waiting with this error.
    Fatal(HarnessError),
}

/// What a probe of [`wait_until_ready`] may answer: a [`Probe`], or `Result<T, String>`
/// (`Ok` ready, `Err` not ready yet, with why).
pub trait ProbeOutcome {
    /// The value a ready probe gives.
    type Value;

    /// This answer as a [`Probe`].
    fn into_probe(self) -> Probe<Self::Value>;
}

impl<T> ProbeOutcome for Probe<T> {
    type Value = T;

    fn into_probe(self) -> Probe<T> {
        self
    }
}

impl<T> ProbeOutcome for Result<T, String> {
    type Value = T;

    fn into_probe(self) -> Probe<T> {
        match self {
            Ok(v) => Probe::Ready(v),
            Err(e) => Probe::NotYet(e),
        }
    }
}

/// Polls `probe` every `interval` until it is ready, or fails with
/// [`HarnessError::NotReady`] (carrying the last probe's reason) once `timeout` has
/// passed; a probe that answers [`Probe::Fatal`] ends the wait at once with its error.
///
/// Each probe call is itself cut off at the deadline, so a probe that hangs (a paused
/// server) cannot make this wait longer than `timeout`.
pub async fn wait_until_ready<F, Fut>(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut probe: F,
) -> Result<<Fut::Output as ProbeOutcome>::Value, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output: ProbeOutcome>,
{
    let start = Instant::now();
    let deadline = start + timeout;
    let mut last = String::from("no probe finished");
    loop {
        match tokio::time::timeout_at(deadline, probe())
            .await
            .map(ProbeOutcome::into_probe)
        {
            Ok(Probe::Ready(v)) => return Ok(v),
            Ok(Probe::NotYet(e)) => last = e,
            Ok(Probe::Fatal(e)) => return Err(e),
            Err(_) => last = format!("the last probe was still running at the deadline ({last})"),
        }
        if Instant::now() + interval >= deadline {
            return Err(HarnessError::NotReady {
                what: what.to_string(),
                waited: start.elapsed(),
                detail: last,
            });
        }
        tokio::time::sleep(interval).await;
    }
}

/// The loopback socket address for `port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

/// How many times a server start is retried with fresh ports when its port was taken
/// between [`free_port`] and the server's own bind (another process on the machine).
pub(crate) const START_ATTEMPTS: usize = 3;

/// Runs `start` (which picks fresh ports each time) again while it fails because another
/// process took a port first, at most [`START_ATTEMPTS`] times in all.
pub(crate) async fn start_on_free_ports<T, F, Fut>(mut start: F) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, HarnessError>>,
{
    let mut attempt = 1;
    loop {
        match start().await {
            Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
            result => return result,
        }
    }
}

/// True when `e` says the server could not bind its port because it was taken.
pub(crate) fn is_port_clash(e: &HarnessError) -> bool {
    match e {
        HarnessError::Exited { log, .. } => log.to_lowercase().contains("address already in use"),
        _ => false,
    }
}

/// Creates a temporary directory under `/tmp` (every user can traverse it) with `prefix`.
pub(crate) fn temp_dir(prefix: &str) -> Result<tempfile::TempDir, HarnessError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .map_err(|e| HarnessError::io(format!("creating a temp dir {prefix}* under /tmp"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_bindable() {
        let a = free_port().unwrap();
        let b = free_port().unwrap();
        assert_ne!(a, b);
        assert!(port_is_free(a));
        let c = free_port_with_bus().unwrap();
        assert!(c <= u16::MAX - 10_000);
        assert!(port_is_free(c) && port_is_free(c + 10_000));
    }

    #[test]
    fn missing_binary_names_the_package() {
        let err = find_binary("redis-cli-does-not-exist", &[]).unwrap_err();
        assert!(matches!(err, HarnessError::MissingBinary { .. }));
        let err = HarnessError::MissingBinary {
            name: "etcd".into(),
            hint: apt_package_for("etcd").into(),
        };
        assert!(err.to_string().contains("etcd-server"), "{err}");
        assert_eq!(apt_package_for("redis-cli"), "redis-tools");
        assert!(find_binary("sh", &[]).is_ok());
        // extra dirs come first
        let dir = temp_dir("distlock-find-").unwrap();
        let fake = dir.path().join("sh");
        std::fs::write(&fake, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            find_binary("sh", &[dir.path().to_path_buf()]).unwrap(),
            fake
        );
    }

    #[test]
    fn port_clashes_are_recognised_from_server_logs() {
        let exited = |log: &str| HarnessError::Exited {
            what: "server".into(),
            status: "exit status: 1".into(),
            log: log.into(),
        };
        for log in [
            "# Warning: Could not create server TCP listening socket 127.0.0.1:42779: bind: Address already in use",
            "etcdmain: listen tcp 127.0.0.1:42779: bind: address already in use",
            "LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use",
        ] {
            assert!(is_port_clash(&exited(log)), "{log}");
        }
        assert!(!is_port_clash(&exited(
            "FATAL: data directory has wrong ownership"
        )));
        assert!(!is_port_clash(&HarnessError::Setup(
            "address already in use".into()
        )));
    }

    #[test]
    #[should_panic(expected = "apt-get install -y etcd-server")]
    fn require_panics_with_the_package_name() {
        require::<()>(Err(HarnessError::MissingBinary {
            name: "etcd".into(),
            hint: "etcd-server".into(),
        }));
    }

    #[tokio::test]
    async fn wait_until_ready_times_out_with_the_last_error() {
        let started = Instant::now();
        let mut calls = 0u32;
        let err = wait_until_ready(
            "nothing",
            Duration::from_millis(300),
            Duration::from_millis(20),
            || {
                calls += 1;
                let n = calls;
                async move { Err::<(), _>(format!("attempt {n}")) }
            },
        )
        .await
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        match err {
            HarnessError::NotReady { detail, .. } => assert!(detail.starts_with("attempt ")),
            other => panic!("unexpected {other}"),
        }
        assert!(calls > 3);

        let mut n = 0;
        let v = wait_until_ready(
            "counter",
            Duration::from_secs(5),
            Duration::from_millis(1),
            || {
                n += 1;
                let n = n;
                async move {
                    if n >= 3 {
                        Ok(n)
                    } else {
                        Err("not yet".to_string())
                    }
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn a_hanging_probe_is_cut_at_the_deadline() {
        let started = Instant::now();
        let err = wait_until_ready(
            "hang",
            Duration::from_millis(200),
            Duration::from_millis(10),
            || async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok::<(), String>(())
            },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, HarnessError::NotReady { .. }));
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
