//! Semaphore permits: permit acquire + release cycles of one backend, at 1 and 64 tasks,
//! against the same backend's lock cycles, in alternating rounds in one run.
//!
//! # What is measured
//!
//! `tasks` tasks share one semaphore of as many permits, `bench:<backend>:permits`. Each
//! task takes a permit as [`distlock_core::Semaphore::try_acquire`] does (its slots, from
//! slot 0 on a backend with a permit index, else from a random one onwards, to
//! [`LockBackend::acquire_any`]) and releases it, back to back.
//! Every attempt finds a permit (a task holds none when it asks, and there are as many
//! permits as tasks), but the slots it tries first may be held by the others: on a
//! backend that asks key by key, every held slot it meets costs a round trip; on one
//! with a script of its own (Redis single node), none. The *lock* rounds run the
//! backend's lock cycles on a key per task, as the sweep does. The rate is cycles per
//! second, so the ratio of the two is what a permit costs against a lock.

use std::sync::Arc;

use async_trait::async_trait;
use distlock_core::{LockBackend, LockKey};
use tokio::time::Instant;

use crate::error::BenchError;
use crate::load::{self, Keys};
use crate::plan::Plan;
use crate::subject::{BenchKey, Cycle, Subject, SubjectId, TTL};
use crate::target::Target;
use crate::waited::{Side, measure};

/// The task counts measured: one worker, and a busy pool.
pub const TASKS: [usize; 2] = [1, 64];

/// One backend's permit and lock rounds at one task count.
#[derive(Clone, Debug)]
pub struct PermitCycles {
    /// The backend.
    pub subject: SubjectId,
    /// Tasks running cycles at once; the semaphore has as many permits.
    pub tasks: usize,
    /// The rounds of permit cycles.
    pub permit: Side,
    /// The rounds of lock cycles, a key per task.
    pub lock: Side,
}

impl PermitCycles {
    /// Permit cycles/s over lock cycles/s, round by round.
    pub fn ratios(&self) -> Vec<f64> {
        self.permit
            .per_sec
            .iter()
            .zip(&self.lock.per_sec)
            .filter(|(_, l)| **l > 0.0)
            .map(|(p, l)| p / l)
            .collect()
    }

    /// The median round's ratio.
    pub fn ratio(&self) -> Option<f64> {
        let mut ratios = self.ratios();
        ratios.sort_by(f64::total_cmp);
        ratios.get(ratios.len() / 2).copied()
    }
}

/// The targets on `rows`: with 64 tasks on 64 permits, a permit cycle at 0.7× a lock
/// cycle or more, on every backend measured.
pub fn targets(rows: &[PermitCycles]) -> Vec<Target> {
    rows.iter()
        .filter(|p| p.tasks == 64)
        .map(|p| {
            Target::ratio(
                &format!(
                    "{} permit cycles/s / lock cycles/s (64 tasks, 64 permits)",
                    p.subject.slug()
                ),
                0.7,
                true,
                p.ratio(),
            )
            .because(why_missed(p.subject))
        })
        .collect()
}

/// What the profiles found a permit cycle's cost beyond a lock cycle's to come from, on
/// `subject`; `None` where they found no cause.
fn why_missed(subject: SubjectId) -> Option<&'static str> {
    match subject {
        SubjectId::Redis => Some(
            "A grant is `BITPOS`, `SETBIT`, `ZADD` and `SET NX` and a release `GET`, `DEL`, \
             `SETBIT` (the semaphore's index: a bitmap of held slots, a sorted set of when \
             each runs out), against a lock's `SET NX`, `GET`, `DEL`: about four more \
             `redis.call`s per cycle, at ~0.5 µs of the server's own each, and the `ZADD` \
             on a due set of 64 entries (a listpack, updated in place by a walk) about 1 µs \
             (`INFO commandstats`).",
        ),
        SubjectId::PgLease => Some(
            "One statement per attempt, as for a lock, but it probes the slot names in \
             order for the first free one, and an attempt whose name another took between \
             its snapshot and its upsert asks again (1.05 to 1.14 statements per attempt); \
             the server spends about 100 µs more per cycle, not traced further.",
        ),
        SubjectId::PgAdvisory => Some(
            "Slots are asked one by one from a random slot: a round trip, and a try-lock on \
             a pinned session, for each held slot met before a free one.",
        ),
        SubjectId::Etcd => Some(
            "An attempt is a range read of the semaphore's slot keys, then the lock \
             acquire of the first slot it shows free (its own read and txn): one more \
             read, and round trip, than a lock's acquire.",
        ),
        _ => None,
    }
}

