//! The worker processes of a run and the faults the nemesis gives them: each worker is
//! this program again (`lockctl torture-worker`), its standard output read line by line
//! into the run's history; a pause is SIGSTOP then SIGCONT, a kill is SIGKILL and a new
//! process in its place.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use super::event::{Event, now};
use super::fault::{Fault, FaultKind};
use super::worker::WorkerArgs;

/// One event and who reported it: the worker's place and which of its processes.
#[derive(Clone, Debug)]
pub struct Record {
    pub worker: u32,
    pub incarnation: u32,
    pub event: Event,
}

/// What the run counts as the events come in, for its progress line.
#[derive(Debug, Default)]
pub struct Counts {
    pub grants: AtomicU64,
    pub writes: AtomicU64,
    pub refused: AtomicU64,
    pub errors: AtomicU64,
}

/// The history every worker's reader appends to.
#[derive(Debug, Default)]
pub struct History {
    pub records: Mutex<Vec<Record>>,
    /// What the nemesis did to the workers and the store, in the order done; the deaths
    /// of the processes it killed are taken from it.
    pub faults: Mutex<Vec<Fault>>,
    pub counts: Counts,
}

impl History {
    fn push(&self, record: Record) {
        let counts = &self.counts;
        match &record.event {
            Event::Grant { .. } => counts.grants.fetch_add(1, Ordering::Relaxed),
            Event::Step { admitted: true, .. } => counts.writes.fetch_add(1, Ordering::Relaxed),
            Event::Step { .. } => counts.refused.fetch_add(1, Ordering::Relaxed),
            Event::Error { .. } => counts.errors.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        self.records.lock().push(record);
    }

    /// Notes that the nemesis did `kind` at `at`.
    pub fn fault(&self, at: u64, kind: FaultKind) {
        self.faults.lock().push(Fault { at, kind });
    }
}

/// One running worker process.
struct Slot {
    child: Child,
    incarnation: u32,
    reader: JoinHandle<()>,
    paused: bool,
}

/// The run's worker processes.
pub struct Workers {
    args: WorkerArgs,
    slots: Vec<Slot>,
    history: Arc<History>,
    started: u32,
}

impl Workers {
    /// Starts `count` workers with `args` (each with its own seed).
    pub fn start(args: WorkerArgs, count: u32, history: Arc<History>) -> std::io::Result<Self> {
        let mut workers = Self {
            args,
            slots: Vec::new(),
            history,
            started: 0,
        };
        for worker in 0..count {
            let slot = workers.spawn(worker, 0)?;
            workers.slots.push(slot);
        }
        Ok(workers)
    }

