//! One server process owned by the harness: spawn, signal (whole process group), kill,
//! restart with the same command line, and kill + reap on drop.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;

use crate::error::HarnessError;
use crate::probe::Probe;

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
    /// Processes of the tree killed last time; a restart waits until they are gone.
    killed: Vec<u32>,
    /// How the process ended on its own, once reaped (by whichever call saw it first), for
    /// [`ManagedProcess::check_alive`] to report with its log: a server that could not
    /// bind its port says so there, and a start is retried on that.
    exited: Option<String>,
}

/// A server process in its own process group (pgid == pid). Signals reach the whole tree:
/// the group and every descendant, also those that left the group (PostgreSQL backends
/// call `setsid`).
#[derive(Debug)]
pub(crate) struct ManagedProcess {
    spec: Spec,
    state: Mutex<State>,
}

/// How long `pause()` waits for every thread of the tree to be stopped.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

impl ManagedProcess {
    /// Spawns the process described by `spec`.
    pub fn spawn(spec: Spec) -> Result<Self, HarnessError> {
        let child = start(&spec)?;
        Ok(ManagedProcess {
            spec,
            state: Mutex::new(State {
                child: Some(child),
                paused: false,
                killed: Vec::new(),
                exited: None,
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

    fn leader(&self, st: &mut State, sig: Signal) -> Result<u32, HarnessError> {
        reap_if_exited(st);
        st.child.as_ref().map(Child::id).ok_or_else(|| {
            HarnessError::Setup(format!(
                "cannot send {sig} to {}: it is not running",
                self.spec.what
            ))
        })
    }

    fn signal_error(&self, sig: Signal, source: nix::errno::Errno) -> HarnessError {
        HarnessError::Signal {
            what: self.spec.what.clone(),
            signal: sig.to_string(),
            source,
        }
    }

    /// `SIGSTOP` to the whole tree; returns once every thread of it is stopped.
    pub fn pause(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        let leader = self.leader(&mut st, Signal::SIGSTOP)?;
        st.paused = true;
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        loop {
            // The group first: a stopped parent neither forks nor reaps, so the descendant
            // pids read next stay valid.
            killpg(Pid::from_raw(leader as i32), Signal::SIGSTOP)
                .map_err(|e| self.signal_error(Signal::SIGSTOP, e))?;
            let tree = process_tree(leader);
            for &pid in &tree {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGSTOP);
            }
            if tree.iter().all(|&pid| all_threads_stopped(pid)) {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err(HarnessError::Setup(format!(
                    "{} did not stop within {STOP_TIMEOUT:?} after SIGSTOP",
                    self.spec.what
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `SIGCONT` to the whole tree.
    pub fn resume(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        let leader = self.leader(&mut st, Signal::SIGCONT)?;
        for pid in process_tree(leader) {
            if pid != leader {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
            }
        }
        killpg(Pid::from_raw(leader as i32), Signal::SIGCONT)
            .map_err(|e| self.signal_error(Signal::SIGCONT, e))?;
        st.paused = false;
        Ok(())
    }

    /// `SIGKILL` to the whole tree, then reaps the leader. Killing a process that is not
    /// running is not an error.
    pub fn kill(&self) -> Result<(), HarnessError> {
        let mut st = self.state.lock();
        kill_and_reap(&mut st, &self.spec.what)
    }

    /// Kills the process if it runs, waits until every process of its old tree is gone,
    /// then starts the same command line again.
    pub async fn respawn(&self) -> Result<(), HarnessError> {
        let killed = {
            let mut st = self.state.lock();
            kill_and_reap(&mut st, &self.spec.what)?;
            std::mem::take(&mut st.killed)
        };
        // Killed children (PostgreSQL backends) may still be exiting while they hold shared
        // memory or a port. Bounded wait.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while killed.iter().any(|&pid| is_live(pid)) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let child = start(&self.spec)?;
        let mut st = self.state.lock();
        st.child = Some(child);
        st.paused = false;
        st.exited = None;
        Ok(())
    }

    /// A readiness probe step: fails fatally when the process has exited, with its exit
    /// status and the end of its log, even when another call (a probe asking for the pid)
    /// reaped it first.
    pub fn check_alive<T>(&self) -> Option<Probe<T>> {
        let mut st = self.state.lock();
        reap_if_exited(&mut st);
        if st.child.is_some() {
            return None;
        }
        Some(Probe::Fatal(match st.exited.clone() {
            Some(status) => HarnessError::Exited {
                what: self.spec.what.clone(),
                status,
                log: log_tail(&self.spec.log),
            },
            None => HarnessError::Setup(format!("{} is not running", self.spec.what)),
        }))
    }

    /// The last lines of the process log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.spec.log)
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        let mut st = self.state.lock();
        let _ = kill_and_reap(&mut st, "");
        if let Some(mut child) = st.child.take() {
            // kill_and_reap failed half-way: make sure the leader at least is gone.
            let _ = child.kill();
            let _ = child.wait();
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
    let exited = match st.child.as_mut().map(Child::try_wait) {
        None | Some(Ok(None)) => return,
        Some(Ok(Some(status))) => status.to_string(),
        Some(Err(e)) => format!("unknown (waiting for it failed: {e})"),
    };
    st.child = None;
    st.paused = false;
    st.exited = Some(exited);
}

fn kill_and_reap(st: &mut State, what: &str) -> Result<(), HarnessError> {
    reap_if_exited(st);
    let Some(child) = st.child.as_mut() else {
        return Ok(());
    };
    let leader = child.id();
    let pgid = Pid::from_raw(leader as i32);
    let signal_error = |source| HarnessError::Signal {
        what: what.to_string(),
        signal: "SIGKILL".into(),
        source,
    };
    // Freeze the group so nothing forks or reaps while the tree is read, then kill it all.
    killpg(pgid, Signal::SIGSTOP).map_err(signal_error)?;
    let tree = process_tree(leader);
    for &pid in &tree {
        if pid != leader {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
    }
    killpg(pgid, Signal::SIGKILL).map_err(signal_error)?;
    child
        .wait()
        .map_err(|e| HarnessError::io(format!("waiting for {what} to exit"), e))?;
    st.child = None;
    st.paused = false;
    st.killed = tree;
    Ok(())
}

/// One line of `/proc/PID/stat`: (state, ppid, pgrp).
fn proc_stat(path: &str) -> Option<(char, u32, u32)> {
    let stat = std::fs::read_to_string(path).ok()?;
    // "pid (comm) state ppid pgrp ..." — comm may contain spaces, so split after ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, ppid, pgrp))
}

/// Every live process in `leader`'s process group plus every descendant of any of them,
/// leader included.
fn process_tree(leader: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![leader];
    };
    let procs: Vec<(u32, u32, u32)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let (_, ppid, pgrp) = proc_stat(&format!("/proc/{pid}/stat"))?;
            Some((pid, ppid, pgrp))
        })
        .collect();
    let mut tree: Vec<u32> = procs
        .iter()
        .filter(|&&(pid, _, pgrp)| pgrp == leader || pid == leader)
        .map(|&(pid, _, _)| pid)
        .collect();
    if !tree.contains(&leader) {
        tree.push(leader);
    }
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        for &(pid, ppid, _) in &procs {
            if ppid == parent && !tree.contains(&pid) {
                tree.push(pid);
            }
        }
        i += 1;
    }
    tree
}

/// True when every thread of `pid` is stopped (or the process is gone or a zombie).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        let path = task.path().join("stat");
        match path.to_str().and_then(proc_stat) {
            Some((state, _, _)) => matches!(state, 'T' | 't' | 'Z' | 'X'),
            None => true,
        }
    })
}

/// True when `pid` exists and is not a zombie.
fn is_live(pid: u32) -> bool {
    matches!(proc_stat(&format!("/proc/{pid}/stat")), Some((state, _, _)) if !matches!(state, 'Z' | 'X'))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::is_port_clash;

    /// A server that could not bind its port exits at once; a probe asking for its pid
    /// reaps it before the next liveness check. That check must still report the exit
    /// with the log, which names the port clash the start is retried on; it used to say
    /// only "not running", and a loaded workspace run failed a Redis case that way.
    #[test]
    fn an_exit_reaped_by_a_pid_query_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let spec = Spec {
            what: "a server that cannot bind".into(),
            program: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "echo 'bind: Address already in use'; exit 1".into(),
            ],
            envs: Vec::new(),
            cwd: dir.path().to_path_buf(),
            user: None,
            log: dir.path().join("server.log"),
        };
        let process = ManagedProcess::spawn(spec).unwrap();
        // A hang guard: `sh` exits as soon as it has written its line.
        let started = std::time::Instant::now();
        while process.pid().is_some() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the shell did not exit"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        match process.check_alive::<()>() {
            Some(Probe::Fatal(e)) => assert!(
                is_port_clash(&e),
                "the exit reported without the log's port clash: {e}"
            ),
            Some(_) => panic!("an exited process reported as not fatal"),
            None => panic!("an exited process reported alive"),
        }
    }
}
