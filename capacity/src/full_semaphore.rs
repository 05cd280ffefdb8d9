//! A full semaphore: what a permit costs when most attempts are refused or wait, at N =
//! 1, 64 and 1024 permits, beside a lock in the same state, in alternating rounds in one
//! run.
//!
//! # What is measured
//!
//! `plan.full_tasks` tasks (64) use one semaphore of N permits (`plan.full_permits`: 1, 64
//! and 1024), `bench:<backend>:full:<N>`, through a
//! [`distlock_core::Locker`], as an application does. Another instance of the backend
//! (the store itself for the in-memory backend), standing for other processes, holds
//! permits of it with a TTL longer than the run: the *ballast*.
//!
//! * *Waits*: the ballast holds N − 1 permits, and the tasks wait for the one left
//!   ([`Semaphore::acquire`](distlock_core::Semaphore::acquire)) and release it at once,
//!   back to back: every release has the other tasks waiting, and every attempt but the
//!   one that wins is refused. Measured: permits granted per second, CPU per grant.
//! * *Refusals*: the ballast holds all N, and the tasks call
//!   [`Semaphore::try_acquire`](distlock_core::Semaphore::try_acquire) back to back, each
//!   refused. Measured: refusals per second, CPU per refusal, and on Redis the server's
//!   time per refusal from `INFO commandstats` ([`CommandStats`]).
//!
//! The *lock* rounds run the same two on a lock key: the tasks waiting in
//! [`Locker::lock`](distlock_core::Locker::lock) for one key, and `try_lock` on a key the
//! ballast holds. Where a permit's cost does not grow with N, the rows at N = 1024 match
//! those at N = 64, and at N = 1 the lock's.
//!
//! A wait is bounded by the round's length ([`wait_bound`]): a task whose wait ran out
//! counts a cycle without a grant, so a round ends even where one grant takes longer.
//! Sizes the ballast cannot hold from one instance (PostgreSQL advisory locks pin a
//! session per lock: [`Capabilities::max_held`](distlock_core::Capabilities::max_held))
//! are left out, with the reason.

mod attempts;
mod ballast;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{LockBackend, LockKey, Locker};

use crate::error::BenchError;
use crate::plan::Plan;
use crate::subject::{SubjectId, TTL};
use crate::target::Target;
use crate::waited::{Side, median};
use attempts::{Attempted, Attempts, Meter};
use ballast::Ballast;

/// What a Redis server spent in the commands it ran: `CONFIG RESETSTAT`, then
/// `INFO commandstats`. The benchmarks give it for the server they started.
#[async_trait]
pub trait CommandStats: Send + Sync {
    /// Zeroes the server's command statistics.
    async fn reset(&self) -> Result<(), BenchError>;
    /// The server's `INFO commandstats` reply.
    async fn read(&self) -> Result<String, BenchError>;
}

/// One kind of cycle's rounds: its rate, its CPU per counted cycle and, on Redis, the
/// server's time in commands per counted cycle (a grant, or a refusal).
#[derive(Clone, Debug, Default)]
pub struct Rounds {
    /// Counted cycles per second (grants, or refusals) and CPU per counted cycle.
    pub side: Side,
    /// `INFO commandstats` µs per counted cycle, round by round; empty off Redis.
    pub command_us: Vec<f64>,
}

impl Rounds {
    /// The median round's server µs in commands per counted cycle.
    pub fn command(&self) -> Option<f64> {
        (!self.command_us.is_empty()).then(|| median(self.command_us.clone()))
    }
}

/// The waits and the refusals of one semaphore size (or of the lock).
#[derive(Clone, Debug, Default)]
pub struct Full {
    /// Grants per second to the waiting tasks of the one permit (or lock) free.
    pub waits: Rounds,
    /// Refused attempts per second of the tasks on a full semaphore (a held lock).
    pub refusals: Rounds,
}