    /// How many worker places there are.
    pub fn len(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether worker `worker` is paused.
    pub fn is_paused(&self, worker: u32) -> bool {
        self.slots[worker as usize].paused
    }

    fn spawn(&mut self, worker: u32, incarnation: u32) -> std::io::Result<Slot> {
        let args = &self.args;
        let mut command = Command::new(std::env::current_exe()?);
        command
            .arg("torture-worker")
            .args(["--url", &args.url, "--ledger", &args.ledger])
            .args(["--prefix", &args.prefix])
            .args(["--keys", &args.keys.to_string()])
            .args(["--ttl", &humantime::format_duration(args.ttl).to_string()])
            .args(["--steps", &args.steps.to_string()])
            .args([
                "--step-time",
                &humantime::format_duration(args.step_time).to_string(),
            ])
            .args([
                "--seed",
                &args.seed.wrapping_add(u64::from(self.started)).to_string(),
            ]);
        if let Some(bug) = args.r#break {
            use clap::ValueEnum;
            if let Some(value) = bug.to_possible_value() {
                command.args(["--break", value.get_name()]);
            }
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        self.started += 1;
        let stdout = child.stdout.take().ok_or_else(|| {
            std::io::Error::other("the worker's standard output was not captured")
        })?;
        let history = self.history.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // A line cut off by a kill is not an event; the rest are.
                if let Ok(event) = serde_json::from_str(&line) {
                    history.push(Record {
                        worker,
                        incarnation,
                        event,
                    });
                }
            }
        });
        Ok(Slot {
            child,
            incarnation,
            reader,
            paused: false,
        })
    }

    fn signal(&self, worker: u32, signal: Signal) {
        if let Some(pid) = self.slots[worker as usize].child.id() {
            // A worker that already exited has nothing to stop or continue.
            let _ = kill(Pid::from_raw(pid as i32), signal);
        }
    }

    /// Stops worker `worker` where it is (SIGSTOP).
    pub fn pause(&mut self, worker: u32) {
        let (at, incarnation) = (now(), self.slots[worker as usize].incarnation);
        self.signal(worker, Signal::SIGSTOP);
        self.slots[worker as usize].paused = true;
        let kind = FaultKind::Pause {
            worker,
            incarnation,
        };
        self.history.fault(at, kind);
    }

    /// Lets a paused worker go on (SIGCONT).
    pub fn resume(&mut self, worker: u32) {
        let (at, incarnation) = (now(), self.slots[worker as usize].incarnation);
        self.signal(worker, Signal::SIGCONT);
        self.slots[worker as usize].paused = false;
        let kind = FaultKind::Resume {
            worker,
            incarnation,
        };
        self.history.fault(at, kind);
    }

    /// Kills worker `worker` (SIGKILL), whatever it holds, and starts a new process in
    /// its place.
    pub async fn kill_and_restart(&mut self, worker: u32) -> std::io::Result<()> {
        let slot = &mut self.slots[worker as usize];
        let at = now();
        slot.child.start_kill()?;
        slot.child.wait().await?;
        let kind = FaultKind::Kill {
            worker,
            incarnation: slot.incarnation,
        };
        self.history.fault(at, kind);
        let incarnation = slot.incarnation + 1;
        let at = now();
        let replacement = self.spawn(worker, incarnation)?;
        let kind = FaultKind::Restart {
            worker,
            incarnation,
        };
        self.history.fault(at, kind);
        let old = std::mem::replace(&mut self.slots[worker as usize], replacement);
        // What the killed process wrote before it died is still read to the end.
        let _ = old.reader.await;
        Ok(())
    }

    /// A worker that exited on its own (it is only told to stop at the end), with its
    /// status: its setup failed, and it said why on standard error.
    pub fn exited(&mut self) -> std::io::Result<Option<(u32, std::process::ExitStatus)>> {
        for (worker, slot) in self.slots.iter_mut().enumerate() {
            if let Some(status) = slot.child.try_wait()? {
                return Ok(Some((worker as u32, status)));
            }
        }
        Ok(None)
    }

    /// Ends the run: resumes every paused worker, closes every worker's standard input
    /// (each finishes its critical section and exits), waits up to `patience` for them,
    /// kills the rest, and reads every worker's output to its end. Returns how many had
    /// to be killed.
    pub async fn stop(mut self, patience: std::time::Duration) -> u32 {
        for worker in 0..self.len() {
            if self.is_paused(worker) {
                self.resume(worker);
            }
            drop(self.slots[worker as usize].child.stdin.take());
        }
        let deadline = tokio::time::Instant::now() + patience;
        let mut killed = 0;
        for (worker, slot) in self.slots.iter_mut().enumerate() {
            if tokio::time::timeout_at(deadline, slot.child.wait())
                .await
                .is_err()
            {
                let kind = FaultKind::KillAtEnd {
                    worker: worker as u32,
                    incarnation: slot.incarnation,
                };
                self.history.fault(now(), kind);
                let _ = slot.child.start_kill();
                let _ = slot.child.wait().await;
                killed += 1;
            }
        }
        for slot in self.slots {
            let _ = slot.reader.await;
        }
        killed
    }
}
