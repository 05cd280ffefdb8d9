//! The Redis pairs as deployed: distlock, rslock, the two-step design and raw `SET NX` +
//! `DEL` at 16 and 64 tasks, each both *shared* (redis-server and the client on the same
//! cores, as on a developer's machine) and *pinned* (redis-server on one CPU, the client's
//! threads on another, as in production where they do not compete), in interleaved rounds
//! of one run, with the client's and the server's CPU per cycle beside cycles/s.
//!
//! A pinned client runs on a runtime of its own, started on its one CPU and sized to it
//! ([`std::thread::available_parallelism`] counts the CPUs a process may use, as a
//! container's or a cpuset's would): the process's own runtime has a worker per CPU of
//! the machine, and two workers on one CPU hand each reply to each other through a context
//! switch, a cost no client given one core pays.
//!
//! Each round measures every subject in both placements, the placements' order swapped
//! and the subjects' order rotated every round, so that every ratio compares measurements
//! taken seconds apart. The targets are judged on the median round's ratio.

use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::affinity;
use crate::cpu::CpuReading;
use crate::error::BenchError;
use crate::load::{self, Keys};
use crate::plan::Plan;
use crate::subject::{Subject, SubjectId};
use crate::target::Target;
use crate::waited::Side;

mod table;

/// The subjects measured, distlock first.
pub const SUBJECTS: [SubjectId; 4] = [
    SubjectId::Redis,
    SubjectId::Rslock,
    SubjectId::RedisTwoStep,
    SubjectId::RedisSetNx,
];

/// The concurrency levels measured.
pub const LEVELS: [usize; 2] = [16, 64];

/// Opens a subject (connects it, prepares its scripts) on the runtime it is called on, where
/// its connections' tasks then run.
pub type Open = Arc<
    dyn Fn(SubjectId) -> Pin<Box<dyn Future<Output = Result<Arc<dyn Subject>, BenchError>> + Send>>
        + Send
        + Sync,
>;

/// Where the server and the client run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Both on every core the machine gives them.
    Shared,
    /// The server on one CPU, every thread of the client on another.
    Pinned,
}

impl Placement {
    /// The placement's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Shared => "shared",
            Placement::Pinned => "pinned",
        }
    }
}

/// One closed-loop run of one subject: its rate and what each cycle cost.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// Cycles per second in the measured window.
    pub per_sec: f64,
    /// This process's CPU per cycle, µs (every thread of it, the runtime included).
    pub client_us: Option<f64>,
    /// How many times per cycle a thread of this process was put on a CPU (woken after
    /// sleeping, or preempted): the wake-ups a cycle costs the client.
    pub client_switches: Option<f64>,
    /// The server's CPU per cycle (its process tree), µs.
    pub server_us: Option<f64>,
    /// How long per cycle this process's threads waited on a run queue, ready to run, µs.
    pub client_waited_us: Option<f64>,
    /// How long per cycle the server's main thread waited on a run queue, ready to run, µs.
    pub server_waited_us: Option<f64>,
    /// The server's `read` calls per cycle: how many requests each of its reads found.
    pub server_reads: Option<f64>,
}

/// Runs `subject` at `tasks` for `warmup` unrecorded, then for `duration` between two CPU
/// readings of this process and of `server`.
pub async fn measure(
    subject: Arc<dyn Subject>,
    tasks: usize,
    warmup: Duration,
    duration: Duration,
    server: Option<u32>,
) -> Result<Measured, BenchError> {
    load::closed_loop(
        subject.clone(),
        tasks,
        Keys::PerTask,
        Duration::ZERO,
        warmup,
    )
    .await?;
    let start = CpuReading::now(server);
    let sample = load::closed_loop(subject, tasks, Keys::PerTask, Duration::ZERO, duration).await?;
    let end = CpuReading::now(server);
    let per_cycle = |cpu: Duration| cpu.as_secs_f64() * 1e6 / sample.ops.max(1) as f64;
    Ok(Measured {
        per_sec: sample.ops_per_sec(),
        client_us: end.client_since(&start).map(per_cycle),
        client_switches: end
            .client_switches_since(&start)
            .map(|n| n as f64 / sample.ops.max(1) as f64),
        server_us: end.server_since(&start).map(per_cycle),
        client_waited_us: end.client_waited_since(&start).map(per_cycle),
        server_waited_us: end.server_waited_since(&start).map(per_cycle),
        server_reads: end
            .server_reads_since(&start)
            .map(|n| n as f64 / sample.ops.max(1) as f64),
    })
}