/// One backend's full semaphore at each size, and its lock in the same state.
#[derive(Clone, Debug)]
pub struct FullSemaphore {
    /// The backend.
    pub subject: SubjectId,
    /// The tasks that waited or were refused.
    pub tasks: usize,
    /// The lock: one key the tasks wait for, and one the ballast holds.
    pub lock: Full,
    /// Each size measured: its permits and rounds.
    pub sizes: Vec<(u32, Full)>,
    /// Each size left out, and why.
    pub left_out: Vec<(u32, String)>,
}

impl FullSemaphore {
    /// The rounds at `permits`, if measured.
    pub fn at(&self, permits: u32) -> Option<&Full> {
        self.sizes
            .iter()
            .find(|(n, _)| *n == permits)
            .map(|(_, f)| f)
    }

    /// Median over rounds of `of(large) / of(small)`, the two measured in the same round.
    pub fn ratio(&self, large: u32, small: u32, of: fn(&Full) -> &Vec<f64>) -> Option<f64> {
        let (l, s) = (of(self.at(large)?), of(self.at(small)?));
        let ratios: Vec<f64> = l
            .iter()
            .zip(s)
            .filter(|(_, s)| **s > 0.0)
            .map(|(l, s)| l / s)
            .collect();
        (!ratios.is_empty()).then(|| median(ratios))
    }

    /// This backend's targets: at N = 1024 within 2× of N = 64, grants and refusals per
    /// second, and on Redis the server's time per refusal (not measured in a run without
    /// those sizes).
    pub fn targets(&self) -> Vec<Target> {
        let (slug, tasks) = (self.subject.slug(), self.tasks);
        let why = why_missed(self.subject);
        let mut out: Vec<Target> = [
            Target::ratio(
                &format!("{slug} full semaphore permits/s, N=1024 / N=64 ({tasks} waiting)"),
                0.5,
                true,
                self.ratio(1024, 64, |f| &f.waits.side.per_sec),
            ),
            Target::ratio(
                &format!("{slug} full semaphore refusals/s, N=1024 / N=64 ({tasks} tasks)"),
                0.5,
                true,
                self.ratio(1024, 64, |f| &f.refusals.side.per_sec),
            ),
        ]
        .into_iter()
        .map(|target| target.because(why))
        .collect();
        if self.subject == SubjectId::Redis {
            out.push(Target::ratio(
                "redis server µs per refusal, N=1024 / N=64",
                2.0,
                false,
                self.ratio(1024, 64, |f| &f.refusals.command_us),
            ));
        }
        out
    }
}

/// What the profiles found to make a full semaphore of 1024 permits on `subject` cost
/// more than one of 64; `None` where they found no cause.
fn why_missed(subject: SubjectId) -> Option<&'static str> {
    match subject {
        SubjectId::Memory => Some(
            "`acquire_any` gets the N slot keys and looks each up in the table until one \
             is free: a refusal at N = 1024 looks at 1,024 keys. An index of the \
             semaphore's held slots needs the trait to pass the run (the semaphore, N, the \
             first slot) rather than N keys.",
        ),
        SubjectId::PgLease => Some(
            "The statement probes each of the N names for a free one (in psql, with every \
             slot held: 0.2 ms at N = 64, 1.2 ms at N = 1024). A cost independent of N \
             needs a per-semaphore summary row kept in each grant's transaction: a schema \
             change, and a row every attempt on the semaphore would lock.",
        ),
        SubjectId::Etcd => Some(
            "The range read returns the key of every held slot, 1,024 at N = 1024; a \
             count alone cannot tell which of the N slots are held when other processes \
             name more permits.",
        ),
        _ => None,
    }
}

/// How long a task waits for a permit or the lock: a round's length, warm-up and window,
/// and at least half a second, so that a quick run's waits do not all run out.
pub fn wait_bound(plan: &Plan) -> Duration {
    (plan.warmup + plan.duration / 3).max(Duration::from_millis(500))
}

