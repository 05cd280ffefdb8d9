//! A wall clock that tests can step, for server and client processes: [`ShiftedClock`]
//! and [`rerun_under`]. The shim they load is `harness/clock/shift.c`, built by
//! `harness/build.rs`.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::error::HarnessError;
use crate::temp::temp_dir;

/// The shim, built by `build.rs`. It is written next to each clock's state file, where the
/// `postgres` OS user can read it whatever the permissions of the target directory.
const SHIM: &[u8] = include_bytes!(env!("DISTLOCK_CLOCK_SHIM"));
/// The file name of the shim; also how a process tells that it runs under one.
const SHIM_NAME: &str = "libdistlock_clock.so";
/// The variable naming the state file, read by the shim in each process it is loaded in.
const STATE_VAR: &str = "DISTLOCK_CLOCK_FILE";
/// Two little-endian `i64`: `offset_ns`, then `frozen_at_ns` (0: not frozen).
const STATE_LEN: usize = 16;

/// A wall clock processes can run under, shifted from the real one and steppable while they
/// run.
///
/// It reads `real + offset` ([`step_back`](Self::step_back) and
/// [`step_forward`](Self::step_forward) move the offset), or stands still once
/// [frozen](Self::freeze). A server runs under it with the `clock` method of its builder,
/// any other command with [`envs`](Self::envs), a test with [`rerun_under`].
///
/// A process runs under the clock through `LD_PRELOAD` of a small shim that interposes
/// libc's `clock_gettime` (`CLOCK_REALTIME` and `CLOCK_REALTIME_COARSE` only),
/// `gettimeofday` and `time`. The shim maps the clock's state file shared, so a step
/// reaches running processes and the children they fork (PostgreSQL's backends) at once.
/// Monotonic clocks are untouched: timers, timeouts and `Instant` run on as before. The
/// shim does not reach a program that reads the clock without libc (a static binary, a Go
/// program such as etcd), a clock read inside libc (`timespec_get`), or an absolute
/// `CLOCK_REALTIME` deadline handed to the kernel (`sem_timedwait`,
/// `pthread_cond_timedwait` without a monotonic clock attribute), which the kernel
/// compares with its real clock.
///
/// The clock lives in a temp dir (the state file and a copy of the shim, readable by every
/// user) removed on drop, so it must outlive the processes started under it: those running
/// keep the clock they have, but a process started (or a server restarted) after the drop
/// runs on the real clock, and the dynamic loader prints that it could not preload the shim.
#[derive(Debug)]
pub struct ShiftedClock {
    state: File,
    path: PathBuf,
    shim: PathBuf,
    /// Steps of this process read, change and write the state one at a time.
    update: Mutex<()>,
    /// The temp dir of a clock made by [`ShiftedClock::new`]; `None` for
    /// [`ShiftedClock::of_this_process`], which must not remove it.
    _dir: Option<tempfile::TempDir>,
}

/// The state file's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    offset_ns: i64,
    frozen_at_ns: i64,
}

impl State {
    fn to_bytes(self) -> [u8; STATE_LEN] {
        let mut bytes = [0; STATE_LEN];
        bytes[..8].copy_from_slice(&self.offset_ns.to_le_bytes());
        bytes[8..].copy_from_slice(&self.frozen_at_ns.to_le_bytes());
        bytes
    }

    fn from_bytes(bytes: [u8; STATE_LEN]) -> Self {
        let [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = bytes;
        State {
            offset_ns: i64::from_le_bytes([a, b, c, d, e, f, g, h]),
            frozen_at_ns: i64::from_le_bytes([i, j, k, l, m, n, o, p]),
        }
    }

    /// The state after the clock moved by `by_ns` (negative: back); a frozen clock stays
    /// frozen at the moved reading.
    fn stepped(self, by_ns: i64) -> Option<Self> {
        let frozen_at_ns = match self.frozen_at_ns {
            0 => 0,
            at => at.checked_add(by_ns).filter(|&moved| moved > 0)?,
        };
        Some(State {
            offset_ns: self.offset_ns.checked_add(by_ns)?,
            frozen_at_ns,
        })
    }
}

impl ShiftedClock {
    /// A clock in a new temp dir that reads the real time (offset 0, not frozen).
    pub fn new() -> Result<Self, HarnessError> {
        let dir = temp_dir("distlock-clock-")?;
        set_mode(dir.path(), 0o755)?;
        let shim = dir.path().join(SHIM_NAME);
        std::fs::write(&shim, SHIM)
            .map_err(|e| HarnessError::io(format!("writing {}", shim.display()), e))?;
        set_mode(&shim, 0o644)?;
        let path = dir.path().join("state");
        let state = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| HarnessError::io(format!("creating {}", path.display()), e))?;
        set_mode(&path, 0o644)?;
        let clock = ShiftedClock {
            state,
            path,
            shim,
            update: Mutex::new(()),
            _dir: Some(dir),
        };
        clock.write(State {
            offset_ns: 0,
            frozen_at_ns: 0,
        })?;
        Ok(clock)
    }

