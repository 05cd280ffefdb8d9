//! The measurements of the capacity report and the targets they are judged by:
//! a concurrency sweep of every subject, one contended key per backend, batch calls, and
//! the memory a held guard costs with the watchdog running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::memory::MemoryBackend;
use distlock_core::{LockBackend, LockKey, Locker, Renewal};

use crate::error::BenchError;
use crate::load::{self, Keys, Sample};
use crate::subject::{SubjectId, TTL};

// The plan and the targets have modules of their own; their former paths here still work.
pub use crate::plan::Plan;
pub use crate::target::Target;

/// Keys per second of the batch calls of one backend at one size.
#[derive(Clone, Debug)]
pub struct BatchRow {
    /// The backend.
    pub subject: SubjectId,
    /// Keys per call.
    pub size: usize,
    /// Whether the backend serves batches in one round trip (`Capabilities::native_batch`).
    pub native: bool,
    /// `acquire_many` keys per second (median of the repetitions), if measured.
    pub acquire_keys_per_sec: Option<f64>,
    /// `renew_many` keys per second, if measured.
    pub renew_keys_per_sec: Option<f64>,
    /// Why a size was not measured.
    pub note: Option<String>,
}

/// Measures `acquire_many` and `renew_many` of `size` keys on `backend`, `reps` times.
pub async fn batch(
    subject: SubjectId,
    backend: &Arc<dyn LockBackend>,
    size: usize,
    reps: usize,
) -> Result<BatchRow, BenchError> {
    let caps = backend.capabilities();
    let mut row = BatchRow {
        subject,
        size,
        native: caps.native_batch,
        acquire_keys_per_sec: None,
        renew_keys_per_sec: None,
        note: None,
    };
    if let Some(max) = caps.max_held.filter(|&max| max < size) {
        row.note = Some(format!(
            "not measured: the backend holds at most {max} leases at once (one session each)"
        ));
        return Ok(row);
    }
    let lock_err = |source| BenchError::Lock {
        subject: subject.slug(),
        source,
    };
    let mut acquire_rates = Vec::with_capacity(reps);
    let mut renew_rates = Vec::with_capacity(reps);
    for rep in 0..reps.max(1) {
        let keys = (0..size)
            .map(|i| LockKey::new(format!("bench:{}:batch{size}:{rep}:{i}", subject.slug())))
            .collect::<Result<Vec<_>, _>>()
            .map_err(lock_err)?;
        let start = Instant::now();
        let leases = backend.acquire_many(&keys, TTL).await.map_err(lock_err)?;
        let acquired = start.elapsed();
        let leases: Vec<_> = leases.into_iter().flatten().collect();
        if leases.len() != size {
            return Err(BenchError::Unexpected {
                subject: subject.slug(),
                detail: format!("acquire_many took {} of {size} free keys", leases.len()),
            });
        }
        let start = Instant::now();
        let renewals = backend.renew_many(&leases).await.map_err(lock_err)?;
        let renewed = start.elapsed();
        let lost = renewals
            .iter()
            .filter(|r| !matches!(r, Renewal::Renewed { .. }))
            .count();
        backend.release_many(&leases).await.map_err(lock_err)?;
        if lost > 0 {
            return Err(BenchError::Unexpected {
                subject: subject.slug(),
                detail: format!("renew_many lost {lost} of {size} leases just taken"),
            });
        }
        acquire_rates.push(size as f64 / acquired.as_secs_f64().max(1e-9));
        renew_rates.push(size as f64 / renewed.as_secs_f64().max(1e-9));
    }
    row.acquire_keys_per_sec = Some(median(&mut acquire_rates));
    row.renew_keys_per_sec = Some(median(&mut renew_rates));
    Ok(row)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Measures a renew on `backend`: one lease renewed back to back by one task for
/// `duration`, as renewals per second.
pub async fn renew_rate(
    subject: SubjectId,
    backend: &Arc<dyn LockBackend>,
    duration: Duration,
) -> Result<f64, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: subject.slug(),
        source,
    };
    let key = LockKey::new(format!("bench:{}:renew", subject.slug())).map_err(lock_err)?;
    let lease = backend
        .acquire(&key, TTL)
        .await
        .map_err(lock_err)?
        .ok_or_else(|| BenchError::Unexpected {
            subject: subject.slug(),
            detail: "the renew benchmark's key was not free".into(),
        })?;
    let start = Instant::now();
    let mut renewals = 0u64;
    while start.elapsed() < duration {
        backend.renew(&lease).await.map_err(lock_err)?;
        renewals += 1;
    }
    let elapsed = start.elapsed();
    backend.release(&lease).await.map_err(lock_err)?;
    Ok(renewals as f64 / elapsed.as_secs_f64().max(1e-9))
}

