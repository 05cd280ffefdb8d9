//! The single-measurement modes (`--handoff-only`, `--pairs-only`,
//! `--waited-releases-only`, `--permits-only`): one measurement for every selected backend,
//! printed round by round; no report is written.

use benchmarks::BenchError;
use benchmarks::plan::Plan;
use benchmarks::scenarios::{self, Results};
use benchmarks::subjects::{self, Servers, Store, SubjectId};
use capacity::full_semaphore::{Full, FullSemaphore};

use crate::args::{Args, start_selected};
use crate::measure;
use crate::print::{cpu, full_rows, print_target, ratio, rounds, sides};

/// The handoff measurement alone, for every selected backend, notified and polling.
pub(crate) async fn handoff(args: &Args) -> Result<(), BenchError> {
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
pub(crate) async fn pairs(args: &Args) -> Result<(), BenchError> {
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
pub(crate) async fn waited_releases(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    for id in backends {
        let Some(w) = measure::waited_releases(id, &servers, &plan).await? else {
            continue;
        };
        println!(
            "{} at {} tasks, a waiter on every key / none: cycles/s {} (rounds {})\n{}  \
             {} wake-ups for {} waited releases; CPU µs per cycle waited / unwaited: {}",
            id.slug(),
            w.concurrency,
            ratio(w.ratio()),
            rounds(&w.ratios(), 2),
            sides(("waited", &w.waited), ("unwaited", &w.unwaited)),
            w.wakes,
            w.waited_releases,
            cpu(&w.waited, &w.unwaited),
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

/// The semaphore permit cycles alone, and a full semaphore, for every selected backend,
/// with their targets.
pub(crate) async fn permits(args: &Args) -> Result<(), BenchError> {
    let (plan, backends, servers) = start_selected(args).await?;
    for id in backends {
        let (rows, full) = measure::permits(id, &servers, &plan).await?;
        for p in &rows {
            println!(
                "{} at {} tasks, {} permits: permit / lock cycles/s {} (rounds {})\n{}  \
                 CPU µs per cycle permit / lock: {}",
                id.slug(),
                p.tasks,
                p.tasks,
                ratio(p.ratio()),
                rounds(&p.ratios(), 2),
                sides(("permit", &p.permit), ("lock", &p.lock)),
                cpu(&p.permit, &p.lock),
            );
        }
        print_full(&full);
        for t in capacity::permits::targets(&rows)
            .into_iter()
            .chain(full.targets())
        {
            print_target(&t);
        }
        println!();
    }
    Ok(())
}

/// A full semaphore's rows, round by round, and N = 1024 against N = 64.
fn print_full(full: &FullSemaphore) {
    println!(
        "{} full semaphore, {} tasks: waits (N - 1 permits held elsewhere, grants/s) and \
         refusals (all N held, refusals/s); CPU µs per grant / refusal, client / server",
        full.subject.slug(),
        full.tasks
    );
    println!("{}", full_rows("lock", &full.lock));
    for (n, f) in &full.sizes {
        println!("{}", full_rows(&format!("N={n}"), f));
    }
    for (n, why) in &full.left_out {
        println!("  N={n}: not measured: {why}");
    }
    if full.at(1024).is_none() || full.at(64).is_none() {
        return;
    }
    let of = |of: fn(&Full) -> &Vec<f64>| ratio(full.ratio(1024, 64, of));
    println!(
        "  N=1024 / N=64: grants/s {}, refusals/s {}, server µs per refusal {}",
        of(|f| &f.waits.side.per_sec),
        of(|f| &f.refusals.side.per_sec),
        of(|f| &f.refusals.command_us),
    );
}