/// Measures `worker`'s permit cycles against its lock cycles at `tasks`, alternating the
/// order each round: `plan.pair_rounds` rounds of `plan.warmup` then a third of
/// `plan.duration`, as the target pairs. With `server`, the pid of the server process, the
/// CPU of its process tree per cycle is measured too. `worker` must be a distlock backend.
pub async fn permit_cycles(
    worker: Arc<dyn Subject>,
    tasks: usize,
    plan: &Plan,
    server: Option<u32>,
) -> Result<PermitCycles, BenchError> {
    let id = worker.id();
    let backend = worker.backend().ok_or_else(|| BenchError::Unexpected {
        subject: id.slug(),
        detail: "not a distlock backend: it has no semaphore".into(),
    })?;
    let name = format!("bench:{}:permits", id.slug());
    let slots = (0..tasks)
        .map(|slot| LockKey::new(format!("{name}:permit:{slot}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| BenchError::Lock {
            subject: id.slug(),
            source,
        })?;
    let permits: Arc<dyn Subject> = Arc::new(Permits {
        id,
        backend,
        ring: slots.iter().chain(&slots).cloned().collect(),
    });
    // The permit subject ignores its keys; each task still gets one, as the load asks.
    let permit_keys = load::keys_for(id, "permit-task", tasks, Keys::PerTask)?;
    let lock_keys = load::keys_for(id, "lock-task", tasks, Keys::PerTask)?;
    let mut out = PermitCycles {
        subject: id,
        tasks,
        permit: Side::default(),
        lock: Side::default(),
    };
    for round in 0..plan.pair_rounds.max(1) {
        for permit in [round % 2 == 0, round % 2 != 0] {
            if permit {
                measure(&mut out.permit, &permits, &permit_keys, plan, server).await?;
            } else {
                measure(&mut out.lock, &worker, &lock_keys, plan, server).await?;
            }
        }
    }
    Ok(out)
}

/// The refusals in a row after which a permit cycle fails: no churn of as many tasks as
/// slots refuses a walk that often.
const MOST_REFUSALS: u32 = 100;

/// A permit of one semaphore per cycle: `acquire_any` over its slots from the one
/// `Semaphore` asks first, then release.
struct Permits {
    id: SubjectId,
    backend: Arc<dyn LockBackend>,
    /// The slots twice over, as `Semaphore` keeps them: the slots from any one onwards,
    /// wrapping to slot 0, are one slice of it, handed over without copying a key.
    ring: Arc<[LockKey]>,
}

#[async_trait]
impl Subject for Permits {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, _task: &BenchKey) -> Result<Cycle, BenchError> {
        let lock_err = |source| BenchError::Lock {
            subject: self.id.slug(),
            source,
        };
        let sent = Instant::now();
        // A walk that is not one atomic step (advisory locks ask slot by slot, etcd and
        // the lease table take a slot their snapshot showed free) can find every slot
        // held while the other tasks move from slot to slot, though there are as many
        // slots as tasks: such a refusal is part of the cycle's cost, and the cycle asks
        // again. Only a run of refusals no churn explains is an error.
        let mut refused = 0;
        let permit = loop {
            let n = self.ring.len() / 2;
            let start = distlock_core::permit_first_asked(self.backend.as_ref(), n);
            match self
                .backend
                .acquire_any(&self.ring[start..start + n], TTL)
                .await
                .map_err(lock_err)?
            {
                Some(permit) => break permit,
                None if refused < MOST_REFUSALS => refused += 1,
                None => {
                    return Err(BenchError::Unexpected {
                        subject: self.id.slug(),
                        detail: format!(
                            "every permit was held {MOST_REFUSALS} times in a row, though \
                             there are as many as tasks"
                        ),
                    });
                }
            }
        };
        let acquire = sent.elapsed();
        self.backend.release(&permit).await.map_err(lock_err)?;
        Ok(Cycle {
            acquire,
            acquired: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::memory_subject::MemorySubject;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_round_of_both_sides_is_measured() {
        let plan = Plan {
            warmup: Duration::from_millis(5),
            duration: Duration::from_millis(60),
            pair_rounds: 3,
            ..Plan::quick()
        };
        let worker = Arc::new(MemorySubject::new());
        let p = permit_cycles(worker, 8, &plan, None).await.unwrap();
        assert_eq!(p.ratios().len(), 3, "{p:?}");
        assert!(p.permit.per_sec.iter().all(|r| *r > 0.0), "{p:?}");
        assert!(p.ratio().is_some());
    }
}
