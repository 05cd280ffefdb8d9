//! The capacity-planning report: sweeps concurrency for every backend and its baselines
//! against servers it starts itself, and writes `report.md`, `capacity.csv` and SVG charts.
//!
//! ```text
//! cargo run --release -p benchmarks --bin capacity [-- --quick] [--out DIR] [--backends redis,etcd]
//!     [--rounds N] [--pairs-only | --handoff-only | --waited-releases-only | --permits-only]
//! cargo run --release -p benchmarks --bin capacity -- --profile SUBJECT [--tasks N]
//!     [--rounds R] [--pinned] [--quick]
//! ```
//!
//! `--profile` runs one subject (e.g. `redis`, `rslock`) closed-loop at `--tasks` for
//! `--rounds` rounds and prints each round's cycles/s and CPU µs per cycle, client and
//! server, and how often per cycle the client's threads were put on a CPU (each wake-up
//! after sleeping, or preemption), with both pids first so that `perf record -p PID` can be attached.

use std::process::ExitCode;
use std::time::Duration;

use benchmarks::scenarios;
use clap::Parser;

use crate::args::Args;

mod args;
mod measure;
mod only;
mod print;
mod profile;
mod report;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.guard_memory {
        Some(count) => scenarios::guard_memory(count, Duration::from_millis(args.guard_ttl_ms))
            .await
            .map(|m| println!("{}", m.to_line())),
        None if args.profile.is_some() => profile::run(&args).await,
        None if args.handoff_only => only::handoff(&args).await,
        None if args.pairs_only => only::pairs(&args).await,
        None if args.waited_releases_only => only::waited_releases(&args).await,
        None if args.permits_only => only::permits(&args).await,
        None => report::run(&args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("capacity: {e}");
            ExitCode::FAILURE
        }
    }
}