    /// The clock this process runs under: `Some` when it was started with a clock's
    /// [`envs`](Self::envs) (as [`rerun_under`] does) and the shim is loaded, so that it
    /// can step its own clock and that of every process sharing it. Dropping it removes
    /// nothing.
    pub fn of_this_process() -> Option<ShiftedClock> {
        let (path, shim) = own_clock()?;
        let state = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        Some(ShiftedClock {
            state,
            path,
            shim,
            update: Mutex::new(()),
            _dir: None,
        })
    }

    /// Moves the clock back by `by`, adding to earlier steps; a frozen clock stands `by`
    /// earlier.
    pub fn step_back(&self, by: Duration) -> Result<(), HarnessError> {
        self.step(-nanos(by)?)
    }

    /// Moves the clock forward by `by`, adding to earlier steps; a frozen clock stands `by`
    /// later.
    pub fn step_forward(&self, by: Duration) -> Result<(), HarnessError> {
        self.step(nanos(by)?)
    }

    /// Stops the clock at its current reading: until [`thaw`](Self::thaw) every process
    /// under it reads that instant. Freezing a frozen clock leaves it where it stands.
    pub fn freeze(&self) -> Result<(), HarnessError> {
        let _update = self.update.lock();
        let state = self.read()?;
        if state.frozen_at_ns != 0 {
            return Ok(());
        }
        let frozen_at_ns = real_now_ns()?
            .checked_add(state.offset_ns)
            .filter(|&at| at > 0)
            .ok_or_else(|| self.out_of_range("freezing"))?;
        self.write(State {
            frozen_at_ns,
            ..state
        })
    }

    /// Lets a frozen clock run again from the real time plus the offset, as if it had never
    /// stood still: it jumps forward by however long it was frozen.
    pub fn thaw(&self) -> Result<(), HarnessError> {
        let _update = self.update.lock();
        let state = self.read()?;
        self.write(State {
            frozen_at_ns: 0,
            ..state
        })
    }

    /// The clock's current reading, as the processes under it read it.
    pub fn now(&self) -> Result<SystemTime, HarnessError> {
        let state = self.read()?;
        let ns = match state.frozen_at_ns {
            0 => real_now_ns()?.saturating_add(state.offset_ns),
            at => at,
        };
        Ok(system_time(ns))
    }

    /// The environment that runs a process under this clock: `LD_PRELOAD` (the shim) and
    /// `DISTLOCK_CLOCK_FILE` (the state file).
    pub fn envs(&self) -> Vec<(OsString, OsString)> {
        vec![
            ("LD_PRELOAD".into(), self.shim.clone().into()),
            (STATE_VAR.into(), self.path.clone().into()),
        ]
    }

    fn step(&self, by_ns: i64) -> Result<(), HarnessError> {
        let _update = self.update.lock();
        let state = self.read()?;
        let stepped = state
            .stepped(by_ns)
            .ok_or_else(|| self.out_of_range("stepping"))?;
        self.write(stepped)
    }

    fn read(&self) -> Result<State, HarnessError> {
        let mut bytes = [0; STATE_LEN];
        self.state
            .read_exact_at(&mut bytes, 0)
            .map_err(|e| HarnessError::io(format!("reading {}", self.path.display()), e))?;
        Ok(State::from_bytes(bytes))
    }

    /// One write of the whole state; the file keeps its length throughout (a shorter
    /// mapped file would crash its readers).
    fn write(&self, state: State) -> Result<(), HarnessError> {
        self.state
            .write_all_at(&state.to_bytes(), 0)
            .map_err(|e| HarnessError::io(format!("writing {}", self.path.display()), e))
    }

    fn out_of_range(&self, doing: &str) -> HarnessError {
        HarnessError::Setup(format!(
            "{doing} the clock of {} would take it out of range",
            self.path.display()
        ))
    }
}

/// Runs the test named `test` (its full path, e.g. `module::name`) of the current test
/// binary again in a child process under `clock`: the binary with `<test> --exact
/// --nocapture --include-ignored` and [`ShiftedClock::envs`]. Waits for it, blocking the
/// calling thread, and fails with its output unless that one test ran and passed.
///
/// Inside the child [`ShiftedClock::of_this_process`] is `Some`, which is how the test
/// tells the two runs apart. Processes the child starts inherit its environment, so they
/// run under the same clock unless given another. A process that was itself started under
/// a clock cannot re-run a test: were the shim not loaded in it, the test would take the
/// parent's branch again and again.
pub fn rerun_under(clock: &ShiftedClock, test: &str) -> Result<(), HarnessError> {
    if let Some(outer) = std::env::var_os(STATE_VAR) {
        let loaded = if own_clock().is_some() {
            "loaded"
        } else {
            "not loaded"
        };
        return Err(HarnessError::Setup(format!(
            "cannot re-run {test:?} under a clock from a process started under the clock {} \
             (the shim is {loaded} here)",
            Path::new(&outer).display()
        )));
    }
    let exe = std::env::current_exe()
        .map_err(|e| HarnessError::io("finding the current test binary", e))?;
    let args = [test, "--exact", "--nocapture", "--include-ignored"];
    let command = format!(
        "{} {} (under the clock {})",
        exe.display(),
        args.join(" "),
        clock.path.display()
    );
    let output = Command::new(&exe)
        .args(args)
        .envs(clock.envs())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError::io(format!("running {command}"), e))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(HarnessError::CommandFailed {
            command,
            status: output.status.to_string(),
            stderr: format!("{stdout}{stderr}"),
        });
    }
    if !stdout.contains("test result: ok. 1 passed") {
        return Err(HarnessError::Setup(format!(
            "{command} ran no test named {test:?}:\n{stdout}{stderr}"
        )));
    }
    Ok(())
}

