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

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use benchmarks::BenchError;
use benchmarks::load::{self, Keys, Sample};
use benchmarks::machine::Machine;
use benchmarks::plan::Plan;
use benchmarks::report::Report;
use benchmarks::scenarios::{self, GuardMemory, Paired, RedisServerCost, Results};
use benchmarks::subjects::{self, Servers, Store, Subject, SubjectId};
use benchmarks::target::Target;
use capacity::handoff::HandoffRow;
use clap::Parser;
use distlock_core::LockBackend;
use indicatif::{ProgressBar, ProgressStyle};

/// Measures distlock's backends beside raw-client baselines and writes a capacity report.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Tiny sizes that only check the report still works (for CI); the numbers mean little.
    #[arg(long)]
    quick: bool,
    /// Where the report, CSV and charts go.
    #[arg(long, default_value = "target/capacity")]
    out: PathBuf,
    /// Backends to measure, comma-separated: memory, redis, pg-lease, pg-advisory, etcd.
    /// The baselines of their stores are measured with them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "memory,redis,pg-lease,pg-advisory,etcd"
    )]
    backends: Vec<String>,
    /// Only the handoff measurement (one key, waiting tasks, with and without release
    /// notifications), printed as a table; no report is written.
    #[arg(long)]
    handoff_only: bool,
    /// Only the interleaved pairs behind the throughput and latency targets (with Redis:
    /// also at 16 and 64 tasks with redis-server and this process sharing the cores and
    /// pinned apart), and the batch rates, printed round by round; no report is written.
    #[arg(long)]
    pairs_only: bool,
    /// Only the releases with a waiter on every key against releases nobody waits for
    /// (64 tasks, alternating rounds), printed round by round; no report is written.
    #[arg(long)]
    waited_releases_only: bool,
    /// Only the semaphore permit cycles against lock cycles (1 and 64 tasks, as many
    /// permits, alternating rounds), printed round by round; no report is written.
    #[arg(long)]
    permits_only: bool,
    /// Alternating rounds of the pairs (the Redis pairs shared and pinned included) and of
    /// the waited releases, and the rounds of `--profile` (default: 9, or 2 with
    /// `--quick`); more rounds steady the medians on a busy machine.
    #[arg(long)]
    rounds: Option<usize>,
    /// Only one subject (a backend or baseline, e.g. `redis`, `rslock`,
    /// `redis-setnx-del`) in closed loop at `--tasks`, for `--rounds` rounds, printing
    /// cycles/s and client and server CPU µs per cycle per round (for profiling).
    #[arg(long, value_name = "SUBJECT")]
    profile: Option<String>,
    /// Tasks of `--profile`.
    #[arg(long, default_value_t = 64, requires = "profile")]
    tasks: usize,
    /// With `--profile`: redis-server (or the subject's server) on one CPU, every thread of
    /// this process on another, for the whole run.
    #[arg(long, requires = "profile")]
    pinned: bool,
    /// Internal: measure memory per held guard in this process and print one line.
    #[arg(long, hide = true)]
    guard_memory: Option<usize>,
    /// Internal: the guards' TTL in milliseconds for `--guard-memory`.
    #[arg(long, hide = true, default_value_t = 3_000)]
    guard_ttl_ms: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.guard_memory {
        Some(count) => scenarios::guard_memory(count, Duration::from_millis(args.guard_ttl_ms))
            .await
            .map(|m| println!("{}", m.to_line())),
        None if args.profile.is_some() => profile(&args).await,
        None if args.handoff_only => handoff_only(&args).await,
        None if args.pairs_only => pairs_only(&args).await,
        None if args.waited_releases_only => waited_releases_only(&args).await,
        None if args.permits_only => permits_only(&args).await,
        None => run(&args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("capacity: {e}");
            ExitCode::FAILURE
        }
    }
}

