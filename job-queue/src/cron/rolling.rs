//! The rolling restart of the cron example: two scheduler instances whose clocks disagree
//! by [`SKEW`], each in turn stopped with SIGTERM (it gives the role up and exits) and
//! replaced by a new one with the same clock, so that the role moves [`RESTARTS`] times,
//! alternately to a clock behind and to a clock ahead; then the tick table is read back.
//!
//! Each hand-over is timed to where a layer that runs a tick once per leadership gets it
//! wrong: to a clock behind, right after the leader wrote a tick (the successor fires the
//! same tick [`SKEW`] later); to a clock ahead, between the successor's firing of the
//! next tick (as a standby) and the leader's.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::time::{Instant, timeout};

use super::instance::{CLOCK_OFFSET_ENV, READY};
use super::ticks::{Ticks, Written};
use crate::BoxError;

/// How far the clocks of the two instances of each pair disagree: every other instance is
/// this much behind.
pub const SKEW: Duration = Duration::from_millis(400);
/// Instances stopped and replaced, one after the other.
pub const RESTARTS: usize = 4;
/// After a tick written by a leader whose successor's clock is ahead, how long to wait
/// before the stop: past the successor's firing of the next tick ([`SKEW`] before the
/// leader's), before the leader's.
const AHEAD_PHASE: Duration = Duration::from_millis(1000 - 400 + 150);

/// One hand-over of the run.
#[derive(Clone, Debug)]
pub struct HandOver {
    /// The instance stopped.
    pub from: String,
    /// The instance left to lead.
    pub to: String,
    /// Whether the successor's clock is behind the stopped leader's.
    pub successor_behind: bool,
    /// The last tick the stopped leader wrote before its stop.
    pub last_tick: i64,
    /// From SIGTERM to the stopped instance's exit, its resignation included.
    pub exit_took: Duration,
    /// When SIGTERM was sent (PostgreSQL's clock, seconds since the epoch).
    pub stopped_at: f64,
}

/// What the tick table shows after a run.
#[derive(Debug)]
pub struct Report {
    /// Every tick written, in order.
    pub written: Vec<Written>,
    /// Ticks written more than once: must be empty.
    pub run_twice: Vec<i64>,
    /// Ticks between the first and the last written that were not written: must be empty.
    pub missing: Vec<i64>,
    /// The hand-overs, in order.
    pub hand_overs: Vec<HandOver>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut per_instance: BTreeMap<&str, usize> = BTreeMap::new();
        for w in &self.written {
            *per_instance.entry(&w.instance).or_default() += 1;
        }
        let (first, last) = (
            self.written.iter().map(|w| w.tick).min().unwrap_or(0),
            self.written.iter().map(|w| w.tick).max().unwrap_or(0),
        );
        writeln!(
            f,
            "{} ticks written ({first}..={last}), per instance {per_instance:?}",
            self.written.len()
        )?;
        for h in &self.hand_overs {
            write!(
                f,
                "  {} -> {} (successor's clock {} by {} ms) after tick {}; SIGTERM to exit {:.1} ms",
                h.from,
                h.to,
                if h.successor_behind {
                    "behind"
                } else {
                    "ahead"
                },
                SKEW.as_millis(),
                h.last_tick,
                h.exit_took.as_secs_f64() * 1e3
            )?;
            match self.written.iter().find(|w| w.instance == h.to) {
                Some(w) => writeln!(
                    f,
                    "; its first tick {} written {:.3} s after SIGTERM",
                    w.tick,
                    w.at - h.stopped_at
                )?,
                None => writeln!(f, "; it wrote no tick")?,
            }
        }
        writeln!(f, "  ticks run twice: {:?}", self.run_twice)?;
        write!(f, "  ticks lost:      {:?}", self.missing)
    }
}

/// A running instance: its name, whether its clock is behind, its process.
struct Instance {
    name: String,
    behind: bool,
    child: Child,
}

