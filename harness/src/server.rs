//! What every test server shares, whatever it runs: one process group started on free
//! loopback ports in its own temp dir, paused, resumed and killed by signals, started again
//! with the same command line, and killed and removed on drop.
//!
//! [`Server<K>`] holds that lifecycle once. The kind `K` ([`crate::postgres::Postgres`],
//! and behind their features `redis::Redis` and `etcd::Etcd`) adds its ports and options,
//! and the probe that tells when it serves; each server type is an alias, e.g.
//! `RedisServer = Server<Redis>`.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::error::HarnessError;
use crate::ports::loopback;
use crate::probe::{Probe, wait_until_ready};
use crate::process::{ManagedProcess, Spec};

/// What a kind of server adds to [`Server`]: its client port, and how to tell that a
/// started process serves.
pub trait ServerKind: fmt::Debug + Send + Sync + Sized + 'static {
    /// How long a start or restart may take until the server serves.
    const READY_TIMEOUT: Duration;
    /// The pause between two readiness probes.
    const PROBE_INTERVAL: Duration;

    /// The port clients connect to.
    fn client_port(&self) -> u16;

    /// One readiness probe of the running process: `Ok` once it serves (and is the process
    /// the harness started, not another that took its port), else why not yet.
    fn probe(server: &Server<Self>) -> impl Future<Output = Result<(), String>> + Send;

    /// What the killed server left outside its directory, removed before the directory
    /// is (on drop). Nothing by default.
    fn clean_up_after_kill(&self, _dir: &Path) {}
}

/// A test server process on 127.0.0.1 with its own temp dir; killed and removed on drop.
#[derive(Debug)]
pub struct Server<K: ServerKind> {
    // Field order matters: the process is killed before the directory is removed.
    process: ManagedProcess,
    kind: K,
    dir: tempfile::TempDir,
}

impl<K: ServerKind> Drop for Server<K> {
    fn drop(&mut self) {
        // The process first (the field's own drop would kill it next, after this), then
        // what it left outside its directory; the directory goes with the field.
        let _ = self.process.kill();
        self.kind.clean_up_after_kill(self.dir.path());
    }
}

impl<K: ServerKind> Server<K> {
    /// Spawns `spec` as a server of `kind` living in `dir`; it does not wait until it serves.
    pub(crate) fn spawn(spec: Spec, kind: K, dir: tempfile::TempDir) -> Result<Self, HarnessError> {
        Ok(Server {
            process: ManagedProcess::spawn(spec)?,
            kind,
            dir,
        })
    }

    /// Waits until the kind's probe passes; fails at once when the process exits.
    pub(crate) async fn wait_ready(&self) -> Result<(), HarnessError> {
        wait_until_ready(
            self.what(),
            K::READY_TIMEOUT,
            K::PROBE_INTERVAL,
            || async move {
                if let Some(fatal) = self.process.check_alive() {
                    return fatal;
                }
                match K::probe(self).await {
                    Ok(()) => Probe::Ready(()),
                    Err(why) => Probe::NotYet(why),
                }
            },
        )
        .await
    }

    /// The kind's ports and options.
    pub(crate) fn kind(&self) -> &K {
        &self.kind
    }

    /// The server's name in errors, e.g. `redis-server on 127.0.0.1:40001`.
    pub(crate) fn what(&self) -> &str {
        self.process.what()
    }

    /// `127.0.0.1:PORT` of the client port, for example as the upstream of a
    /// [`crate::proxy::FaultProxy`].
    pub fn addr(&self) -> SocketAddr {
        loopback(self.kind.client_port())
    }

    /// The pid of the running server process, `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The server's temp directory (its data, and its log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Freezes every process of the server with `SIGSTOP`: open connections stay open and
    /// hang, nothing is answered. Returns once every thread is stopped (a few milliseconds;
    /// blocks the caller).
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.process.pause()
    }

    /// Continues a paused server with `SIGCONT`.
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.process.resume()
    }

    /// Kills every process of the server with `SIGKILL` (no shutdown of its own) and
    /// waits for it to exit.
    pub fn kill(&self) -> Result<(), HarnessError> {
        self.process.kill()
    }

    /// Starts the server again with the same command line: the same ports, directory and
    /// options (killing it first if it still runs), and waits until it serves. What
    /// survives depends on the kind: see its server type.
    pub async fn restart(&self) -> Result<(), HarnessError> {
        self.process.respawn().await?;
        self.wait_ready().await
    }

    /// True while the process runs (also while paused).
    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// True while the server is paused.
    pub fn is_paused(&self) -> bool {
        self.process.is_paused()
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}
