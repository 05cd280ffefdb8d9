//! One run: payouts pushed to the queue, worker processes started, the faults made to
//! happen, and what the ledger shows counted.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use apalis_core::backend::TaskSink;
use apalis_redis::RedisStorage;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Child;
use tokio::time::Instant;

use crate::ledger::Ledger;
use crate::worker::PAUSED_CALL;
use crate::{BoxError, Payout, queue_config};

/// How big a run is.
#[derive(Clone, Debug)]
pub struct Options {
    /// Payouts `1..=jobs`, each to be made once.
    pub jobs: i64,
    /// Worker processes.
    pub workers: u32,
    /// Whether the workers run their jobs under the lock layer.
    pub locked: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            jobs: 12,
            workers: 3,
            locked: true,
        }
    }
}

/// What the ledger shows after a run.
#[derive(Debug, Default)]
pub struct Report {
    /// Whether the jobs ran under the lock layer.
    pub locked: bool,
    /// Payouts to make.
    pub jobs: i64,
    /// Jobs pushed to the queue (some twice).
    pub pushed: usize,
    /// Deliveries that reached the job (the lock held, or no lock).
    pub deliveries: i64,
    /// Payouts made.
    pub made: i64,
    /// Jobs paid more than once: must be empty under the layer.
    pub paid_twice: Vec<i64>,
    /// Jobs never paid: must be empty.
    pub unpaid: Vec<i64>,
    /// Payout calls refused for a stale fencing token.
    pub stale_rejected: i64,
    /// Payout calls absorbed by the idempotency key.
    pub absorbed: i64,
    /// Deliveries that found the job's lock held and went back to the queue.
    pub lock_busy: i64,
    /// Jobs stopped because their lease was lost.
    pub lease_lost: i64,
    /// The job whose payout call was paused past its lease.
    pub paused_job: i64,
    /// What that call came to once its process was resumed (`applied`, `stale_rejected`,
    /// `absorbed`).
    pub paused_call: String,
    /// The job whose payer was killed before its ack.
    pub killed_job: i64,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = if self.locked {
            "under the lock layer, fenced"
        } else {
            "without the lock layer"
        };
        writeln!(
            f,
            "{how}: {} payouts, {} jobs pushed, {} deliveries ran",
            self.jobs, self.pushed, self.deliveries
        )?;
        writeln!(f, "  payouts made:                      {}", self.made)?;
        writeln!(
            f,
            "  paid twice:                        {:?}",
            self.paid_twice
        )?;
        writeln!(f, "  unpaid:                            {:?}", self.unpaid)?;
        writeln!(
            f,
            "  stale calls rejected (fencing):    {}",
            self.stale_rejected
        )?;
        writeln!(f, "  repeats absorbed (idempotency):    {}", self.absorbed)?;
        writeln!(f, "  lock held elsewhere, requeued:     {}", self.lock_busy)?;
        writeln!(
            f,
            "  jobs stopped by a lost lease:      {}",
            self.lease_lost
        )?;
        writeln!(
            f,
            "  payout {:>2}, paused past its lease:  the late call {}",
            self.paused_job, self.paused_call
        )?;
        write!(
            f,
            "  payout {:>2}, payer killed before ack: paid {} time(s)",
            self.killed_job,
            if self.paid_twice.contains(&self.killed_job) {
                "2+"
            } else {
                "1"
            }
        )
    }
}

