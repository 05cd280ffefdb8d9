//! One run of the cron example: three instances, the leader stopped past its TTL and
//! resumed, the tick table read back.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Child;

use super::ticks::{Ticks, Written};
use crate::BoxError;

/// Scheduler instances started.
pub const INSTANCES: usize = 3;
/// How long the leader stays stopped.
const STOPPED_FOR: Duration = Duration::from_secs(5);

/// What the tick table shows after a run.
#[derive(Debug)]
pub struct Report {
    /// Every tick written, in order.
    pub written: Vec<Written>,
    /// Ticks written more than once: must be empty.
    pub run_twice: Vec<i64>,
    /// The instance stopped, and when (PostgreSQL's clock, seconds since the epoch).
    pub stopped: (String, f64),
    /// The first tick written by another instance after the stop.
    pub successor: Written,
    /// Ticks the stopped instance wrote after it was stopped (resumed included): must
    /// be none.
    pub written_by_stopped_after: usize,
}

impl Report {
    /// Seconds from the stop to the successor's first tick.
    pub fn takeover(&self) -> f64 {
        self.successor.at - self.stopped.1
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut per_instance: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &self.written {
            *per_instance.entry(&w.instance).or_default() += 1;
        }
        writeln!(
            f,
            "{} ticks written by {INSTANCES} instances, per instance {per_instance:?}",
            self.written.len()
        )?;
        writeln!(f, "  ticks run twice:                 {:?}", self.run_twice)?;
        writeln!(
            f,
            "  leader {} stopped; {} wrote the next tick {:.2} s later",
            self.stopped.0,
            self.successor.instance,
            self.takeover()
        )?;
        write!(
            f,
            "  ticks by the stopped instance after its stop: {}",
            self.written_by_stopped_after
        )
    }
}

/// Runs the scenario: the election on the Redis at `redis`, the tick table on the
/// PostgreSQL at `postgres`, instances started as `exe cron …`.
pub async fn run(exe: &Path, redis: &str, postgres: &str) -> Result<Report, BoxError> {
    let run = format!("{:016x}", rand::random::<u64>());
    let ticks = Ticks::open(postgres, &run).await?;
    let mut instances = Vec::new();
    for i in 0..INSTANCES {
        instances.push(spawn_instance(exe, redis, postgres, &run, i)?);
    }
    let outcome = stop_the_leader(&ticks, &instances).await;
    for instance in &mut instances {
        if let Some(pid) = instance.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
        }
        let _ = instance.kill().await;
    }
    let (stopped, successor) = outcome?;
    let written = ticks.written().await?;
    let mut counts: BTreeMap<i64, usize> = BTreeMap::new();
    for w in &written {
        *counts.entry(w.tick).or_default() += 1;
    }
    let run_twice = counts
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(tick, _)| tick)
        .collect();
    let written_by_stopped_after = written
        .iter()
        .filter(|w| w.instance == stopped.0 && w.at > stopped.1)
        .count();
    Ok(Report {
        written,
        run_twice,
        stopped,
        successor,
        written_by_stopped_after,
    })
}

/// Waits for three ticks, stops the instance that wrote the last, waits for another to
/// write, keeps it stopped for [`STOPPED_FOR`], resumes it, and lets three more ticks run.
async fn stop_the_leader(
    ticks: &Ticks,
    instances: &[Child],
) -> Result<((String, f64), Written), BoxError> {
    let leader = ticks
        .wait_for(|w| (w.len() >= 3).then(|| w[w.len() - 1].clone()))
        .await?;
    let index: usize = leader
        .instance
        .strip_prefix("cron-")
        .and_then(|i| i.parse().ok())
        .ok_or("an instance name of the run")?;
    let pid = instances[index].id().ok_or("the leader has exited")?;
    kill(Pid::from_raw(pid as i32), Signal::SIGSTOP)?;
    let stopped_at = ticks.now().await?;
    println!("{} leads: stopped it", leader.instance);
    let successor = ticks
        .wait_for(|w| {
            w.iter()
                .find(|w| w.instance != leader.instance && w.at > stopped_at)
                .cloned()
        })
        .await?;
    println!("{} took over", successor.instance);
    tokio::time::sleep(STOPPED_FOR).await;
    kill(Pid::from_raw(pid as i32), Signal::SIGCONT)?;
    println!("{} resumed", leader.instance);
    tokio::time::sleep(Duration::from_secs(3)).await;
    Ok(((leader.instance, stopped_at), successor))
}

fn spawn_instance(
    exe: &Path,
    redis: &str,
    postgres: &str,
    run: &str,
    i: usize,
) -> Result<Child, BoxError> {
    Ok(crate::child(exe, "cron", (redis, postgres, run), &format!("cron-{i}")).spawn()?)
}
