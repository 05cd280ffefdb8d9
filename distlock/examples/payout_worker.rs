//! A payout worker: Redis locks with fencing tokens, and a PostgreSQL ledger that enforces
//! them, with idempotency keys in the same transaction as the ledger insert.
//!
//! ```text
//! cargo run -p distlock --features redis,postgres --example payout_worker
//! cargo run -p distlock --features redis,postgres --example payout_worker -- \
//!     --redis redis://127.0.0.1:6379 --postgres postgres://app:secret@127.0.0.1/app
//! ```
//!
//! Without URLs it starts its own `redis-server` and PostgreSQL on free loopback ports
//! (and stops them at exit). With URLs, the PostgreSQL role must be allowed to create the
//! schema `distlock` and the tables `payouts` and `payout_ledger` (rows are tagged with a
//! random run id, so runs do not meet). Several workers pay out jobs that arrive more than
//! once, and one worker freezes while holding a lock; the run prints what happened and
//! exits non-zero if any payout was applied twice or not at all.

#[path = "payout/scenario.rs"]
mod scenario;

use std::process::ExitCode;

use harness::postgres::PostgresServer;
use harness::redis::RedisServer;

/// `--redis URL` and `--postgres URL`, both or neither; `--payouts N`, `--workers N`.
struct Args {
    redis: Option<String>,
    postgres: Option<String>,
    options: scenario::Options,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        redis: None,
        postgres: None,
        options: scenario::Options::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--redis" => args.redis = Some(value()?),
            "--postgres" => args.postgres = Some(value()?),
            "--payouts" => {
                args.options.payouts = value()?.parse().map_err(|e| format!("--payouts: {e}"))?
            }
            "--workers" => {
                args.options.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: payout_worker [--redis URL --postgres URL] [--payouts N] [--workers N]"
                ));
            }
        }
    }
    if args.redis.is_some() != args.postgres.is_some() {
        return Err("give both --redis and --postgres, or neither to start local servers".into());
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("payout_worker: {e}");
            return ExitCode::from(2);
        }
    };
    // Servers started here live until the end of main, and stop when dropped.
    let mut servers = None;
    let (redis, postgres) = match (args.redis, args.postgres) {
        (Some(redis), Some(postgres)) => (redis, postgres),
        _ => {
            println!("starting redis-server and PostgreSQL on free 127.0.0.1 ports ...");
            let started = match (RedisServer::start().await, PostgresServer::start().await) {
                (Ok(redis), Ok(postgres)) => (redis, postgres),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("payout_worker: cannot start a local server: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let urls = (started.0.url(), started.1.superuser_url());
            servers = Some(started);
            urls
        }
    };
    println!(
        "locks on {}, ledger on {}",
        distlock::redact_url(&redis),
        distlock::redact_url(&postgres)
    );
    let result = scenario::run(&redis, &postgres, &args.options).await;
    drop(servers);
    match result {
        Ok(report) => {
            println!("\n{report}");
            if report.is_correct() {
                println!("every payout was applied exactly once");
                ExitCode::SUCCESS
            } else {
                eprintln!("payout_worker: a payout was applied twice or not at all");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("payout_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