/// What holding guards costs, measured in a process that does nothing else.
#[derive(Clone, Debug, PartialEq)]
pub struct GuardMemory {
    /// Guards held.
    pub guards: usize,
    /// Resident memory growth while taking them, per guard (the store's entry included).
    pub bytes_per_guard: f64,
    /// Resident memory growth of the same number of plain leases without guards, per lease.
    pub bytes_per_plain_lease: f64,
    /// Guards still held after the TTL had passed more than once (renewed by the watchdog).
    pub held_after_renewals: usize,
}

impl GuardMemory {
    /// The guard's own cost: growth per guard minus the store entry and lease alone.
    pub fn bytes_beyond_store(&self) -> f64 {
        self.bytes_per_guard - self.bytes_per_plain_lease
    }

    /// The line the measuring process prints, read back by [`GuardMemory::parse`].
    pub fn to_line(&self) -> String {
        format!(
            "guard-memory guards={} bytes_per_guard={:.1} bytes_per_plain_lease={:.1} held={}",
            self.guards, self.bytes_per_guard, self.bytes_per_plain_lease, self.held_after_renewals
        )
    }

    /// Reads the line of [`GuardMemory::to_line`] from a process's output.
    pub fn parse(output: &str) -> Option<Self> {
        let line = output.lines().find(|l| l.starts_with("guard-memory "))?;
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        };
        Some(Self {
            guards: field("guards")?.parse().ok()?,
            bytes_per_guard: field("bytes_per_guard")?.parse().ok()?,
            bytes_per_plain_lease: field("bytes_per_plain_lease")?.parse().ok()?,
            held_after_renewals: field("held")?.parse().ok()?,
        })
    }
}