/// [`measure`] of the subject `open` makes, on a runtime of its own whose worker threads
/// are as many as the CPUs this process may use now (one, when pinned), on a thread
/// started now: the subject is opened, measured and closed there, so every task of its
/// client (its connections' included) runs as a client confined to those CPUs runs.
pub async fn measure_on_own_runtime(
    open: &Open,
    id: SubjectId,
    tasks: usize,
    warmup: Duration,
    duration: Duration,
    server: Option<u32>,
) -> Result<Measured, BenchError> {
    let failed = move |detail: String| BenchError::Unexpected {
        subject: id.slug(),
        detail,
    };
    let open = open.clone();
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("client-runtime".into())
        .spawn(move || {
            let workers = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
            let measured = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .enable_all()
                .build()
                .map_err(|e| failed(format!("starting the client's runtime: {e}")))
                .and_then(|runtime| {
                    runtime.block_on(async move {
                        let subject = open(id).await?;
                        let measured =
                            measure(subject.clone(), tasks, warmup, duration, server).await;
                        subject.close().await;
                        measured
                    })
                });
            let _ = done.send(measured);
        })
        .map_err(|e| failed(format!("starting the client's thread: {e}")))?;
    result
        .await
        .map_err(|_| failed("the client's thread ended without a measurement".into()))?
}

/// One subject's rounds in one placement at one level.
#[derive(Clone, Debug)]
pub struct Row {
    /// Shared or pinned.
    pub placement: Placement,
    /// The subject.
    pub subject: SubjectId,
    /// Tasks running at once.
    pub concurrency: usize,
    /// Its rate and CPU per cycle, round by round.
    pub rounds: Side,
}

impl Row {
    fn push(&mut self, m: Measured) {
        self.rounds.per_sec.push(m.per_sec);
        self.rounds.client_us.extend(m.client_us);
        self.rounds.server_us.extend(m.server_us);
    }
}

/// Every row of the Redis pairs, shared and pinned.
#[derive(Clone, Debug, Default)]
pub struct PlacedPairs {
    /// The rows measured.
    pub rows: Vec<Row>,
    /// The CPUs of the pinned rounds (server, client), when they ran.
    pub cpus: Option<(usize, usize)>,
    /// Why the pinned rounds did not run, when they did not.
    pub pinned_skipped: Option<String>,
    /// Rounds per row.
    pub rounds: usize,
}

/// Picks one series of a [`Side`]: cycles/s, or CPU per cycle.
type Of = fn(&Side) -> &Vec<f64>;

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

impl PlacedPairs {
    /// The row of `subject` in `placement` at `concurrency`, if measured.
    pub fn row(
        &self,
        placement: Placement,
        subject: SubjectId,
        concurrency: usize,
    ) -> Option<&Row> {
        self.rows.iter().find(|r| {
            r.placement == placement && r.subject == subject && r.concurrency == concurrency
        })
    }

    /// `a` over `b`, round by round, of the values `of` picks (cycles/s, CPU per cycle).
    pub fn round_ratios(
        &self,
        placement: Placement,
        concurrency: usize,
        (a, b): (SubjectId, SubjectId),
        of: Of,
    ) -> Vec<f64> {
        let (Some(ra), Some(rb)) = (
            self.row(placement, a, concurrency),
            self.row(placement, b, concurrency),
        ) else {
            return Vec::new();
        };
        of(&ra.rounds)
            .iter()
            .zip(of(&rb.rounds))
            .filter(|(_, y)| **y > 0.0)
            .map(|(x, y)| x / y)
            .collect()
    }

