//! The full run: every selected backend and its stores' baselines measured in turn, step by
//! step, and the report written.

use std::sync::Arc;

use benchmarks::BenchError;
use benchmarks::load::{self, Keys, Sample};
use benchmarks::machine::Machine;
use benchmarks::plan::Plan;
use benchmarks::report::Report;
use benchmarks::scenarios::{self, GuardMemory, Paired, RedisServerCost, Results};
use benchmarks::subjects::{self, Servers, Store, Subject, SubjectId};
use capacity::handoff::HandoffRow;
use distlock_core::LockBackend;
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{Args, plan, selected_backends, stores_of};
use crate::measure::{permits, waited_releases};
use crate::print::print_target;

/// The full report: every selected backend and its stores' baselines, measured in turn
/// against servers started for the run, then the report written.
pub(crate) async fn run(args: &Args) -> Result<(), BenchError> {
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
    let measured = measure_on_servers(
        args,
        (&backends, &subjects),
        &servers,
        &plan,
        &bar,
        (&mut results, &mut contention),
    )
    .await;
    let redis_cost = match measured {
        Ok(redis_cost) => redis_cost,
        Err(e) => {
            // The servers, and their logs, go when this returns.
            bar.abandon();
            eprintln!(
                "capacity: failed at: {}\n{}",
                bar.message(),
                servers.log_tails()
            );
            return Err(e);
        }
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

/// Everything the report measures on the servers started for it; the Redis server time
/// per call when Redis is among the subjects.
async fn measure_on_servers(
    args: &Args,
    (backends, subjects): (&[SubjectId], &[SubjectId]),
    servers: &Servers,
    plan: &Plan,
    bar: &ProgressBar,
    (results, contention): (&mut Results, &mut Contention),
) -> Result<Option<RedisServerCost>, BenchError> {
    for &id in subjects {
        measure_subject(id, servers, plan, bar, results, contention).await?;
    }
    results.paired = target_pairs(subjects, servers, plan, bar).await?;
    if subjects.contains(&SubjectId::Redis) {
        results.placed = Some(
            benchmarks::placed::redis_placed_pairs(servers, plan, |m| {
                bar.set_message(m.to_owned());
            })
            .await?,
        );
    }
    bar.inc(1);
    for &id in backends {
        measure_waiters_and_permits(id, servers, plan, bar, results).await?;
    }
    Ok(if subjects.contains(&SubjectId::Redis) {
        Some(redis_cost(args, servers, plan, bar).await?)
    } else {
        None
    })
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

/// The releases with a waiter on every key, the semaphore permit cycles and a full
/// semaphore, of the backend `id`.
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
        "{}: semaphore permits at 1 and 64 tasks, and a full semaphore of {:?} permits, \
         against lock cycles",
        id.slug(),
        plan.full_permits
    ));
    let (rows, full) = permits(id, servers, plan).await?;
    results.permits.extend(rows);
    results.full.push(full);
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