/// Resident memory of this process, from `/proc/self/statm`.
fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Holds `count` guards on the memory backend with the watchdog renewing them, and measures
/// resident memory per guard; subtracts nothing, so run it in a fresh process.
///
/// It first takes `count` plain leases (no guards) to learn the store's own share, then
/// `count` guards on other keys, then waits past the TTL and counts the guards still held:
/// all of them, when one watchdog renewed them all in time.
pub async fn guard_memory(count: usize, ttl: Duration) -> Result<GuardMemory, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: "memory",
        source,
    };
    let keys = |prefix: &str| {
        (0..count)
            .map(|i| LockKey::new(format!("{prefix}:{i:08}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(lock_err)
    };
    let backend = Arc::new(MemoryBackend::new());
    let plain_keys = keys("plain")?;
    let guard_keys = keys("guard")?;

    let before = rss_bytes();
    let plain: Vec<_> = backend
        .acquire_many(&plain_keys, ttl * 100)
        .await
        .map_err(lock_err)?
        .into_iter()
        .flatten()
        .collect();
    let plain_growth = rss_bytes().saturating_sub(before);

    let locker = Locker::builder(backend.clone())
        .ttl(ttl)
        .build()
        .map_err(lock_err)?;
    let before = rss_bytes();
    let mut guards = Vec::with_capacity(count);
    for key in &guard_keys {
        if let Some(guard) = locker.try_lock(key).await.map_err(lock_err)? {
            guards.push(guard);
        }
    }
    let guard_growth = rss_bytes().saturating_sub(before);
    tokio::time::sleep(ttl + ttl / 3).await;
    let held = guards.iter().filter(|g| g.is_held()).count();
    drop(plain);
    Ok(GuardMemory {
        guards: guards.len(),
        bytes_per_guard: guard_growth as f64 / count.max(1) as f64,
        bytes_per_plain_lease: plain_growth as f64 / count.max(1) as f64,
        held_after_renewals: held,
    })
}

/// Time the Redis server spends per call (`INFO commandstats`, `usec_per_call`): what the
/// acquire and release scripts cost the server next to the raw commands they replace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RedisServerCost {
    /// Calls measured per command.
    pub calls: usize,
    /// µs per distlock acquire script (the clock and high-water reads, `SET NX PX` and the
    /// high-water write, in Lua).
    pub acquire_script_us: f64,
    /// µs per distlock release script (owner-checked `DEL` of the lock).
    pub release_script_us: f64,
    /// µs per raw `SET key v NX PX`.
    pub set_nx_us: f64,
    /// µs per raw `DEL`.
    pub del_us: f64,
    /// Server µs per acquire + release cycle on fresh keys (every command the cycle sent,
    /// summed over `INFO commandstats`), for each subject measured: distlock, `rslock`,
    /// the raw `SET NX PX` + `DEL`; the median of [`RedisServerCost::cycle_rounds`].
    pub cycle_us: Vec<(SubjectId, f64)>,
    /// The same, round by round: the subjects run in alternation (the order turning each
    /// round), so a busy spell of the machine falls on all of them alike.
    pub cycle_rounds: Vec<Vec<(SubjectId, f64)>>,
    /// The server's CPU per cycle while many tasks run cycles at once (where distlock
    /// coalesces), for distlock and `rslock`, alternating.
    pub loaded: Vec<LoadedCycleCost>,
    /// Token counters left behind after many keys were locked once each.
    pub retention: Option<FenceRetentionMemory>,
}

impl RedisServerCost {
    /// distlock's server µs per sequential cycle on fresh keys over `rslock`'s: the median
    /// of the rounds' ratios, or the ratio of the medians when no rounds were kept.
    pub fn sequential_ratio(&self) -> Option<f64> {
        let mut ratios = self.sequential_ratios();
        if !ratios.is_empty() {
            ratios.sort_by(f64::total_cmp);
            return Some(ratios[ratios.len() / 2]);
        }
        let of = |subject: SubjectId| {
            self.cycle_us
                .iter()
                .find(|(s, _)| *s == subject)
                .map(|(_, us)| *us)
        };
        of(SubjectId::Redis)
            .zip(of(SubjectId::Rslock))
            .map(|(d, r)| d / r)
    }

    /// distlock's server µs per sequential cycle over `rslock`'s, round by round.
    pub fn sequential_ratios(&self) -> Vec<f64> {
        self.cycle_rounds
            .iter()
            .filter_map(|round| {
                let of = |subject: SubjectId| {
                    round.iter().find(|(s, _)| *s == subject).map(|(_, us)| *us)
                };
                of(SubjectId::Redis)
                    .zip(of(SubjectId::Rslock))
                    .map(|(d, r)| d / r)
            })
            .collect()
    }

    /// distlock's median server CPU per cycle under load over `rslock`'s.
    pub fn loaded_ratio(&self) -> Option<f64> {
        let of = |subject: SubjectId| {
            let mut cpu: Vec<f64> = self
                .loaded
                .iter()
                .filter(|l| l.subject == subject)
                .map(|l| l.cpu_us_per_cycle)
                .collect();
            (!cpu.is_empty()).then(|| median(&mut cpu))
        };
        of(SubjectId::Redis)
            .zip(of(SubjectId::Rslock))
            .map(|(d, r)| d / r)
    }
}

/// What the Redis server spent per cycle during one closed-loop run of many tasks.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedCycleCost {
    /// The subject measured.
    pub subject: SubjectId,
    /// Tasks running at once.
    pub concurrency: usize,
    /// Cycles per second in the run.
    pub cycles_per_sec: f64,
    /// The server's CPU time (`used_cpu_user` + `used_cpu_sys` of `INFO cpu`) per cycle, in
    /// µs: commands, scripts, and the socket work of reading and answering them.
    pub cpu_us_per_cycle: f64,
    /// Commands the server ran per cycle (`INFO commandstats` calls, those a script runs
    /// included): fewer than one script call per acquire and release when calls coalesce.
    pub commands_per_cycle: f64,
}