    /// The targets of issue #25 in both placements at both levels.
    pub fn targets(&self) -> Vec<Target> {
        let goals: [(SubjectId, &str, f64, bool, Of); 4] = [
            (SubjectId::Rslock, "cycles/s / rslock's", 1.1, true, |s| {
                &s.per_sec
            }),
            (
                SubjectId::RedisTwoStep,
                "cycles/s / the two-step design's",
                1.3,
                true,
                |s| &s.per_sec,
            ),
            (
                SubjectId::RedisSetNx,
                "cycles/s / raw SET NX + DEL's",
                0.8,
                true,
                |s| &s.per_sec,
            ),
            (
                SubjectId::Rslock,
                "client CPU µs per cycle / rslock's",
                1.0,
                false,
                |s| &s.client_us,
            ),
        ];
        let mut out = Vec::new();
        for placement in [Placement::Shared, Placement::Pinned] {
            for level in LEVELS {
                for (other, what, goal, at_least, of) in goals {
                    let ratios = self.round_ratios(placement, level, (SubjectId::Redis, other), of);
                    let value = median(ratios);
                    let why_not = match (placement, &self.pinned_skipped) {
                        (Placement::Pinned, Some(reason)) => format!("not measured: {reason}"),
                        _ => "not measured in this run".into(),
                    };
                    out.push(
                        Target::ratio(
                            &format!("Redis {what} ({level} tasks, {})", placement.name()),
                            goal,
                            at_least,
                            value,
                        )
                        .unmeasured_because(why_not)
                        .because(why_missed(placement, level, other)),
                    );
                }
            }
        }
        out
    }
}

/// What the profiles found a miss of distlock against `rslock` or the two-step design at 64
/// tasks, redis-server and the client sharing the cores, to come from: here and in the
/// sweep's pair (one client, shared).
pub const SHARED_AT_64: &str = "Shared, the scheduler puts three busy threads \
    (redis-server and the client's two runtime workers) on two cores, and moves them \
    between rounds. With a worker held beside redis-server (`capacity --profile SUBJECT \
    --tasks 64 --beside`), the server waits for its core and each of its reads finds many \
    requests, so the others' bare commands reach it batched for free: their server CPU per \
    cycle falls by about 45 % from what it is pinned apart, where distlock's, batched by \
    coalescing already, hardly moves; distlock's lead shrinks to about 1.05x there, from \
    1.6x and more pinned apart. Shared rounds fall between the two placements; the pinned \
    rows give the client a core of its own. Measurements in docs/DESIGN.md (\"Shared, 64 \
    tasks\").";

/// What the profiles found a missed pair target in `placement` at `level` tasks against
/// `other` to come from; `None` where they found no cause (a miss there is a finding).
fn why_missed(placement: Placement, level: usize, other: SubjectId) -> Option<&'static str> {
    match (placement, level, other) {
        (_, 16, _) => Some(
            "At 16 tasks a distlock cycle costs both sides more than the others': the \
             acquire is a script that reads the server's clock and the high-water key and \
             writes the lock and the high-water key (what a fencing token that survives a \
             restart and a clock step costs on Redis 7.0), where `rslock` and the baselines \
             send a bare `SET NX` (the two-step design then an `INCR`); coalescing, which \
             more than pays for that at 64 tasks, finds about 3 calls to share each script \
             call at 16, and the client's runtime parks and wakes more often between \
             bursts of replies. No single hot spot: the profile by cause, and the levers \
             measured and not taken, are in docs/DESIGN.md (\"Shared, 16 tasks\").",
        ),
        (_, _, SubjectId::RedisSetNx) => Some(
            "Raw `SET NX` + `DEL` issues no token and checks no owner: two bare commands \
             against two scripts. Where client and server share two cores, the server's \
             script time (the clock read and the high-water key in the acquire, the owner \
             check in the release) sets the rate; pinned apart, coalescing gathers enough \
             calls to pass it.",
        ),
        (Placement::Shared, _, SubjectId::Rslock | SubjectId::RedisTwoStep) => Some(SHARED_AT_64),
        _ => None,
    }
}

