//! `job-queue`: payout workers and once-only cron on apalis, with distlock's layers.
//!
//! ```text
//! cargo run -p job-queue
//! cargo run -p job-queue -- --redis redis://127.0.0.1:6379 --postgres postgres://app:secret@127.0.0.1/app
//! ```
//!
//! Without URLs it starts its own `redis-server` and PostgreSQL on free loopback ports
//! (and stops them at exit). It runs the payout scenario twice, without the lock layer
//! and then under it, and the cron scenario once, prints what the tables show, and exits
//! non-zero unless the run under the layer made every payout exactly once and no tick
//! ran twice. `job-queue worker …` is one payout worker, `job-queue cron …` one
//! scheduler instance and `job-queue strategy-worker …` one report worker of the
//! strategy tests; the runs and the tests start their own.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use job_queue::BoxError;
use job_queue::cron::{self, instance::InstanceArgs};
use job_queue::scenario::{self, Options};
use job_queue::storage::Storage;
use job_queue::strategy_worker;
use job_queue::worker::{self, Fault, WorkerArgs};

#[derive(Parser)]
#[command(about = "Payout workers and once-only cron on apalis, with distlock's layers")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The Redis of the queue, the locks and the election (with --postgres; without
    /// both, local servers are started).
    #[arg(long, requires = "postgres")]
    redis: Option<String>,
    /// The PostgreSQL of the ledger and the tick table (with --redis).
    #[arg(long, requires = "redis")]
    postgres: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// One payout worker process (the runs start their own).
    Worker {
        #[command(flatten)]
        at: At,
        /// Run the jobs without the lock layer.
        #[arg(long)]
        unlocked: bool,
        /// What goes wrong in this process, once.
        #[arg(long, value_enum, default_value = "none")]
        fault: Fault,
    },
    /// One scheduler instance (the runs start their own).
    Cron {
        #[command(flatten)]
        at: At,
    },
    /// One report worker under until_executed, on either apalis storage (the strategy
    /// tests start their own).
    StrategyWorker {
        /// The apalis storage.
        #[arg(long, value_enum)]
        storage: Storage,
        /// Its server's URL (the locks' too).
        #[arg(long)]
        url: String,
        /// The worker's name, unique on the queue.
        #[arg(long)]
        name: String,
        /// The lock TTL, in milliseconds.
        #[arg(long, default_value_t = 1000)]
        ttl_ms: u64,
    },
}

/// Where a process of a run works.
#[derive(Args)]
struct At {
    /// The run's Redis.
    #[arg(long)]
    redis: String,
    /// The run's PostgreSQL.
    #[arg(long)]
    postgres: String,
    /// The run id.
    #[arg(long)]
    run: String,
    /// The process's name, unique in the run.
    #[arg(long)]
    name: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let (what, ran) = match cli.command {
        Some(Command::Worker {
            at,
            unlocked,
            fault,
        }) => {
            let args = WorkerArgs {
                redis: at.redis,
                postgres: at.postgres,
                run: at.run,
                name: at.name,
                locked: !unlocked,
                fault,
            };
            ("job-queue worker", worker::run(args).await)
        }
        Some(Command::Cron { at }) => {
            let args = InstanceArgs {
                redis: at.redis,
                postgres: at.postgres,
                run: at.run,
                name: at.name,
            };
            ("job-queue cron", cron::instance::run(args).await)
        }
        Some(Command::StrategyWorker {
            storage,
            url,
            name,
            ttl_ms,
        }) => {
            let ttl = std::time::Duration::from_millis(ttl_ms);
            (
                "job-queue strategy-worker",
                strategy_worker::run(storage, &url, &name, ttl).await,
            )
        }
        None => match demo(cli.redis, cli.postgres).await {
            Ok(true) => return ExitCode::SUCCESS,
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => ("job-queue", Err(e)),
        },
    };
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{what}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The three runs; true when the one under the lock layer made every payout exactly
/// once and no tick ran twice.
async fn demo(redis: Option<String>, postgres: Option<String>) -> Result<bool, BoxError> {
    // Servers started here live until the end of the demo, and stop when dropped.
    let mut servers = None;
    let (redis, postgres) = match (redis, postgres) {
        (Some(redis), Some(postgres)) => (redis, postgres),
        _ => {
            println!("starting redis-server and PostgreSQL on free 127.0.0.1 ports ...");
            let started = (RedisServer::start().await?, PostgresServer::start().await?);
            let urls = (started.0.url(), started.1.superuser_url());
            servers = Some(started);
            urls
        }
    };
    let exe = std::env::current_exe()?;
    let mut correct = true;
    for locked in [false, true] {
        let options = Options {
            locked,
            ..Options::default()
        };
        let report = scenario::run(&exe, &redis, &postgres, &options).await?;
        println!("{report}\n");
        if locked {
            correct = report.paid_twice.is_empty() && report.unpaid.is_empty();
        }
    }
    let report = cron::scenario::run(&exe, &redis, &postgres).await?;
    println!("once-only cron:\n{report}");
    correct &= report.run_twice.is_empty();
    drop(servers);
    Ok(correct)
}