/// What a million one-off keys leave in Redis once their fence retention has run out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FenceRetentionMemory {
    /// Keys locked and released once each.
    pub keys: usize,
    /// The fence retention the backend used.
    pub retention: std::time::Duration,
    /// `used_memory` before the keys were locked.
    pub before: u64,
    /// `used_memory` right after the last release (the counters still kept).
    pub after_release: u64,
    /// `used_memory` once the counters expired (or after two minutes of waiting).
    pub after_retention: u64,
    /// How long the counters took to go after the retention ran out.
    pub expired_within: std::time::Duration,
}

impl FenceRetentionMemory {
    /// Bytes still used beyond the start, negative when less.
    pub fn left_behind(&self) -> i64 {
        i64::try_from(self.after_retention).unwrap_or(i64::MAX)
            - i64::try_from(self.before).unwrap_or(i64::MAX)
    }
}

/// The sum of `usec` of `commands` in an `INFO commandstats` reply: the time the server
/// spent on them since the last `CONFIG RESETSTAT`. Name only the commands the client
/// sent: a script's `usec` already includes the commands it ran, which are also counted
/// under their own names.
pub fn usec_of(info: &str, commands: &[&str]) -> f64 {
    commands
        .iter()
        .filter_map(|command| {
            let line = info
                .lines()
                .find(|l| l.starts_with(&format!("cmdstat_{command}:")))?;
            line.split([':', ','])
                .find_map(|kv| kv.strip_prefix("usec="))?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .sum()
}

/// Calls of every command in `INFO commandstats` text, summed.
pub fn calls_of_all(info: &str) -> f64 {
    info.lines()
        .filter_map(|l| l.split([':', ',']).find_map(|kv| kv.strip_prefix("calls=")))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

/// `used_cpu_user` + `used_cpu_sys` of `INFO cpu` text, in seconds.
pub fn used_cpu(info: &str) -> Option<f64> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some(field("used_cpu_user:")? + field("used_cpu_sys:")?)
}

/// Reads `usec_per_call` of `command` from an `INFO commandstats` reply.
pub fn usec_per_call(info: &str, command: &str) -> Option<f64> {
    let line = info
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))?;
    line.split([':', ','])
        .find_map(|kv| kv.strip_prefix("usec_per_call="))?
        .trim()
        .parse()
        .ok()
}

/// Two subjects measured in alternation at one concurrency, round after round, so that
/// both see the same machine: on a shared machine the load from other processes moves
/// within seconds, and measuring one subject minutes after the other would compare noise.
#[derive(Clone, Debug)]
pub struct Paired {
    /// The subject whose ratio is reported.
    pub a: SubjectId,
    /// The subject it is compared with.
    pub b: SubjectId,
    /// Tasks running at once.
    pub concurrency: usize,
    /// `a`'s cycles/s over `b`'s, per round.
    pub throughput_ratios: Vec<f64>,
    /// `a`'s acquire p50 over `b`'s, per round.
    pub acquire_p50_ratios: Vec<f64>,
}

impl Paired {
    /// The median round's throughput ratio.
    pub fn throughput_ratio(&self) -> f64 {
        median(&mut self.throughput_ratios.clone())
    }

    /// The median round's acquire-p50 ratio.
    pub fn acquire_p50_ratio(&self) -> f64 {
        median(&mut self.acquire_p50_ratios.clone())
    }
}

