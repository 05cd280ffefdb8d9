//! `payout-queue`: payout workers on apalis, with and without distlock's lock layer.
//!
//! ```text
//! cargo run -p job-queue
//! cargo run -p job-queue -- --redis redis://127.0.0.1:6379 --postgres postgres://app:secret@127.0.0.1/app
//! ```
//!
//! Without URLs it starts its own `redis-server` and PostgreSQL on free loopback ports
//! (and stops them at exit). It runs the scenario twice, without the layer and then
//! under it, prints what the ledger shows, and exits non-zero unless the run under the
//! layer made every payout exactly once. `payout-queue worker …` is one worker process;
//! the runs start their own.

use std::process::ExitCode;

use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use job_queue::scenario::{self, Options};
use job_queue::worker::{self, Fault, WorkerArgs};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("worker") {
        let parsed = match parse_worker(&args[1..]) {
            Ok(parsed) => parsed,
            Err(e) => {
                eprintln!("payout-queue worker: {e}");
                return ExitCode::from(2);
            }
        };
        return match worker::run(parsed).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("payout-queue worker: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (redis, postgres) = match parse_urls(&args) {
        Ok(urls) => urls,
        Err(e) => {
            eprintln!("payout-queue: {e}");
            return ExitCode::from(2);
        }
    };
    match demo(redis, postgres).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("payout-queue: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Both runs; true when the one under the layer made every payout exactly once.
async fn demo(
    redis: Option<String>,
    postgres: Option<String>,
) -> Result<bool, job_queue::BoxError> {
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
    drop(servers);
    Ok(correct)
}

fn parse_urls(args: &[String]) -> Result<(Option<String>, Option<String>), String> {
    let (mut redis, mut postgres) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--redis" => redis = Some(value?.clone()),
            "--postgres" => postgres = Some(value?.clone()),
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: payout-queue [--redis URL --postgres URL]"
                ));
            }
        }
    }
    if redis.is_some() != postgres.is_some() {
        return Err("give both --redis and --postgres, or neither to start local servers".into());
    }
    Ok((redis, postgres))
}

fn parse_worker(args: &[String]) -> Result<WorkerArgs, String> {
    let (mut redis, mut postgres, mut run, mut name) = (None, None, None, None);
    let mut locked = true;
    let mut fault = Fault::None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--redis" => redis = Some(value()?),
            "--postgres" => postgres = Some(value()?),
            "--run" => run = Some(value()?),
            "--name" => name = Some(value()?),
            "--unlocked" => locked = false,
            "--fault" => {
                fault = match value()?.as_str() {
                    "none" => Fault::None,
                    "pause" => Fault::Pause,
                    "die" => Fault::Die,
                    other => return Err(format!("--fault: {other:?} is not none, pause or die")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let need = |v: Option<String>, flag: &str| v.ok_or(format!("{flag} is required"));
    Ok(WorkerArgs {
        redis: need(redis, "--redis")?,
        postgres: need(postgres, "--postgres")?,
        run: need(run, "--run")?,
        name: need(name, "--name")?,
        locked,
        fault,
    })
}