/// Runs the scenario: the queue and the locks on the Redis at `redis`, the ledger on the
/// PostgreSQL at `postgres`, workers started as `exe worker …` (the `job-queue`
/// binary). Printing progress to stdout.
pub async fn run(
    exe: &Path,
    redis: &str,
    postgres: &str,
    options: &Options,
) -> Result<Report, BoxError> {
    if options.jobs < 3 || options.workers < 2 {
        return Err("a run needs at least 3 payouts and 2 workers".into());
    }
    let run = format!("{:016x}", rand::random::<u64>());
    let ledger = Ledger::open(postgres, &run).await?;

    // Every payout once, every fourth one slow, and payouts 5 and 6 enqueued twice.
    let mut jobs: Vec<Payout> = (1..=options.jobs)
        .map(|id| Payout {
            id,
            work_ms: if id % 4 == 0 { 1500 } else { 100 },
        })
        .collect();
    jobs.extend(
        jobs.iter()
            .filter(|j| j.id == 5 || j.id == 6)
            .copied()
            .collect::<Vec<_>>(),
    );
    let pushed = jobs.len();
    let conn = apalis_redis::connect(redis).await?;
    let mut storage = RedisStorage::<Payout>::new(conn).with_config(queue_config(&run));
    storage.push_bulk(jobs).await.map_err(|e| e.to_string())?;

    let mut workers = Vec::new();
    for i in 0..options.workers {
        workers.push(spawn_worker(exe, redis, postgres, &run, i, options.locked)?);
    }
    let mut outcome = choreograph(&ledger, options.jobs).await;
    if let Err(e) = &outcome {
        // What each unpaid job went through, and where the queue holds it, before the
        // workers are stopped; a report that cannot be made says why, after the error.
        let report = match what_went_wrong(&ledger, redis, &run, options.jobs).await {
            Ok(report) => report,
            Err(why) => format!("(no report of the unpaid payouts: {why})"),
        };
        outcome = Err(format!("{e}\n{report}").into());
    }
    for worker in &mut workers {
        // Stopped workers are resumed first, or the kill would wait for them.
        if let Some(pid) = worker.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
        }
        let _ = worker.kill().await;
    }
    let Faults {
        paused_job,
        paused_call,
        killed_job,
    } = outcome?;

    let (made, paid_twice) = ledger.payouts().await?;
    Ok(Report {
        locked: options.locked,
        jobs: options.jobs,
        pushed,
        deliveries: ledger.count_events("delivered").await?,
        made,
        paid_twice,
        unpaid: ledger.unpaid(options.jobs).await?,
        stale_rejected: ledger.count_events("stale_rejected").await?,
        absorbed: ledger.count_events("absorbed").await?,
        lock_busy: ledger.count_events("lock_busy").await?,
        lease_lost: ledger.count_events("lease_lost").await?,
        paused_job,
        paused_call,
        killed_job,
    })
}

/// Each unpaid payout's events and where the queue holds every task, for the error of a
/// run that did not finish.
async fn what_went_wrong(
    ledger: &Ledger,
    redis: &str,
    run: &str,
    jobs: i64,
) -> Result<String, BoxError> {
    let unpaid = ledger.unpaid(jobs).await?;
    let mut conn = apalis_redis::connect(redis).await?;
    let state = crate::queue_state::describe(&mut conn, &queue_config(run)).await?;
    Ok(format!(
        "history of the unpaid payouts:\n  {}\n{state}",
        ledger.history(&unpaid).await?.join("\n  ")
    ))
}

/// The faults as they landed.
struct Faults {
    paused_job: i64,
    paused_call: String,
    killed_job: i64,
}

/// Resumes the paused worker once another has paid its job, kills the worker that waits
/// to be killed, and returns once every payout was made, the paused call has gone out,
/// and the queue has had time to deliver whatever it still held.
async fn choreograph(ledger: &Ledger, jobs: i64) -> Result<Faults, BoxError> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let (mut paused_job, mut killed_job) = (None, None);
    loop {
        if Instant::now() > deadline {
            return Err(format!(
                "the run did not finish in 90 s (paused job resumed: {paused_job:?}, \
                 killed job: {killed_job:?}, unpaid: {:?})",
                ledger.unpaid(jobs).await?
            )
            .into());
        }
        if paused_job.is_none()
            && let Some((worker, pid, job)) = ledger.claimed("pause").await?
            && ledger.paid_by_others(job, &worker).await? > 0
        {
            println!("payout {job} was paid by another worker: resuming {worker}");
            kill(Pid::from_raw(pid), Signal::SIGCONT)?;
            paused_job = Some(job);
        }
        if killed_job.is_none()
            && let Some((worker, pid, job)) = ledger.claimed("kill").await?
        {
            println!("{worker} paid payout {job} and was killed before its ack");
            kill(Pid::from_raw(pid), Signal::SIGKILL)?;
            killed_job = Some(job);
        }
        if let (Some(paused_job), Some(killed_job)) = (paused_job, killed_job)
            && let Some(paused_call) = ledger.first_event(PAUSED_CALL).await?
            && ledger.unpaid(jobs).await?.is_empty()
        {
            // Redeliveries the queue still holds (retries of missed locks, the paused
            // worker's buffered jobs) get the time to run.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let paused_call = paused_call
                .strip_prefix(&format!("{PAUSED_CALL}:"))
                .unwrap_or(&paused_call)
                .to_owned();
            return Ok(Faults {
                paused_job,
                paused_call,
                killed_job,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_worker(
    exe: &Path,
    redis: &str,
    postgres: &str,
    run: &str,
    i: u32,
    locked: bool,
) -> Result<Child, BoxError> {
    // Worker 0 is paused before its first payout call, worker 1 killed after its first
    // payout; the others run clean.
    let fault = ["pause", "die"].get(i as usize).copied().unwrap_or("none");
    let mut command = crate::child(
        exe,
        "worker",
        (redis, postgres, run),
        &format!("worker-{i}"),
    );
    command.args(["--fault", fault]);
    if !locked {
        command.arg("--unlocked");
    }
    Ok(command.spawn()?)
}