/// The pairs the targets are judged on: (subject, compared with, concurrency).
pub const TARGET_PAIRS: [(SubjectId, SubjectId, usize); 8] = [
    (SubjectId::Redis, SubjectId::RedisSetNx, 1),
    (SubjectId::Redis, SubjectId::RedisTwoStep, 1),
    (SubjectId::Redis, SubjectId::Rslock, 64),
    (SubjectId::Etcd, SubjectId::EtcdRawSameOps, 1),
    (SubjectId::PgLease, SubjectId::PgRawLease, 1),
    (SubjectId::PgLease, SubjectId::PgRawLease, 64),
    (SubjectId::PgAdvisory, SubjectId::PgRawAdvisoryToken, 1),
    (SubjectId::PgAdvisory, SubjectId::PgRawAdvisoryToken, 64),
];

/// Measures `a` then `b` (then `b` then `a`, alternating the order) for `rounds` rounds.
pub async fn paired(
    a: Arc<dyn crate::subject::Subject>,
    b: Arc<dyn crate::subject::Subject>,
    concurrency: usize,
    rounds: usize,
    plan: &Plan,
) -> Result<Paired, BenchError> {
    let mut out = Paired {
        a: a.id(),
        b: b.id(),
        concurrency,
        throughput_ratios: Vec::with_capacity(rounds),
        acquire_p50_ratios: Vec::with_capacity(rounds),
    };
    let measure = |s: &Arc<dyn crate::subject::Subject>| {
        load::closed_loop(
            s.clone(),
            concurrency,
            Keys::PerTask,
            plan.warmup,
            plan.duration / 3,
        )
    };
    for round in 0..rounds.max(1) {
        let (sa, sb) = if round % 2 == 0 {
            let sa = measure(&a).await?;
            (sa, measure(&b).await?)
        } else {
            let sb = measure(&b).await?;
            (measure(&a).await?, sb)
        };
        if sb.ops_per_sec() > 0.0 && sb.acquire_us(0.5) > 0.0 {
            out.throughput_ratios
                .push(sa.ops_per_sec() / sb.ops_per_sec());
            out.acquire_p50_ratios
                .push(sa.acquire_us(0.5) / sb.acquire_us(0.5));
        }
    }
    Ok(out)
}

/// Everything the targets are computed from.
#[derive(Clone, Debug, Default)]
pub struct Results {
    /// The concurrency sweep.
    pub sweep: Vec<Sample>,
    /// The batch measurements.
    pub batches: Vec<BatchRow>,
    /// The guard memory measurement.
    pub memory: Option<GuardMemory>,
    /// The interleaved pairs of [`TARGET_PAIRS`].
    pub paired: Vec<Paired>,
    /// Releases with a waiter on every key against releases nobody waits for.
    pub waited: Vec<crate::waited::WaitedReleases>,
    /// Semaphore permit cycles against lock cycles, per backend and task count.
    pub permits: Vec<crate::permits::PermitCycles>,
    /// A full semaphore at each size against a lock in the same state, per backend.
    pub full: Vec<crate::full_semaphore::FullSemaphore>,
    /// The Redis pairs at 16 and 64 tasks, shared and pinned, when Redis ran.
    pub placed: Option<crate::placement::PlacedPairs>,
}

impl Results {
    /// The sweep sample of `subject` at `concurrency`.
    pub fn sample(&self, subject: SubjectId, concurrency: usize) -> Option<&Sample> {
        self.sweep
            .iter()
            .find(|s| s.subject == subject && s.concurrency == concurrency)
    }

    /// Throughput of `a` over throughput of `b` at `concurrency`, in the sweep.
    pub fn throughput_ratio(&self, a: SubjectId, b: SubjectId, concurrency: usize) -> Option<f64> {
        let (a, b) = (self.sample(a, concurrency)?, self.sample(b, concurrency)?);
        (b.ops_per_sec() > 0.0).then(|| a.ops_per_sec() / b.ops_per_sec())
    }