/// Runs the rolling restart: the election and the claims on the Redis at `redis`, the tick
/// table on the PostgreSQL at `postgres`, instances started as `exe cron …`.
pub async fn run(exe: &Path, redis: &str, postgres: &str) -> Result<Report, BoxError> {
    let run = format!("{:016x}", rand::random::<u64>());
    let ticks = Ticks::open(postgres, &run).await?;
    let mut started = 0;
    let mut spawn = |behind: bool| {
        let name = format!("cron-{started}");
        started += 1;
        spawn_instance(exe, (redis, postgres, &run), name, behind)
    };
    let mut leader = spawn(false).await?;
    let first = ticks
        .wait_for(|w| w.iter().find(|w| w.instance == leader.name).cloned())
        .await;
    let mut standby = match first {
        Ok(_) => spawn(true).await,
        Err(e) => Err(e),
    };
    let mut hand_overs = Vec::new();
    let outcome = match &mut standby {
        Ok(standby) => {
            restart_each(&ticks, &mut leader, standby, &mut spawn, &mut hand_overs).await
        }
        Err(_) => Ok(()),
    };
    for instance in [Some(&mut leader), standby.as_mut().ok()]
        .into_iter()
        .flatten()
    {
        let _ = instance.child.kill().await;
    }
    standby?;
    outcome?;
    let written = ticks.written().await?;
    let mut counts: BTreeMap<i64, usize> = BTreeMap::new();
    for w in &written {
        *counts.entry(w.tick).or_default() += 1;
    }
    let run_twice = counts
        .iter()
        .filter(|&(_, &n)| n > 1)
        .map(|(&tick, _)| tick)
        .collect();
    let missing = match (counts.keys().next(), counts.keys().next_back()) {
        (Some(&first), Some(&last)) => (first..=last)
            .filter(|tick| !counts.contains_key(tick))
            .collect(),
        _ => Vec::new(),
    };
    Ok(Report {
        written,
        run_twice,
        missing,
        hand_overs,
    })
}

/// Stops the leader [`RESTARTS`] times and starts its replacement, the standby leading in
/// its place; lets three ticks run after the last hand-over.
async fn restart_each<F, Fut>(
    ticks: &Ticks,
    leader: &mut Instance,
    standby: &mut Instance,
    spawn: &mut F,
    hand_overs: &mut Vec<HandOver>,
) -> Result<(), BoxError>
where
    F: FnMut(bool) -> Fut,
    Fut: Future<Output = Result<Instance, BoxError>>,
{
    for _ in 0..RESTARTS {
        // The standby has fired a tick of its own before its turn: two ticks by the
        // leader since it said it was ready.
        let seen = ticks.written().await?.len();
        ticks
            .wait_for(|w| {
                (w[seen..]
                    .iter()
                    .filter(|w| w.instance == leader.name)
                    .count()
                    >= 2)
                    .then_some(())
            })
            .await?;
        let seen = ticks.written().await?.len();
        let last = ticks
            .wait_for(|w| {
                w[seen..]
                    .iter()
                    .find(|w| w.instance == leader.name)
                    .cloned()
            })
            .await?;
        let successor_behind = standby.behind && !leader.behind;
        if !successor_behind {
            tokio::time::sleep(AHEAD_PHASE).await;
        }
        let pid = leader.child.id().ok_or("the leader has exited")?;
        let stopped_at = ticks.now().await?;
        let stopped = Instant::now();
        kill(Pid::from_raw(pid as i32), Signal::SIGTERM)?;
        let exit = timeout(Duration::from_secs(10), leader.child.wait())
            .await
            .map_err(|_| "the leader did not exit within 10 s of SIGTERM")??;
        let exit_took = stopped.elapsed();
        if !exit.success() {
            return Err(format!("{} exited with {exit}", leader.name).into());
        }
        let replacement = spawn(leader.behind).await?;
        let gone = std::mem::replace(leader, std::mem::replace(standby, replacement));
        println!("{} stopped, {} leads", gone.name, leader.name);
        hand_overs.push(HandOver {
            from: gone.name,
            to: leader.name.clone(),
            successor_behind,
            last_tick: last.tick,
            exit_took,
            stopped_at,
        });
    }
    let seen = ticks.written().await?.len();
    ticks
        .wait_for(|w| (w.len() >= seen + 3).then_some(()))
        .await
}

/// Starts an instance, its clock [`SKEW`] behind if `behind`, and waits until it says it
/// is ready (30 s at most).
async fn spawn_instance(
    exe: &Path,
    at: (&str, &str, &str),
    name: String,
    behind: bool,
) -> Result<Instance, BoxError> {
    let offset = if behind { SKEW.as_millis() } else { 0 };
    let mut child = crate::child(exe, "cron", at, &name)
        .env(CLOCK_OFFSET_ENV, offset.to_string())
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or("the instance's standard output")?;
    let mut lines = BufReader::new(stdout).lines();
    timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line == READY {
                return Ok(());
            }
        }
        Err::<(), BoxError>(format!("{name} exited before it was ready").into())
    })
    .await
    .map_err(|_| format!("{name} was not ready within 30 s"))??;
    // Its later output, if any, is read and dropped, so that it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Instance {
        name,
        behind,
        child,
    })
}