/// The state file and the shim of the clock this process runs under: the file named by
/// `DISTLOCK_CLOCK_FILE` when the shim has mapped it (it maps it only when loaded).
fn own_clock() -> Option<(PathBuf, PathBuf)> {
    let path = PathBuf::from(std::env::var_os(STATE_VAR)?);
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mapped = |file: &Path| {
        maps.lines()
            .any(|line| line.ends_with(&*file.to_string_lossy()))
    };
    if !mapped(&path) {
        return None;
    }
    let shim = maps
        .lines()
        .filter_map(|line| line.find('/').map(|at| &line[at..]))
        .find(|file| file.ends_with(SHIM_NAME))?;
    Some((path, PathBuf::from(shim)))
}

/// The real wall clock, in nanoseconds since the epoch. In a process under a clock,
/// `SystemTime::now` reads that clock, so its offset is taken off again; it cannot be when
/// that clock is frozen.
fn real_now_ns() -> Result<i64, HarnessError> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|_| HarnessError::Setup("the wall clock reads before 1970".into()))?;
    let now = nanos(now)?;
    let Some(own) = ShiftedClock::of_this_process() else {
        return Ok(now);
    };
    let state = own.read()?;
    if state.frozen_at_ns != 0 {
        return Err(HarnessError::Setup(format!(
            "this process runs under the frozen clock {}, so it cannot read the real time",
            own.path.display()
        )));
    }
    Ok(now.saturating_sub(state.offset_ns))
}

fn nanos(d: Duration) -> Result<i64, HarnessError> {
    i64::try_from(d.as_nanos())
        .map_err(|_| HarnessError::Setup(format!("{d:?} does not fit the clock's state")))
}

fn system_time(ns: i64) -> SystemTime {
    let magnitude = Duration::from_nanos(ns.unsigned_abs());
    if ns >= 0 {
        UNIX_EPOCH + magnitude
    } else {
        UNIX_EPOCH - magnitude
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), HarnessError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| HarnessError::io(format!("chmod {mode:o} {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_is_two_little_endian_i64() {
        let state = State {
            offset_ns: -2,
            frozen_at_ns: 0x0102,
        };
        let bytes = state.to_bytes();
        assert_eq!(bytes[..8], [0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(bytes[8..], [0x02, 0x01, 0, 0, 0, 0, 0, 0]);
        assert_eq!(State::from_bytes(bytes), state);
    }

    #[test]
    fn steps_add_up_and_move_a_frozen_reading() {
        let running = State {
            offset_ns: 0,
            frozen_at_ns: 0,
        };
        let back = running.stepped(-5).unwrap().stepped(-7).unwrap();
        assert_eq!(back.offset_ns, -12);
        assert_eq!(back.frozen_at_ns, 0);
        let frozen = State {
            offset_ns: -12,
            frozen_at_ns: 100,
        };
        assert_eq!(
            frozen.stepped(10),
            Some(State {
                offset_ns: -2,
                frozen_at_ns: 110
            })
        );
        // 0 would mean "not frozen".
        assert_eq!(frozen.stepped(-100), None);
        assert_eq!(running.stepped(i64::MIN).unwrap().stepped(-1), None);
    }

    #[test]
    fn a_new_clock_is_readable_by_every_user_and_reads_real_time() {
        let clock = ShiftedClock::new().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(clock.path.parent().unwrap()), 0o755);
        assert_eq!(mode(&clock.path), 0o644);
        assert_eq!(mode(&clock.shim), 0o644);
        assert_eq!(std::fs::read(&clock.shim).unwrap(), SHIM);
        assert_eq!(std::fs::read(&clock.path).unwrap(), [0; STATE_LEN]);
        let skew = clock
            .now()
            .unwrap()
            .duration_since(SystemTime::now())
            .unwrap_or_else(|e| e.duration());
        assert!(skew < Duration::from_secs(1), "{skew:?}");

        let dir = clock.path.parent().unwrap().to_path_buf();
        drop(clock);
        assert!(!dir.exists());
    }
}
