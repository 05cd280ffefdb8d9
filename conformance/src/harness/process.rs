//! One server process owned by the harness: spawn, signal (whole process group), kill,
//! restart with the same command line, and kill + reap on drop.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;

use super::{HarnessError, Probe};

/// How to (re)start a server process.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    /// Human-readable name used in errors, e.g. `redis-server on 127.0.0.1:40001`.
    pub what: String,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub envs: Vec<(OsString, OsString)>,
    pub cwd: PathBuf,
    /// Run as this uid/gid (used for PostgreSQL when the tests run as root).
    pub user: Option<(u32, u32)>,
    /// stdout and stderr are appended to this file.
    pub log: PathBuf,
}

#[derive(Debug)]
struct State {
    /// The child, while it has not been reaped. Once reaped its pid may be reused, so it is
    /// never signalled again.
    child: Option<Child>,
    paused: bool,
}

/// A server process in its own process group (pgid == pid).
#[derive(Debug)]
pub(crate) struct ManagedProcess {
    spec: Spec,
    state: Mutex<State>,
}

impl ManagedProcess {
    /// Spawns the process described by `spec`.
    pub fn spawn(spec: Spec) -> Result<Self, HarnessError> {
        let child = start(&spec)?;
        Ok(ManagedProcess {
            spec,
            state: Mutex::new(State {
                child: Some(child),
                paused: false,
            }),
        })
    }

    pub fn what(&self) -> &str {
        &self.spec.what
    }

    /// The pid of the running (not yet reaped) process.
    pub fn pid(&self) -> Option<u32> {
        let mut st = self.state.lock();
        reap_if_exited(&mut st);
        st.child.as_ref().map(Child::id)
    }

    /// True while the process runs (a paused process is running).
    pub fn is_running(&self) -> bool {
        self.pid().is_some()
    }

    pub fn is_paused(&self) -> bool {
        let st = self.state.lock();
        st.child.is_some() && st.paused
    }

    fn signal(&self, st: &mut State, sig: Signal) -> Result<(), HarnessError> {
        reap_if_exited(st);
        let Some(child) = st.child.as_ref() else {
            return Err(HarnessError::Setup(format!(
                "cannot send {sig} to {}: it is not running",
                self.spec.what
            )));
        };
        let pgid = Pid::from_raw(child.id() as i32);
        killpg(pgid, sig).map_err(|source| HarnessError::Signal {
            what: self.spec.what.clone(),
            signal: sig.to_string(),
            source,
        })
    }

    /// `SIGSTOP` to the whole process group.
    pub fn pause(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        self.signal(&mut st, Signal::SIGSTOP)?;
        st.paused = true;
        Ok(())
    }

    /// `SIGCONT` to the whole process group.
    pub fn resume(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        self.signal(&mut st, Signal::SIGCONT)?;
        st.paused = false;
        Ok(())
    }

    /// `SIGKILL` to the whole process group, then reaps the group leader. Killing a process
    /// that is not running is not an error.
    pub fn kill(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        kill_and_reap(&mut st, &self.spec.what)
    }

    /// Kills the process if it runs, waits until every process of its old group is gone,
    /// then starts the same command line again.
    pub async fn respawn(&self) -> Result<(), HarnessError> {
        let old_pgid = {
            let mut st = self.state.lock();
            let pgid = st.child.as_ref().map(Child::id);
            kill_and_reap(&mut st, &self.spec.what)?;
            pgid
        };
        if let Some(pgid) = old_pgid {
            // Forked children (PostgreSQL backends) may still be exiting; they hold the
            // shared memory and the port. Bounded wait.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while group_alive(pgid) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let child = start(&self.spec)?;
        let mut st = self.state.lock();
        st.child = Some(child);
        st.paused = false;
        Ok(())
    }

    /// A readiness probe step: fails fatally when the process has exited.
    pub fn check_alive<T>(&self) -> Option<Probe<T>> {
        let mut st = self.state.lock();
        let Some(child) = st.child.as_mut() else {
            return Some(Probe::Fatal(HarnessError::Setup(format!(
                "{} is not running",
                self.spec.what
            ))));
        };
        match child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) => {
                st.child = None;
                Some(Probe::Fatal(HarnessError::Exited {
                    what: self.spec.what.clone(),
                    status: status.to_string(),
                    log: log_tail(&self.spec.log),
                }))
            }
            Err(e) => Some(Probe::Fatal(HarnessError::io(
                format!("checking whether {} runs", self.spec.what),
                e,
            ))),
        }
    }

    /// The last lines of the process log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.spec.log)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        let mut st = self.state.lock();
        if let Some(child) = st.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                let _ = child.kill();
                let _ = child.wait();
            }
            st.child = None;
        }
    }
}

fn start(spec: &Spec) -> Result<Child, HarnessError> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)
        .map_err(|e| HarnessError::io(format!("opening log file {}", spec.log.display()), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| HarnessError::io("duplicating the log file handle", e))?;
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.envs.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .process_group(0);
    if let Some((uid, gid)) = spec.user {
        cmd.uid(uid).gid(gid);
    }
    cmd.spawn().map_err(|e| {
        HarnessError::io(
            format!("spawning {} ({})", spec.what, spec.program.display()),
            e,
        )
    })
}

fn reap_if_exited(st: &mut State) {
    let exited = match st.child.as_mut() {
        Some(child) => !matches!(child.try_wait(), Ok(None)),
        None => false,
    };
    if exited {
        st.child = None;
        st.paused = false;
    }
}

fn kill_and_reap(st: &mut State, what: &str) -> Result<(), HarnessError> {
    reap_if_exited(st);
    if let Some(mut child) = st.child.take() {
        st.paused = false;
        let pgid = Pid::from_raw(child.id() as i32);
        killpg(pgid, Signal::SIGKILL).map_err(|source| HarnessError::Signal {
            what: what.to_string(),
            signal: "SIGKILL".into(),
            source,
        })?;
        child
            .wait()
            .map_err(|e| HarnessError::io(format!("waiting for {what} to exit"), e))?;
    }
    Ok(())
}

/// True when a live (non-zombie) process in process group `pgid` exists.
fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            return false;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        // "pid (comm) state ppid pgrp ..." — comm may contain spaces, so split after ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|s| s.parse::<u32>().ok());
        pgrp == Some(pgid) && state != Some("Z") && state != Some("X")
    })
}

/// The last ~40 lines (at most 8 KiB) of a log file.
pub(crate) fn log_tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(8 * 1024);
    let mut buf = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err() || file.read_to_end(&mut buf).is_err() {
        return format!("(unreadable log at {})", path.display());
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
