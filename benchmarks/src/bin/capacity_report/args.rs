//! The command line, and what it selects: the backends, their stores and the plan.

use std::path::PathBuf;

use benchmarks::BenchError;
use benchmarks::plan::Plan;
use benchmarks::subjects::{Servers, Store, SubjectId};
use clap::Parser;

/// Measures distlock's backends beside raw-client baselines and writes a capacity report.
#[derive(Debug, Parser)]
#[command(version, about)]
pub(crate) struct Args {
    /// Tiny sizes that only check the report still works (for CI); the numbers mean little.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Where the report, CSV and charts go.
    #[arg(long, default_value = "target/capacity")]
    pub(crate) out: PathBuf,
    /// Backends to measure, comma-separated: memory, redis, pg-lease, pg-advisory, etcd.
    /// The baselines of their stores are measured with them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "memory,redis,pg-lease,pg-advisory,etcd"
    )]
    pub(crate) backends: Vec<String>,
    /// Only the handoff measurement (one key, waiting tasks, with and without release
    /// notifications), printed as a table; no report is written.
    #[arg(long)]
    pub(crate) handoff_only: bool,
    /// Only the interleaved pairs behind the throughput and latency targets (with Redis:
    /// also at 16 and 64 tasks with redis-server and this process sharing the cores and
    /// pinned apart), and the batch rates, printed round by round; no report is written.
    #[arg(long)]
    pub(crate) pairs_only: bool,
    /// Only the releases with a waiter on every key against releases nobody waits for
    /// (64 tasks, alternating rounds), printed round by round; no report is written.
    #[arg(long)]
    pub(crate) waited_releases_only: bool,
    /// Only the semaphore permit cycles against lock cycles (1 and 64 tasks, as many
    /// permits, alternating rounds), then a full semaphore of 1, 64 and 1024 permits
    /// (64 tasks waiting, and refused) beside a lock, printed round by round with their
    /// targets; no report is written.
    #[arg(long)]
    pub(crate) permits_only: bool,
    /// Alternating rounds of the pairs (the Redis pairs shared and pinned included) and of
    /// the waited releases, and the rounds of `--profile` (default: 9, or 2 with
    /// `--quick`); more rounds steady the medians on a busy machine.
    #[arg(long)]
    pub(crate) rounds: Option<usize>,
    /// Only one subject (a backend or baseline, e.g. `redis`, `rslock`,
    /// `redis-setnx-del`) in closed loop at `--tasks`, for `--rounds` rounds, printing
    /// cycles/s and client and server CPU µs per cycle per round (for profiling).
    #[arg(long, value_name = "SUBJECT")]
    pub(crate) profile: Option<String>,
    /// Tasks of `--profile`.
    #[arg(long, default_value_t = 64, requires = "profile")]
    pub(crate) tasks: usize,
    /// With `--profile`: redis-server (or the subject's server) on one CPU, every thread of
    /// this process on another, for the whole run.
    #[arg(long, requires = "profile")]
    pub(crate) pinned: bool,
    /// With `--profile`: redis-server (or the subject's server) on one CPU, the first of
    /// this process's runtime workers beside it, its other threads on another CPU: one of
    /// the places the scheduler picks when nothing is pinned, held for the whole run.
    #[arg(long, requires = "profile", conflicts_with = "pinned")]
    pub(crate) beside: bool,
    /// Internal: measure memory per held guard in this process and print one line.
    #[arg(long, hide = true)]
    pub(crate) guard_memory: Option<usize>,
    /// Internal: the guards' TTL in milliseconds for `--guard-memory`.
    #[arg(long, hide = true, default_value_t = 3_000)]
    pub(crate) guard_ttl_ms: u64,
}

pub(crate) fn selected_backends(args: &Args) -> Result<Vec<SubjectId>, BenchError> {
    let mut backends = Vec::new();
    for name in &args.backends {
        let name = name.trim();
        match SubjectId::from_slug(name).filter(|s| s.is_backend()) {
            Some(s) if !backends.contains(&s) => backends.push(s),
            Some(_) => {}
            None => {
                return Err(BenchError::Unexpected {
                    subject: "--backends",
                    detail: format!(
                        "unknown backend {name:?}; expected some of: {}",
                        SubjectId::BACKENDS.map(SubjectId::slug).join(", ")
                    ),
                });
            }
        }
    }
    Ok(backends)
}

/// The plan of the run's size.
pub(crate) fn plan(args: &Args) -> Plan {
    let mut plan = if args.quick {
        Plan::quick()
    } else {
        Plan::full()
    };
    if let Some(rounds) = args.rounds {
        plan.pair_rounds = rounds.max(1);
    }
    plan
}

/// For the single-measurement modes: the plan, the selected backends, and their stores'
/// servers, started.
pub(crate) async fn start_selected(
    args: &Args,
) -> Result<(Plan, Vec<SubjectId>, Servers), BenchError> {
    let backends = selected_backends(args)?;
    let servers = Servers::start(&stores_of(&backends)).await?;
    Ok((plan(args), backends, servers))
}

/// The stores `backends` run on, each once.
pub(crate) fn stores_of(backends: &[SubjectId]) -> Vec<Store> {
    let mut stores: Vec<Store> = backends.iter().map(|b| b.store()).collect();
    stores.sort();
    stores.dedup();
    stores
}