    fn pair(&self, a: SubjectId, b: SubjectId, concurrency: usize) -> Option<&Paired> {
        self.paired
            .iter()
            .find(|p| p.a == a && p.b == b && p.concurrency == concurrency)
            .filter(|p| !p.throughput_ratios.is_empty())
    }

    /// The throughput ratio a target is judged on: the interleaved pair's median when it
    /// was measured, else the sweep's.
    fn judged_throughput(&self, a: SubjectId, b: SubjectId, concurrency: usize) -> Option<f64> {
        self.pair(a, b, concurrency)
            .map(Paired::throughput_ratio)
            .or_else(|| self.throughput_ratio(a, b, concurrency))
    }

    /// The targets, each with this run's value.
    pub fn targets(&self) -> Vec<Target> {
        let ratio = Target::ratio;
        let acquire_p50 = |s: SubjectId| self.sample(s, 1).map(|s| s.acquire_us(0.5));
        let acquire_ratio = self
            .pair(SubjectId::Redis, SubjectId::RedisSetNx, 1)
            .map(Paired::acquire_p50_ratio)
            .or_else(|| {
                acquire_p50(SubjectId::Redis)
                    .zip(acquire_p50(SubjectId::RedisSetNx))
                    .map(|(a, b)| a / b)
            });
        let mut out = vec![
            ratio(
                "Redis acquire p50 / raw SET NX PX p50 (1 task)",
                1.15,
                false,
                acquire_ratio,
            ),
            ratio(
                "Redis acquire+release cycles/s / article two-step design (1 task)",
                1.3,
                true,
                self.judged_throughput(SubjectId::Redis, SubjectId::RedisTwoStep, 1),
            ),
            ratio(
                "Redis cycles/s / rslock lock+unlock (64 tasks, one client)",
                1.1,
                true,
                self.judged_throughput(SubjectId::Redis, SubjectId::Rslock, 64),
            )
            .because(crate::placement::SHARED_AT_64),
        ];
        let many = self
            .batches
            .iter()
            .find(|b| b.subject == SubjectId::Redis && b.size == 1_000)
            .and_then(|b| b.acquire_keys_per_sec);
        out.push(
            Target::judged(
                "Redis acquire_many(1000) keys/s",
                ">= 500,000".into(),
                500_000.0,
                true,
                many,
                |k| format!("{k:.0}"),
            )
            .because(
                "Each key is a `SET NX PX` inside the batch script, with its owner id and TTL \
                 as arguments: about 1.3 µs of script time per key on the server (165 µs per \
                 125-key call in `INFO commandstats`, redis-server 7.0.15), which alone \
                 allows ~750k keys/s, while the client builds, sends and reads its part on \
                 the same two cores (each call goes out as soon as it is built).",
            ),
        );
        // PostgreSQL: the store as deployed (`fsync=on`), against its own SQL sent raw.
        for (backend, tasks, goal) in [
            (SubjectId::Etcd, 1, 0.9),
            (SubjectId::PgLease, 1, 0.95),
            (SubjectId::PgLease, 64, 0.9),
            (SubjectId::PgAdvisory, 1, 0.95),
            (SubjectId::PgAdvisory, 64, 0.9),
        ] {
            let Some(baseline) = backend.baseline() else {
                continue;
            };
            let plural = if tasks == 1 { "task" } else { "tasks" };
            out.push(ratio(
                &format!(
                    "{} cycles/s / {} ({tasks} {plural})",
                    backend.slug(),
                    baseline.slug()
                ),
                goal,
                true,
                self.judged_throughput(backend, baseline, tasks),
            ));
        }
        // PostgreSQL: announcing waited releases must not cost their throughput.
        for backend in [SubjectId::PgLease, SubjectId::PgAdvisory] {
            let measured = self.waited.iter().find(|w| w.subject == backend);
            out.push(
                ratio(
                    &format!(
                        "{} cycles/s with a waiter on every key / with none ({} tasks)",
                        backend.slug(),
                        crate::waited::TASKS
                    ),
                    0.9,
                    true,
                    measured.and_then(crate::waited::WaitedReleases::ratio),
                )
                .because(
                    "Each waited release is announced: the announcer's `pg_notify` \
                     statement and the listener session's deliveries on the server, the \
                     listener and the woken waiter in the client (the CPU columns of \
                     \"Releases with a waiter on every key\" below). Where client and \
                     server share two cores the rate follows the CPU per cycle.",
                ),
            );
        }
        // Semaphores: a free permit near a lock's cost, a full one's not growing with N.
        out.extend(crate::permits::targets(&self.permits));
        for full in &self.full {
            out.extend(full.targets());
        }
        if let Some(placed) = &self.placed {
            out.extend(placed.targets());
        }
        let per_guard = self.memory.as_ref().map(GuardMemory::bytes_beyond_store);
        let met = per_guard.map(|b| b < 1024.0);
        out.push(Target {
            what: "memory per held guard with the watchdog (beyond the store entry)".into(),
            goal: "< 1024 B".into(),
            measured: per_guard.map_or("not measured in this run".into(), |b| format!("{b:.0} B")),
            met,
            short_by: per_guard
                .zip(met)
                .and_then(|(b, met)| (!met).then_some(b / 1024.0 - 1.0)),
            why: None,
        });
        out
    }
}