/// Measures a full semaphore of each of `plan.full_permits` on `worker`, and its lock, in
/// `plan.pair_rounds` alternating rounds of `plan.warmup` then a third of
/// `plan.duration`, the order turning every round. `ballast` is another instance of the
/// same backend (the same one for the in-memory backend). With `server`, the pid of the
/// server process, its CPU per cycle is measured too; with `stats`, the Redis server's
/// time in commands per cycle.
pub async fn full_semaphore(
    id: SubjectId,
    worker: Arc<dyn LockBackend>,
    ballast: Arc<dyn LockBackend>,
    plan: &Plan,
    server: Option<u32>,
    stats: Option<&dyn CommandStats>,
) -> Result<FullSemaphore, BenchError> {
    let lock_err = |source| BenchError::Lock {
        subject: id.slug(),
        source,
    };
    let locker = Locker::builder(worker)
        .ttl(TTL)
        .wait_timeout(Some(wait_bound(plan)))
        .build()
        .map_err(lock_err)?;
    let mut ballast = Ballast::new(id, ballast);
    let key = |name: &str| LockKey::new(format!("bench:{}:full:{name}", id.slug()));
    let (free, held) = (
        key("lock").map_err(lock_err)?,
        key("held").map_err(lock_err)?,
    );
    let mut cases = vec![(Attempted::Lock { free, held }, 0)];
    let mut left_out = Vec::new();
    for &n in &plan.full_permits {
        match ballast.cannot_hold(n) {
            Some(why) => left_out.push((n, why)),
            None => {
                let name = key(&n.to_string()).map_err(lock_err)?;
                let semaphore = locker.semaphore(&name, n).map_err(lock_err)?;
                cases.push((Attempted::Permits(semaphore), n));
            }
        }
    }
    if let Err(e) = ballast.hold_throughout(&cases).await {
        // The first error is the one to report; the leases' TTL frees what stays.
        let _ = ballast.release().await;
        return Err(e);
    }
    let mut measured = vec![Full::default(); cases.len()];
    let meter = Meter {
        plan,
        server,
        stats,
    };
    let run = rounds(id, &cases, &mut measured, &locker, &mut ballast, &meter).await;
    let released = ballast.release().await;
    run?;
    released?;
    let mut measured = measured.into_iter();
    Ok(FullSemaphore {
        subject: id,
        tasks: plan.full_tasks,
        lock: measured.next().unwrap_or_default(),
        sizes: cases
            .iter()
            .skip(1)
            .map(|(_, n)| *n)
            .zip(measured)
            .collect(),
        left_out,
    })
}

