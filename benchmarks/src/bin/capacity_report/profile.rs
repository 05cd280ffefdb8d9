//! `--profile`: one subject in closed loop, round after round, shared or pinned.

use benchmarks::BenchError;
use benchmarks::subjects::{self, Servers, Store, SubjectId};

use crate::args::{Args, plan};
use crate::print::us;

/// How `--pinned` and `--beside` place the server (its pid) and this process on two CPUs.
type Pin = fn(u32, usize, usize) -> Result<capacity::affinity::Pinned, String>;

/// One subject in closed loop, round after round, shared or pinned: for profiling.
pub(crate) async fn run(args: &Args) -> Result<(), BenchError> {
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
    let pin = match (args.pinned, args.beside) {
        (true, _) => Some(capacity::affinity::pin as Pin),
        (_, true) => Some(capacity::affinity::pin_beside as Pin),
        _ => None,
    };
    let pinned = pin.and_then(|pin| {
        match capacity::affinity::pick()
            .and_then(|(s, c)| Ok((s, c, server.ok_or("the server's pid is unknown")?)))
            .and_then(|(s, c, pid)| Ok((s, c, pin(pid, s, c)?)))
        {
            Ok((s, c, pinned)) => {
                let beside = if args.beside {
                    format!(" (its first runtime worker on CPU {s})")
                } else {
                    String::new()
                };
                println!("pinned: server on CPU {s}, this process on CPU {c}{beside}");
                Some(pinned)
            }
            Err(reason) => {
                println!("not pinned, running shared: {reason}");
                None
            }
        }
    });
    // Pinned, a Redis subject runs on a runtime of the client's one CPU, as the pairs do;
    // beside the server, on this process's runtime, whose first worker is there.
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
    for round in 1..=plan.pair_rounds {
        let m = match (&pinned, &on_own_runtime) {
            (Some(_), Some(open)) if args.pinned => {
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
             CPU/cycle  client {:>5} switches/cycle  waited on a run queue: client {:>6} \
             server {:>6} µs/cycle  server {:>5} reads/cycle",
            m.per_sec,
            us(m.client_us),
            us(m.server_us),
            m.client_switches.map_or("-".into(), |v| format!("{v:.2}")),
            us(m.client_waited_us),
            us(m.server_waited_us),
            m.server_reads.map_or("-".into(), |v| format!("{v:.2}"))
        );
    }
    subject.close().await;
    Ok(())
}