/// Runs the sweep of one subject: every concurrency level of `plan`, in order.
pub async fn sweep(
    subject: Arc<dyn crate::subject::Subject>,
    plan: &Plan,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Sample>, BenchError> {
    let mut samples = Vec::with_capacity(plan.levels.len());
    for &level in &plan.levels {
        progress(level);
        samples.push(
            load::closed_loop(
                subject.clone(),
                level,
                Keys::PerTask,
                plan.warmup,
                plan.duration,
            )
            .await?,
        );
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::GuardMemory;

    #[test]
    fn usec_per_call_is_read_from_commandstats() {
        let info = "# Commandstats\r\ncmdstat_set:calls=3,usec=30,usec_per_call=10.00,\
                    rejected_calls=0\r\ncmdstat_evalsha:calls=2,usec=9,usec_per_call=4.50\r\n";
        assert_eq!(super::usec_per_call(info, "set"), Some(10.0));
        assert_eq!(super::usec_per_call(info, "evalsha"), Some(4.5));
        assert_eq!(super::usec_per_call(info, "del"), None);
        assert_eq!(super::usec_of(info, &["set", "evalsha", "del"]), 39.0);
        assert_eq!(super::usec_of(info, &["evalsha"]), 9.0);
        assert_eq!(super::calls_of_all(info), 5.0);
    }

    #[test]
    fn used_cpu_adds_user_and_system_time() {
        let info = "# CPU\r\nused_cpu_sys:1.250000\r\nused_cpu_user:2.500000\r\n\
                    used_cpu_sys_children:9.0\r\n";
        assert_eq!(super::used_cpu(info), Some(3.75));
        assert_eq!(super::used_cpu("used_cpu_sys:1.0\r\n"), None);
    }

    #[test]
    fn the_one_client_pair_at_64_tasks_carries_the_shared_placements_cause() {
        let targets = super::Results::default().targets();
        let pair = targets
            .iter()
            .find(|t| t.what == "Redis cycles/s / rslock lock+unlock (64 tasks, one client)")
            .unwrap();
        assert_eq!(pair.why, Some(crate::placement::SHARED_AT_64));
        let p50 = targets
            .iter()
            .find(|t| t.what.starts_with("Redis acquire p50"))
            .unwrap();
        assert_eq!(p50.why, None, "a cause given only where one was found");
    }

    #[test]
    fn guard_memory_line_reads_back_as_written() {
        let m = GuardMemory {
            guards: 100_000,
            bytes_per_guard: 612.5,
            bytes_per_plain_lease: 301.0,
            held_after_renewals: 100_000,
        };
        assert_eq!(
            GuardMemory::parse(&format!("noise\n{}\n", m.to_line())),
            Some(m)
        );
        assert_eq!(GuardMemory::parse("guard-memory guards=x"), None);
    }
}