fn selected_backends(args: &Args) -> Result<Vec<SubjectId>, BenchError> {
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
fn plan(args: &Args) -> Plan {
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
async fn start_selected(args: &Args) -> Result<(Plan, Vec<SubjectId>, Servers), BenchError> {
    let backends = selected_backends(args)?;
    let servers = Servers::start(&stores_of(&backends)).await?;
    Ok((plan(args), backends, servers))
}

/// The stores `backends` run on, each once.
fn stores_of(backends: &[SubjectId]) -> Vec<Store> {
    let mut stores: Vec<Store> = backends.iter().map(|b| b.store()).collect();
    stores.sort();
    stores.dedup();
    stores
}

/// The handoff measurement alone, for every selected backend, notified and polling.
async fn handoff_only(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    println!(
        "{:>12} {:>12} {:>8} {:>9} {:>9} {:>20}",
        "backend", "woken by", "handoffs", "p50 µs", "p99 µs", "acquires per handoff"
    );
    for id in backends {
        let subject = subjects::open(id, &servers).await?;
        let Some(backend) = subject.backend() else {
            continue;
        };
        for notified in [true, false] {
            if notified && !backend.capabilities().wakes_waiters {
                continue;
            }
            let row = capacity::handoff::handoff(
                id,
                backend.clone(),
                plan.contended_tasks,
                plan.handoffs,
                notified,
            )
            .await?;
            println!(
                "{:>12} {:>12} {:>8} {:>9.0} {:>9.0} {:>20.2}",
                id.slug(),
                if notified { "notification" } else { "polling" },
                row.handoffs,
                row.p50_us,
                row.p99_us,
                row.acquires_per_handoff
            );
        }
        subject.close().await;
    }
    Ok(())
}

/// The interleaved target pairs and the batch rates alone, for every selected backend.
async fn pairs_only(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    for (a, b, level) in scenarios::TARGET_PAIRS {
        if backends.contains(&a) {
            print_pair(a, b, level, &servers, &plan).await?;
        }
    }
    if backends.contains(&SubjectId::Redis) {
        print_redis_pairs(&servers, &plan).await?;
        print_redis_cycle_cost(args, &servers).await?;
    }
    for id in backends {
        print_batches(id, &servers, &plan).await?;
    }
    Ok(())
}

/// The target pair `a` / `b` at `level` tasks, round by round; on Redis each side's
/// server cost under load first.
async fn print_pair(
    a: SubjectId,
    b: SubjectId,
    level: usize,
    servers: &Servers,
    plan: &Plan,
) -> Result<(), BenchError> {
    let sa = subjects::open(a, servers).await?;
    let sb = subjects::open(b, servers).await?;
    // The server's cost under load only where the report has it: Redis.
    if a.store() == Store::Redis {
        for s in [&sa, &sb] {
            let cost = benchmarks::server_cost::loaded_cycle_cost(servers, s, level, plan.duration)
                .await?;
            println!(
                "{:>16} {level:>3} tasks {:>9.0} cycles/s  server: {:.2} µs CPU and {:.2} \
                 commands per cycle",
                s.id().slug(),
                cost.cycles_per_sec,
                cost.cpu_us_per_cycle,
                cost.commands_per_cycle
            );
        }
    }
    let pair = scenarios::paired(sa.clone(), sb.clone(), level, plan.pair_rounds, plan).await;
    sa.close().await;
    sb.close().await;
    let pair = pair?;
    println!(
        "{} / {} at {level} tasks: cycles/s {:.2}x (rounds {}), acquire p50 {:.2}x (rounds {})",
        a.slug(),
        b.slug(),
        pair.throughput_ratio(),
        rounds(&pair.throughput_ratios, 2),
        pair.acquire_p50_ratio(),
        rounds(&pair.acquire_p50_ratios, 2)
    );
    Ok(())
}

/// The Redis pairs shared and pinned, as the report's table, with their targets.
async fn print_redis_pairs(servers: &Servers, plan: &Plan) -> Result<(), BenchError> {
    let placed = benchmarks::placed::redis_placed_pairs(servers, plan, |m| {
        eprintln!("{m}");
    })
    .await?;
    println!("\nredis pairs, shared and pinned\n");
    println!("{}", placed.markdown(plan.duration / 3));
    for t in placed.targets() {
        print_target(&t);
    }
    println!();
    Ok(())
}

/// What the Redis server spends per fresh-key cycle of distlock, rslock and raw
/// `SET NX` + `DEL`.
async fn print_redis_cycle_cost(args: &Args, servers: &Servers) -> Result<(), BenchError> {
    let redis = subjects::open(SubjectId::Redis, servers).await?;
    let raw = subjects::open(SubjectId::RedisSetNx, servers).await?;
    let rslock = subjects::open(SubjectId::Rslock, servers).await?;
    let calls = if args.quick { 200 } else { 5_000 };
    let cost =
        benchmarks::server_cost::redis_server_cost(servers, &redis, &raw, &rslock, calls).await?;
    let us = |subject: SubjectId| {
        cost.cycle_us
            .iter()
            .find(|(s, _)| *s == subject)
            .map_or(f64::NAN, |(_, us)| *us)
    };
    println!(
        "redis server µs per fresh-key cycle (median of {} rounds, {calls} cycles each): \
         distlock {:.2}, rslock {:.2}, raw SET NX + DEL {:.2}; distlock / rslock {:.2}x \
         (rounds {})",
        cost.cycle_rounds.len(),
        us(SubjectId::Redis),
        us(SubjectId::Rslock),
        us(SubjectId::RedisSetNx),
        cost.sequential_ratio().unwrap_or(f64::NAN),
        rounds(&cost.sequential_ratios(), 2)
    );
    Ok(())
}

/// The batch rates of the backend `id` at each size; on Redis also the server's time
/// per key.
async fn print_batches(id: SubjectId, servers: &Servers, plan: &Plan) -> Result<(), BenchError> {
    let subject = subjects::open(id, servers).await?;
    if let Some(backend) = subject.backend() {
        for &size in &plan.batch_sizes {
            let redis = id.store() == Store::Redis;
            if redis {
                servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
            }
            let row = scenarios::batch(id, &backend, size, plan.batch_reps).await?;
            let server = if redis {
                let info = servers.redis_command(&["INFO", "commandstats"]).await?;
                let keys = (size * plan.batch_reps.max(1)) as f64;
                format!(
                    ", server µs per key: {:.2} (acquire, renew and release)",
                    scenarios::usec_of(&info, &["evalsha"]) / keys
                )
            } else {
                String::new()
            };
            let rate = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.0}"));
            println!(
                "{} batches of {size}: acquire_many {} keys/s, renew_many {} keys/s{server}",
                id.slug(),
                rate(row.acquire_keys_per_sec),
                rate(row.renew_keys_per_sec)
            );
        }
    }
    subject.close().await;
    Ok(())
}

/// The releases with a waiter on every key alone, for every selected backend that wakes
/// waiters who only watch (not Redis, see `capacity::waited::watching_waits`).
async fn waited_releases_only(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    for id in backends {
        let Some(w) = waited_releases(id, &servers, &plan).await? else {
            continue;
        };
        println!(
            "{} at {} tasks, a waiter on every key / none: cycles/s {} (rounds {})\n  \
             waited {:.0} cycles/s (rounds {})\n  unwaited {:.0} cycles/s (rounds {})\n  \
             {} wake-ups for {} waited releases; CPU µs per cycle waited / unwaited: \
             client {} / {}, server {} / {}",
            id.slug(),
            w.concurrency,
            w.ratio().map_or("-".into(), |r| format!("{r:.2}x")),
            rounds(&w.ratios(), 2),
            w.waited.rate(),
            rounds(&w.waited.per_sec, 0),
            w.unwaited.rate(),
            rounds(&w.unwaited.per_sec, 0),
            w.wakes,
            w.waited_releases,
            us(w.waited.client()),
            us(w.unwaited.client()),
            us(w.waited.server()),
            us(w.unwaited.server()),
        );
        // The target of this backend, judged as in the full report.
        let results = Results {
            waited: vec![w],
            ..Results::default()
        };
        for t in results.targets() {
            if t.what.contains("waiter on every key") && t.met.is_some() {
                print_target(&t);
            }
        }
    }
    Ok(())
}

/// Round-by-round values, `decimals` digits after the point, for the `--*-only` printouts.
fn rounds(values: &[f64], decimals: usize) -> String {
    values
        .iter()
        .map(|v| format!("{v:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// CPU µs per cycle, or `-` where it could not be read.
fn us(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.1}"))
}

/// The semaphore permit cycles alone, for every selected backend.
async fn permits_only(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    for id in backends {
        for p in permit_cycles(id, &servers, &plan).await? {
            println!(
                "{} at {} tasks, {} permits: permit / lock cycles/s {} (rounds {})\n  \
                 permit {:.0} cycles/s (rounds {})\n  lock {:.0} cycles/s (rounds {})\n  \
                 CPU µs per cycle permit / lock: client {} / {}, server {} / {}",
                id.slug(),
                p.tasks,
                p.tasks,
                p.ratio().map_or("-".into(), |r| format!("{r:.2}x")),
                rounds(&p.ratios(), 2),
                p.permit.rate(),
                rounds(&p.permit.per_sec, 0),
                p.lock.rate(),
                rounds(&p.lock.per_sec, 0),
                us(p.permit.client()),
                us(p.lock.client()),
                us(p.permit.server()),
                us(p.lock.server()),
            );
        }
    }
    Ok(())
}

/// Measures `id`'s permit cycles against its lock cycles at each of
/// `capacity::permits::TASKS`.
async fn permit_cycles(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<Vec<capacity::permits::PermitCycles>, BenchError> {
    let worker = subjects::open(id, servers).await?;
    let mut out = Vec::new();
    for tasks in capacity::permits::TASKS {
        let measured =
            capacity::permits::permit_cycles(worker.clone(), tasks, plan, servers.pid(id.store()))
                .await;
        match measured {
            Ok(p) => out.push(p),
            Err(e) => {
                worker.close().await;
                return Err(e);
            }
        }
    }
    worker.close().await;
    Ok(out)
}

/// Measures releases with a waiter on every key against releases nobody waits for, on
/// `id`, if it is a backend that wakes waiters. The waiters watch through another instance
/// of the backend (its own connections and listener, as another process's workers would),
/// but on the in-memory backend, whose store is its instance.
async fn waited_releases(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<Option<capacity::waited::WaitedReleases>, BenchError> {
    if !capacity::waited::watching_waits(id) {
        return Ok(None);
    }
    let worker = subjects::open(id, servers).await?;
    let Some(backend) = worker.backend().filter(|b| b.capabilities().wakes_waiters) else {
        worker.close().await;
        return Ok(None);
    };
    let other = if id == SubjectId::Memory {
        None
    } else {
        Some(subjects::open(id, servers).await?)
    };
    let waiters = other.as_ref().and_then(|o| o.backend()).unwrap_or(backend);
    let measured = capacity::waited::waited_releases(
        worker.clone(),
        waiters,
        capacity::waited::TASKS,
        plan,
        servers.pid(id.store()),
    )
    .await;
    worker.close().await;
    if let Some(other) = other {
        other.close().await;
    }
    measured.map(Some)
}

/// The full report: every selected backend and its stores' baselines, measured in turn
/// against servers started for the run, then the report written.
async fn run(args: &Args) -> Result<(), BenchError> {
    let plan = plan(args);
    let backends = selected_backends(args)?;
    let stores = stores_of(&backends);
    let subjects = subjects_of(&backends, &stores);
    let absent = not_selected(&backends);
    let machine = machine(args);
    let bar = progress_bar(&subjects, &plan);
    bar.set_message(format!(
        "starting servers: {}",
        stores
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let servers = Servers::start(&stores).await?;
    bar.inc(1);

    let mut results = Results::default();
    let mut contention = Contention::default();
    for &id in &subjects {
        measure_subject(id, &servers, &plan, &bar, &mut results, &mut contention).await?;
    }
    results.paired = target_pairs(&subjects, &servers, &plan, &bar).await?;
    if subjects.contains(&SubjectId::Redis) {
        results.placed = Some(
            benchmarks::placed::redis_placed_pairs(&servers, &plan, |m| {
                bar.set_message(m.to_owned());
            })
            .await?,
        );
    }
    bar.inc(1);
    for &id in &backends {
        measure_waiters_and_permits(id, &servers, &plan, &bar, &mut results).await?;
    }
    let redis_cost = if subjects.contains(&SubjectId::Redis) {
        Some(redis_cost(args, &servers, &plan, &bar).await?)
    } else {
        None
    };
    drop(servers);

    bar.set_message(format!("memory: holding {} guards", plan.guards));
    bar.inc(1);
    results.memory = Some(measure_guard_memory(&plan).await?);
    bar.inc(1);
    bar.finish_with_message("done");

    write_report(
        args,
        Report {
            machine,
            mode: if args.quick { "quick" } else { "full" }.into(),
            plan,
            results,
            contended: contention.contended,
            handoffs: contention.handoffs,
            renew: contention.renew,
            redis_cost,
            absent,
        },
    )
}

/// The subjects a run measures: the selected backends, and the baselines of their stores.
fn subjects_of(backends: &[SubjectId], stores: &[Store]) -> Vec<SubjectId> {
    SubjectId::ALL
        .into_iter()
        .filter(|s| backends.contains(s) || (!s.is_backend() && stores.contains(&s.store())))
        .collect()
}

/// The report's line for each backend left out of the run.
fn not_selected(backends: &[SubjectId]) -> Vec<String> {
    SubjectId::BACKENDS
        .into_iter()
        .filter(|b| !backends.contains(b))
        .map(|b| {
            format!(
                "`{}` was not selected (`--backends`) in this run.",
                b.slug()
            )
        })
        .collect()
}

/// The machine and its servers' versions, printed at the start of the run.
fn machine(args: &Args) -> Machine {
    let machine = ["redis-server", "postgres", "etcd"]
        .into_iter()
        .fold(Machine::detect(), |machine, server| {
            machine.with_server(server, harness::binary_version(server))
        });
    println!(
        "capacity report ({} run) on {} cores, {} MiB RAM, kernel {}, {}",
        if args.quick { "quick" } else { "full" },
        machine.cores,
        machine.ram_mib.unwrap_or(0),
        machine.kernel,
        machine.date
    );
    let versions: Vec<&str> = machine.servers.iter().map(|(_, v)| v.as_str()).collect();
    println!("servers: {}", versions.join(" | "));
    machine
}

/// The run's progress bar, one step per measurement.
fn progress_bar(subjects: &[SubjectId], plan: &Plan) -> ProgressBar {
    let backend_count = subjects.iter().filter(|s| s.is_backend()).count();
    let steps =
        subjects.len() * plan.levels.len() + backend_count * (2 + plan.batch_sizes.len()) + 2;
    let bar = ProgressBar::new(u64::try_from(steps).unwrap_or(u64::MAX));
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// What the report has of each backend under contention, beside the sweep.
#[derive(Default)]
struct Contention {
    /// One contended key.
    contended: Vec<Sample>,
    /// Handoffs of one key among waiting tasks, notified and polling.
    handoffs: Vec<HandoffRow>,
    /// Renewals per second of one lease.
    renew: Vec<(SubjectId, f64)>,
}

/// The sweep of `id`, printed sample by sample, and of a backend what
/// [`measure_backend`] measures.
async fn measure_subject(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
    bar: &ProgressBar,
    results: &mut Results,
    contention: &mut Contention,
) -> Result<(), BenchError> {
    bar.set_message(format!("{}: connecting", id.slug()));
    let subject = subjects::open(id, servers).await?;
    let samples = scenarios::sweep(subject.clone(), plan, |level| {
        bar.set_message(format!("{}: {level} tasks", id.slug()));
    })
    .await;
    bar.inc(u64::try_from(plan.levels.len()).unwrap_or(0));
    let samples = match samples {
        Ok(s) => s,
        Err(e) => {
            subject.close().await;
            return Err(e);
        }
    };
    for s in &samples {
        // `suspend` prints even when the bar is hidden (output not a terminal).
        bar.suspend(|| {
            println!(
                "{:>24} {:>3} tasks {:>10.0} cycles/s  p50 {:>7.0} µs  p99 {:>7.0} µs",
                id.slug(),
                s.concurrency,
                s.ops_per_sec(),
                s.cycle_us(0.5),
                s.cycle_us(0.99)
            );
        });
    }
    results.sweep.extend(samples);
    if let Some(backend) = subject.backend() {
        measure_backend(id, &subject, &backend, plan, bar, results, contention).await?;
    }
    subject.close().await;
    Ok(())
}

/// One contended key, the handoffs (notified where the backend wakes waiters, and
/// polling), the renew rate and the batches of the backend `id`.
async fn measure_backend(
    id: SubjectId,
    subject: &Arc<dyn Subject>,
    backend: &Arc<dyn LockBackend>,
    plan: &Plan,
    bar: &ProgressBar,
    results: &mut Results,
    contention: &mut Contention,
) -> Result<(), BenchError> {
    bar.set_message(format!(
        "{}: one key, {} tasks",
        id.slug(),
        plan.contended_tasks
    ));
    contention.contended.push(
        load::closed_loop(
            subject.clone(),
            plan.contended_tasks,
            Keys::Shared,
            plan.warmup,
            plan.duration,
        )
        .await?,
    );
    bar.inc(1);
    for notified in [true, false] {
        if notified && !backend.capabilities().wakes_waiters {
            continue;
        }
        bar.set_message(format!(
            "{}: handoff among {} waiters{}",
            id.slug(),
            plan.contended_tasks,
            if notified { ", notified" } else { ", polling" }
        ));
        contention.handoffs.push(
            capacity::handoff::handoff(
                id,
                backend.clone(),
                plan.contended_tasks,
                plan.handoffs,
                notified,
            )
            .await?,
        );
    }
    bar.set_message(format!("{}: renew", id.slug()));
    contention
        .renew
        .push((id, scenarios::renew_rate(id, backend, plan.duration).await?));
    bar.inc(1);
    for &size in &plan.batch_sizes {
        bar.set_message(format!("{}: batches of {size}", id.slug()));
        results
            .batches
            .push(scenarios::batch(id, backend, size, plan.batch_reps).await?);
        bar.inc(1);
    }
    Ok(())
}

/// The interleaved pairs of [`scenarios::TARGET_PAIRS`] whose subjects both run.
async fn target_pairs(
    subjects: &[SubjectId],
    servers: &Servers,
    plan: &Plan,
    bar: &ProgressBar,
) -> Result<Vec<Paired>, BenchError> {
    let mut paired = Vec::new();
    for (a, b, level) in scenarios::TARGET_PAIRS {
        if !(subjects.contains(&a) && subjects.contains(&b)) {
            continue;
        }
        bar.set_message(format!(
            "{} vs {}: {level} tasks, alternating",
            a.slug(),
            b.slug()
        ));
        let sa = subjects::open(a, servers).await?;
        let sb = subjects::open(b, servers).await?;
        let pair = scenarios::paired(sa.clone(), sb.clone(), level, plan.pair_rounds, plan).await;
        sa.close().await;
        sb.close().await;
        paired.push(pair?);
    }
    Ok(paired)
}

/// The releases with a waiter on every key, and the semaphore permit cycles, of the
/// backend `id`.
async fn measure_waiters_and_permits(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
    bar: &ProgressBar,
    results: &mut Results,
) -> Result<(), BenchError> {
    bar.set_message(format!(
        "{}: {} tasks, a waiter on every key and none, alternating",
        id.slug(),
        capacity::waited::TASKS
    ));
    if let Some(w) = waited_releases(id, servers, plan).await? {
        results.waited.push(w);
    }
    bar.set_message(format!(
        "{}: semaphore permits at 1 and 64 tasks, against lock cycles",
        id.slug()
    ));
    results
        .permits
        .extend(permit_cycles(id, servers, plan).await?);
    Ok(())
}

/// What the Redis server spends: per command of a fresh-key cycle, per cycle at 64 tasks
/// beside rslock, and the memory the fence counters of one-off keys keep.
async fn redis_cost(
    args: &Args,
    servers: &Servers,
    plan: &Plan,
    bar: &ProgressBar,
) -> Result<RedisServerCost, BenchError> {
    bar.set_message("redis: server-side cost per command");
    let redis = subjects::open(SubjectId::Redis, servers).await?;
    let raw = subjects::open(SubjectId::RedisSetNx, servers).await?;
    let rslock = subjects::open(SubjectId::Rslock, servers).await?;
    let calls = if args.quick { 200 } else { 5_000 };
    let mut cost =
        benchmarks::server_cost::redis_server_cost(servers, &redis, &raw, &rslock, calls).await?;
    let keys = if args.quick { 10_000 } else { 1_000_000 };
    bar.set_message(format!(
        "redis: {keys} one-off keys, then their counters' retention"
    ));
    bar.set_message("redis: server CPU per cycle at 64 tasks, beside rslock");
    cost.loaded = benchmarks::server_cost::loaded_cycle_costs(
        servers,
        &redis,
        &rslock,
        64,
        plan.pair_rounds.min(5),
        plan.duration / 3,
    )
    .await?;
    cost.retention = Some(benchmarks::server_cost::fence_retention_memory(servers, keys).await?);
    Ok(cost)
}

/// Writes the report and prints its targets and the files written.
fn write_report(args: &Args, report: Report) -> Result<(), BenchError> {
    let written = report.write_all(&args.out)?;
    println!("\ntargets:");
    for t in report.targets() {
        print_target(&t);
    }
    println!("\nwrote:");
    for path in written {
        println!("  {}", path.display());
    }
    Ok(())
}

/// One subject in closed loop, round after round, shared or pinned: for profiling.
async fn profile(args: &Args) -> Result<(), BenchError> {
    let name = args.profile.as_deref().unwrap_or_default();
    let id = SubjectId::from_slug(name).ok_or_else(|| BenchError::Unexpected {
        subject: "--profile",
        detail: format!(
            "unknown subject {name:?}; expected one of: {}",
            SubjectId::ALL.map(SubjectId::slug).join(", ")
        ),
    })?;
    let plan = plan(args);
    let servers = Servers::start(&[id.store()]).await?;
    let server = servers.pid(id.store());
    let subject = subjects::open(id, &servers).await?;
    let pinned = if args.pinned {
        match capacity::affinity::pick()
            .and_then(|(s, c)| Ok((s, c, server.ok_or("the server's pid is unknown")?)))
            .and_then(|(s, c, pid)| Ok((s, c, capacity::affinity::pin(pid, s, c)?)))
        {
            Ok((s, c, pinned)) => {
                println!("pinned: server on CPU {s}, this process on CPU {c}");
                Some(pinned)
            }
            Err(reason) => {
                println!("not pinned, running shared: {reason}");
                None
            }
        }
    } else {
        None
    };
    // Pinned, a Redis subject runs on a runtime of the client's one CPU, as the pairs do.
    let on_own_runtime = match id.store() {
        Store::Redis => Some(benchmarks::placed::open_on_redis(servers.redis_url()?)),
        _ => None,
    };
    println!(
        "profiling {} at {} tasks, {} rounds of {:?} (after {:?} of warm-up each); \
         this process: pid {}, server: pid {}",
        id.slug(),
        args.tasks,
        plan.pair_rounds,
        plan.duration,
        plan.warmup,
        std::process::id(),
        server.map_or("-".into(), |p| p.to_string())
    );
    let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for round in 1..=plan.pair_rounds {
        let m = match (&pinned, &on_own_runtime) {
            (Some(_), Some(open)) => {
                capacity::placement::measure_on_own_runtime(
                    open,
                    id,
                    args.tasks,
                    plan.warmup,
                    plan.duration,
                    server,
                )
                .await
            }
            _ => {
                capacity::placement::measure(
                    subject.clone(),
                    args.tasks,
                    plan.warmup,
                    plan.duration,
                    server,
                )
                .await
            }
        };
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                subject.close().await;
                return Err(e);
            }
        };
        println!(
            "round {round:>3}: {:>9.0} cycles/s  client {:>6} µs CPU/cycle  server {:>6} µs \
             CPU/cycle  client {:>5} switches/cycle",
            m.per_sec,
            us(m.client_us),
            us(m.server_us),
            m.client_switches.map_or("-".into(), |v| format!("{v:.2}"))
        );
    }
    subject.close().await;
    Ok(())
}

/// Prints one target with its verdict.
fn print_target(t: &Target) {
    let verdict = match t.met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    };
    println!(
        "  {:<72} goal {:<12} measured {:<14} {verdict}",
        t.what, t.goal, t.measured
    );
}

/// Runs the guard memory measurement in a fresh copy of this program, so that nothing
/// measured before it (allocator caches, connection buffers) counts against the guards.
async fn measure_guard_memory(plan: &Plan) -> Result<GuardMemory, BenchError> {
    let err = |detail: String| BenchError::Unexpected {
        subject: "guard memory",
        detail,
    };
    let exe = std::env::current_exe().map_err(|e| err(e.to_string()))?;
    let output = tokio::process::Command::new(exe)
        .arg("--guard-memory")
        .arg(plan.guards.to_string())
        .arg("--guard-ttl-ms")
        .arg(plan.guard_ttl.as_millis().to_string())
        .output()
        .await
        .map_err(|e| err(e.to_string()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(err(format!(
            "the measuring process failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    GuardMemory::parse(&stdout).ok_or_else(|| err(format!("unreadable output: {stdout:?}")))
}
