//! A fenced scheduler: three scheduler processes elect one leader with
//! `distlock::Election`; the leader enqueues a job every 100 ms into a PostgreSQL table,
//! each insert admitted by its fencing token in the same transaction.
//!
//! ```text
//! cargo run -p distlock --features postgres --example scheduler
//! cargo run -p distlock --features postgres --example scheduler -- \
//!     --postgres postgres://app:secret@127.0.0.1/app
//! ```
//!
//! Without a URL it starts its own PostgreSQL on a free loopback port (and stops it at
//! exit). With one, the role must be allowed to create the schema `distlock` and the table
//! `scheduler_jobs` (rows are tagged with a random run id, so runs do not meet).
//!
//! The run stops the leader with SIGSTOP past its lease's TTL, lets a standby take over,
//! resumes the stopped process, and then reads the job table: it prints the triggers per
//! leader and exits non-zero unless the stopped leader's late trigger was refused, no
//! stale trigger was accepted and no interval was triggered twice.

#[path = "scheduler/scenario.rs"]
mod scenario;

use std::process::ExitCode;

use harness::postgres::PostgresServer;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(child) = scenario::child_args(&args) {
        return child_process(child).await;
    }
    let postgres = match args.as_slice() {
        [] => None,
        [flag, url] if flag == "--postgres" => Some(url.clone()),
        _ => {
            eprintln!("scheduler: usage: scheduler [--postgres URL]");
            return ExitCode::from(2);
        }
    };
    // A server started here lives until the end of main, and stops when dropped.
    let mut server = None;
    let url = match postgres {
        Some(url) => url,
        None => {
            println!("starting PostgreSQL on a free 127.0.0.1 port ...");
            match PostgresServer::start().await {
                Ok(started) => server.insert(started).superuser_url(),
                Err(e) => {
                    eprintln!("scheduler: cannot start PostgreSQL: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    };
    let outcome = scenario::run(&url).await;
    drop(server);
    match outcome {
        Ok(report) => {
            println!("\n{report}");
            if report.is_correct() {
                println!("\nOK: one acting leader at a time, as far as the job table can tell");
                ExitCode::SUCCESS
            } else {
                println!("\nFAILED: see above");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("scheduler: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A scheduler process started by the run with `--child`.
async fn child_process(args: Result<(u32, String, String), String>) -> ExitCode {
    let outcome = match args {
        Ok((id, url, run)) => scenario::child_main(id, &url, &run).await,
        Err(e) => Err(e.into()),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scheduler child: {e}");
            ExitCode::FAILURE
        }
    }
}