/// Measures every subject of `subjects` (opened on one Redis server, whose pid is
/// `server`) at every level of [`LEVELS`], shared and pinned, in `plan.pair_rounds`
/// interleaved rounds of `plan.duration / 3` each. A pinned round opens each subject
/// again with `open`, on a runtime of the client's one CPU
/// ([`measure_on_own_runtime`]). The pinned rounds are skipped, with the reason kept,
/// when this machine cannot pin (fewer than two CPUs, no server pid).
pub async fn run(
    subjects: &[Arc<dyn Subject>],
    open: &Open,
    server: Option<u32>,
    plan: &Plan,
    mut progress: impl FnMut(&str),
) -> Result<PlacedPairs, BenchError> {
    let rounds = plan.pair_rounds.max(1);
    let mut out = PlacedPairs {
        rounds,
        ..PlacedPairs::default()
    };
    match (affinity::pick(), server) {
        (Ok(cpus), Some(_)) => out.cpus = Some(cpus),
        (Err(reason), _) => out.pinned_skipped = Some(reason),
        (_, None) => out.pinned_skipped = Some("the server's pid is unknown".into()),
    }
    for level in LEVELS {
        for placement in [Placement::Shared, Placement::Pinned] {
            for s in subjects {
                out.rows.push(Row {
                    placement,
                    subject: s.id(),
                    concurrency: level,
                    rounds: Side::default(),
                });
            }
        }
        for round in 0..rounds {
            let mut placements = [Placement::Shared, Placement::Pinned];
            if round % 2 == 1 {
                placements.reverse();
            }
            for placement in placements {
                progress(&format!(
                    "redis pairs: {level} tasks, {}, round {}/{rounds}",
                    placement.name(),
                    round + 1
                ));
                let on = Round {
                    placement,
                    level,
                    round,
                };
                measure_round(&mut out, subjects, open, server, on, plan).await?;
            }
        }
    }
    Ok(out)
}

/// Which round [`measure_round`] measures.
#[derive(Clone, Copy)]
struct Round {
    placement: Placement,
    level: usize,
    round: usize,
}

