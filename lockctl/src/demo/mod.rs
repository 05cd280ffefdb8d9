//! `lockctl demo`: the job-worker scenario of the problem statement, simulated.
//!
//! A queue with at-least-once delivery feeds payment jobs to many workers. Some jobs are
//! delivered twice, some outlive the visibility timeout and the lease TTL, some workers
//! pause between their last lease check and their write, and some crash after paying but
//! before acking. Five strategies run the same seeded workload side by side, each on its
//! own store (or key prefix), queue and ledger; the report counts what each let through.
//!
//! - [`workload`]: the seeded jobs and their planted failures;
//! - [`queue`]: the at-least-once queue;
//! - [`ledger`]: the payment ledger, with idempotency keys;
//! - [`process`]: a worker process's link to the store, frozen by pauses, cut by crashes;
//! - [`strategy`]: the five strategies and the worker loop;
//! - [`report`]: the table and its JSON form;
//! - [`tenants`]: the tenant-limit scenario (`--tenants`): a semaphore of exports per
//!   tenant under the same pauses and crashes.

pub mod ledger;
pub mod process;
pub mod queue;
pub mod report;
pub mod strategy;
pub mod tenants;
pub mod workload;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use distlock::LockError;
use futures::future::try_join_all;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::time::Instant;

use self::queue::Queue;
use self::report::{Header, Row};
use self::strategy::{Run, Strategy};
use self::workload::Workload;

/// What `lockctl demo` was asked to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The lock store's URL.
    pub backend: String,
    /// The workload's seed.
    pub seed: u64,
    /// Workers per strategy.
    pub workers: u32,
    /// Jobs in the workload.
    pub jobs: u32,
    /// The lease TTL; every other duration of the scenario scales with it.
    pub ttl: Duration,
    /// Print JSON instead of the table (and no progress bar).
    pub json: bool,
    /// Run the tenant-limit scenario instead of the payments.
    pub tenants: bool,
}

/// Runs the five strategies and returns the report, as a table or JSON.
///
/// # Errors
/// A bad backend URL, a TTL the store cannot honour, or the first error the store
/// returns during the run.
pub async fn run(options: &Options) -> Result<String, LockError> {
    if options.tenants {
        let rows = tenants::run(&options.backend, options.ttl).await?;
        if options.json {
            return serde_json::to_string(&rows)
                .map_err(|e| LockError::Config(format!("the report could not be written: {e}")));
        }
        let backend = distlock::redact_url(&options.backend);
        return Ok(tenants::table(&backend, options.ttl, &rows));
    }
    if options.workers == 0 || options.jobs == 0 {
        return Err(LockError::Config(
            "the demo needs at least one worker and one job".into(),
        ));
    }
    let workload = Arc::new(Workload::generate(
        options.seed,
        options.jobs,
        options.workers,
        options.ttl,
    ));
    let bars = if options.json || !std::io::stderr().is_terminal() {
        MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
    } else {
        MultiProgress::with_draw_target(ProgressDrawTarget::stderr())
    };
    let style = ProgressStyle::with_template("{prefix:>28} [{bar:32}] {pos}/{len} jobs done")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    // Keys of this run never meet those of another run on a shared store.
    let run_id = format!("{:016x}", rand::random::<u64>());

    let mut runs = Vec::with_capacity(Strategy::ALL.len());
    for strategy in Strategy::ALL {
        let store = distlock::connect(&options.backend).await?;
        store.capabilities().check_ttl(options.ttl)?;
        let progress = bars.add(
            ProgressBar::new(u64::from(options.jobs))
                .with_style(style.clone())
                .with_prefix(strategy.name()),
        );
        runs.push((strategy, store, progress));
    }

    // One start instant for every strategy: they run side by side on the same clock.
    let start = Instant::now();
    let tasks = runs.into_iter().map(|(strategy, store, progress)| {
        let run = Arc::new(Run::new(
            strategy,
            workload.clone(),
            store,
            Queue::new(&workload, start),
            format!("lockctl-demo:{run_id}:{}:", strategy.name()),
            progress,
        ));
        let workers = options.workers;
        async move {
            let handles: Vec<_> = (0..workers)
                .map(|_| tokio::spawn(run.clone().worker()))
                .collect();
            for handle in handles {
                handle
                    .await
                    .map_err(|e| LockError::Config(format!("a demo worker failed: {e}")))??;
            }
            run.progress.finish();
            Ok::<Row, LockError>(Row::from_run(&run, start.elapsed()))
        }
    });
    let rows = try_join_all(tasks).await?;
    bars.clear().ok();

    if options.json {
        return Ok(report::json(&rows));
    }
    let backend = distlock::redact_url(&options.backend);
    Ok(report::table(
        &Header {
            backend: &backend,
            seed: options.seed,
            workers: options.workers,
            timing: workload.timing,
            census: workload.census(),
        },
        &rows,
    ))
}