/// Every round of every case, its waits and its refusals into `measured` (one per case),
/// the order turning each round.
async fn rounds(
    id: SubjectId,
    cases: &[(Attempted, u32)],
    measured: &mut [Full],
    locker: &Locker,
    ballast: &mut Ballast,
    meter: &Meter<'_>,
) -> Result<(), BenchError> {
    let runs: Vec<(usize, bool)> = (0..cases.len())
        .flat_map(|case| [(case, true), (case, false)])
        .collect();
    for round in 0..meter.plan.pair_rounds.max(1) {
        for i in 0..runs.len() {
            let (case, wait) = runs[(round + i) % runs.len()];
            let attempted = &cases[case].0;
            let attempts = Arc::new(Attempts::new(id, locker.clone(), attempted.clone(), wait));
            let full = &mut measured[case];
            if wait {
                attempts.measure(&mut full.waits, meter).await?;
            } else if let Some(key) = attempted.held_for_refusals() {
                ballast.hold_within(key).await?;
                let refused = attempts.measure(&mut full.refusals, meter).await;
                ballast.let_go(key).await?;
                refused?;
            } else {
                attempts.measure(&mut full.refusals, meter).await?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use distlock_core::Capabilities;
    use distlock_core::memory::MemoryBackend;

    use super::*;
    use crate::waited::Side;

    fn plan() -> Plan {
        Plan {
            warmup: Duration::from_millis(5),
            duration: Duration::from_millis(60),
            pair_rounds: 2,
            full_permits: vec![1, 4, 16],
            full_tasks: 4,
            ..Plan::quick()
        }
    }

    /// [`plan`]'s run on `store`, the worker's calls sent to the store and the ballast's
    /// through a client of it.
    async fn on_memory(store: MemoryBackend) -> FullSemaphore {
        let ballast: Arc<dyn LockBackend> = Arc::new(store.client());
        full_semaphore(
            SubjectId::Memory,
            Arc::new(store),
            ballast,
            &plan(),
            None,
            None,
        )
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_case_is_measured_and_the_ballast_is_given_back() {
        let store = MemoryBackend::new();
        let worker: Arc<dyn LockBackend> = Arc::new(store.client());
        let full = on_memory(store).await;
        assert!(full.left_out.is_empty(), "{full:?}");
        let sizes: Vec<u32> = full.sizes.iter().map(|(n, _)| *n).collect();
        assert_eq!(sizes, [1, 4, 16]);
        for case in std::iter::once(&full.lock).chain(full.sizes.iter().map(|(_, f)| f)) {
            for side in [&case.waits.side, &case.refusals.side] {
                assert_eq!(side.per_sec.len(), 2, "{full:?}");
                assert!(side.per_sec.iter().all(|r| *r > 0.0), "{full:?}");
            }
        }
        // Nothing is left held: every permit of every size, and both lock keys, are free.
        let locker = Locker::new(worker).unwrap();
        for n in [1, 4, 16] {
            let name = LockKey::new(format!("bench:memory:full:{n}")).unwrap();
            let semaphore = locker.semaphore(&name, n).unwrap();
            let all = semaphore.try_acquire_many(n).await.unwrap();
            assert!(all.is_some(), "a permit of {n} is still held");
        }
        for key in ["lock", "held"] {
            let key = LockKey::new(format!("bench:memory:full:{key}")).unwrap();
            assert!(locker.try_lock(&key).await.unwrap().is_some(), "{key}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sizes_one_instance_cannot_hold_are_left_out_with_the_reason() {
        let capped = Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(3),
            Duration::from_secs(3600),
        )
        .wakes_waiters(true)
        .max_held(Some(8));
        let full = on_memory(MemoryBackend::with_capabilities(capped)).await;
        let sizes: Vec<u32> = full.sizes.iter().map(|(n, _)| *n).collect();
        assert_eq!(sizes, [1, 4]);
        assert_eq!(full.left_out.len(), 1, "{full:?}");
        assert_eq!(full.left_out[0].0, 16);
        assert!(full.left_out[0].1.contains("at most 8"), "{full:?}");
    }

    fn refusals(per_sec: &[f64], command_us: &[f64]) -> Full {
        Full {
            waits: Rounds::default(),
            refusals: Rounds {
                side: Side {
                    per_sec: per_sec.to_vec(),
                    ..Side::default()
                },
                command_us: command_us.to_vec(),
            },
        }
    }

    #[test]
    fn n_1024_is_judged_against_n_64_of_the_same_round() {
        let full = FullSemaphore {
            subject: SubjectId::Redis,
            tasks: 64,
            lock: Full::default(),
            sizes: vec![
                (64, refusals(&[100.0, 200.0, 300.0], &[10.0, 10.0, 10.0])),
                (1024, refusals(&[60.0, 40.0, 150.0], &[15.0, 30.0, 25.0])),
            ],
            left_out: Vec::new(),
        };
        // Rounds: 0.6, 0.2, 0.5; the medians of each side would give 60 / 200 = 0.3.
        let refused = full.ratio(1024, 64, |f| &f.refusals.side.per_sec);
        assert_eq!(refused, Some(0.5));
        let targets = full.targets();
        let judged = |what: &str| targets.iter().find(|t| t.what.contains(what)).unwrap();
        assert_eq!(judged("refusals/s").met, Some(true));
        assert_eq!(judged("permits/s").met, None, "no waits measured");
        // 1.5, 3.0, 2.5: median 2.5, above the 2x allowed.
        assert_eq!(judged("server µs per refusal").measured, "2.500x");
        assert_eq!(judged("server µs per refusal").met, Some(false));
    }
}