/// One round of every subject in one placement (nothing when pinning is not possible).
async fn measure_round(
    out: &mut PlacedPairs,
    subjects: &[Arc<dyn Subject>],
    open: &Open,
    server: Option<u32>,
    Round {
        placement,
        level,
        round,
    }: Round,
    plan: &Plan,
) -> Result<(), BenchError> {
    let _pinned = match (placement, out.cpus, server) {
        (Placement::Shared, _, _) => None,
        (Placement::Pinned, Some((server_cpu, client_cpu)), Some(pid)) => {
            match affinity::pin(pid, server_cpu, client_cpu) {
                Ok(pinned) => Some(pinned),
                Err(reason) => {
                    out.cpus = None;
                    out.pinned_skipped = Some(reason);
                    return Ok(());
                }
            }
        }
        (Placement::Pinned, _, _) => return Ok(()),
    };
    for i in 0..subjects.len() {
        let subject = &subjects[(i + round) % subjects.len()];
        let (warmup, duration) = (plan.warmup, plan.duration / 3);
        let measured = match placement {
            Placement::Shared => measure(subject.clone(), level, warmup, duration, server).await?,
            Placement::Pinned => {
                measure_on_own_runtime(open, subject.id(), level, warmup, duration, server).await?
            }
        };
        if let Some(row) = out.rows.iter_mut().find(|r| {
            r.placement == placement && r.subject == subject.id() && r.concurrency == level
        }) {
            row.push(measured);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;
    use parking_lot::Mutex;

    use super::*;
    use crate::subject::{BenchKey, Cycle};

    /// A subject that notes the runtime (its id and worker threads) it was opened on and
    /// each of its cycles ran on.
    struct Noting {
        runtimes: Arc<Mutex<Vec<(tokio::runtime::Id, usize)>>>,
    }

    fn runtime() -> (tokio::runtime::Id, usize) {
        let handle = tokio::runtime::Handle::current();
        (handle.id(), handle.metrics().num_workers())
    }

    #[async_trait]
    impl Subject for Noting {
        fn id(&self) -> SubjectId {
            SubjectId::Redis
        }

        async fn cycle(&self, _key: &BenchKey) -> Result<Cycle, BenchError> {
            self.runtimes.lock().push(runtime());
            tokio::task::yield_now().await;
            Ok(Cycle {
                acquire: Duration::ZERO,
                acquired: true,
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 3)]
    async fn a_client_on_its_own_runtime_is_opened_and_runs_there_with_a_worker_per_cpu() {
        let runtimes = Arc::new(Mutex::new(Vec::new()));
        let noted = runtimes.clone();
        let open: Open = Arc::new(move |_| {
            let runtimes = noted.clone();
            Box::pin(async move {
                runtimes.lock().push(runtime());
                Ok(Arc::new(Noting { runtimes }) as Arc<dyn Subject>)
            })
        });
        let short = Duration::from_millis(20);
        let measured = measure_on_own_runtime(&open, SubjectId::Redis, 4, short, short, None)
            .await
            .unwrap();
        assert!(measured.per_sec > 0.0);
        let cpus = std::thread::available_parallelism().unwrap().get();
        let (caller, _) = runtime();
        let runtimes = runtimes.lock();
        assert!(runtimes.len() > 1, "opened, then cycles: {runtimes:?}");
        let (own, workers) = runtimes[0];
        assert_ne!(own, caller, "opened on a runtime other than the caller's");
        assert_eq!(workers, cpus, "a worker per CPU this process may use");
        assert!(
            runtimes.iter().all(|&(id, _)| id == own),
            "every cycle on the runtime it was opened on"
        );
    }

    fn row(placement: Placement, subject: SubjectId, per_sec: &[f64], client: &[f64]) -> Row {
        Row {
            placement,
            subject,
            concurrency: 16,
            rounds: Side {
                per_sec: per_sec.to_vec(),
                client_us: client.to_vec(),
                server_us: Vec::new(),
            },
        }
    }

    #[test]
    fn targets_are_judged_on_the_median_round_and_skipped_pinning_says_why() {
        let placed = PlacedPairs {
            rows: vec![
                row(
                    Placement::Shared,
                    SubjectId::Redis,
                    &[120.0, 90.0, 100.0],
                    &[9.0, 9.0, 9.0],
                ),
                row(
                    Placement::Shared,
                    SubjectId::Rslock,
                    &[100.0, 100.0, 100.0],
                    &[10.0, 8.0, 10.0],
                ),
            ],
            cpus: None,
            pinned_skipped: Some("one CPU".into()),
            rounds: 3,
        };
        let targets = placed.targets();
        assert_eq!(targets.len(), 16, "4 targets x 2 levels x 2 placements");
        let find = |what: &str| targets.iter().find(|t| t.what == what).unwrap();
        let rslock = find("Redis cycles/s / rslock's (16 tasks, shared)");
        assert_eq!(rslock.measured, "1.000x");
        assert_eq!(rslock.met, Some(false));
        assert!((rslock.short_by.unwrap() - (1.0 - 1.0 / 1.1)).abs() < 1e-9);
        assert!(rslock.why.is_some_and(|why| why.contains("16 tasks")));
        let at_64 = find("Redis cycles/s / rslock's (64 tasks, shared)");
        assert_eq!(at_64.met, None);
        assert!(at_64.why.is_some_and(|why| why.contains("--beside")));
        let pinned_64 = find("Redis cycles/s / the two-step design's (64 tasks, pinned)");
        assert_eq!(
            pinned_64.why, None,
            "no cause recorded: a miss there is a finding"
        );
        let cpu = find("Redis client CPU µs per cycle / rslock's (16 tasks, shared)");
        assert_eq!(cpu.measured, "0.900x");
        assert_eq!(cpu.met, Some(true));
        let pinned = find("Redis cycles/s / rslock's (16 tasks, pinned)");
        assert_eq!(pinned.met, None);
        assert_eq!(pinned.measured, "not measured: one CPU");
        assert!(
            placed
                .markdown(Duration::from_secs(1))
                .contains("pinned rounds not run: one CPU")
        );
    }
}
