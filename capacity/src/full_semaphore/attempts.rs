//! The tasks' side of a full semaphore: attempts on a semaphore or a lock through a
//! `Locker`, waiting or not, as a subject of the closed-loop load, and one round of them
//! measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use distlock_core::{LockError, LockKey, Locker, Release, Semaphore};
use tokio::time::Instant;

use super::{CommandStats, Rounds};
use crate::cpu::CpuReading;
use crate::error::BenchError;
use crate::load::{self, Keys};
use crate::plan::Plan;
use crate::subject::{BenchKey, Cycle, Subject, SubjectId};

/// What the tasks attempt.
#[derive(Clone)]
pub(super) enum Attempted {
    /// A lock: the waits on `free`, the refusals on `held`, which the ballast holds
    /// throughout (a wait that ran out may leave `free` held until its TTL: a lock's
    /// grant that came after the deadline is not given back).
    Lock {
        /// The key the tasks wait for.
        free: LockKey,
        /// The key the tasks are refused.
        held: LockKey,
    },
    /// A permit of one semaphore.
    Permits(Semaphore),
}

impl Attempted {
    /// The key the ballast holds for the refusal rounds only: the semaphore's slot the
    /// waits have free.
    pub(super) fn held_for_refusals(&self) -> Option<&LockKey> {
        match self {
            Attempted::Lock { .. } => None,
            Attempted::Permits(semaphore) => semaphore.slots().first(),
        }
    }
}

/// How a round is measured: its plan, the server process whose CPU counts, and the Redis
/// server's command statistics.
pub(super) struct Meter<'a> {
    pub(super) plan: &'a Plan,
    pub(super) server: Option<u32>,
    pub(super) stats: Option<&'a dyn CommandStats>,
}

/// The tasks' attempts: each cycle waits for the lock or a permit and releases it
/// (`wait`), or tries once and must be refused; counts grants, or refusals.
pub(super) struct Attempts {
    id: SubjectId,
    locker: Locker,
    attempted: Attempted,
    wait: bool,
    /// Grants (waits) or refusals, warm-up included: what CPU and commands are per.
    counted: AtomicU64,
}

impl Attempts {
    pub(super) fn new(id: SubjectId, locker: Locker, attempted: Attempted, wait: bool) -> Self {
        Self {
            id,
            locker,
            attempted,
            wait,
            counted: AtomicU64::new(0),
        }
    }

    /// One round: the rate of counted cycles (grants, or refusals) in the window, and
    /// the CPU and Redis command time per counted cycle, go into `rounds`.
    pub(super) async fn measure(
        self: &Arc<Self>,
        rounds: &mut Rounds,
        meter: &Meter<'_>,
    ) -> Result<(), BenchError> {
        // The tasks' keys only name the load's tasks: every task attempts `attempted`.
        let task = BenchKey::new(format!("bench:{}:full:task", self.id.slug()))?;
        if let Some(stats) = meter.stats {
            stats.reset().await?;
        }
        let start = CpuReading::now(meter.server);
        let sample = load::closed_loop_on(
            self.clone(),
            vec![task; meter.plan.full_tasks],
            Keys::Shared,
            meter.plan.warmup,
            meter.plan.duration / 3,
        )
        .await?;
        let end = CpuReading::now(meter.server);
        let counted = self.counted.load(Ordering::SeqCst).max(1) as f64;
        let per_counted = |cpu: std::time::Duration| cpu.as_secs_f64() * 1e6 / counted;
        let side = &mut rounds.side;
        side.per_sec.push(if self.wait {
            sample.acquired_per_sec()
        } else {
            sample.ops_per_sec()
        });
        side.client_us
            .extend(end.client_since(&start).map(per_counted));
        side.server_us
            .extend(end.server_since(&start).map(per_counted));
        if let Some(stats) = meter.stats {
            // The statistics' own commands are not the attempts'.
            let info = stats.read().await?;
            rounds
                .command_us
                .push(usec_of_all_but(&info, &["info", "config"]) / counted);
        }
        Ok(())
    }

    fn lock_err(&self, source: LockError) -> BenchError {
        BenchError::Lock {
            subject: self.id.slug(),
            source,
        }
    }

    /// Waits for the lock or a permit and releases it; a wait that ran out is a cycle
    /// without a grant.
    async fn wait_and_release(&self) -> Result<bool, BenchError> {
        let released = match &self.attempted {
            Attempted::Lock { free, .. } => match self.locker.lock(free).await {
                Ok(guard) => guard.release().await,
                Err(LockError::Timeout { .. }) => return Ok(false),
                Err(e) => return Err(self.lock_err(e)),
            },
            Attempted::Permits(semaphore) => match semaphore.acquire().await {
                Ok(permit) => permit.release().await,
                Err(LockError::Timeout { .. }) => return Ok(false),
                Err(e) => return Err(self.lock_err(e)),
            },
        };
        match released.map_err(|e| self.lock_err(e))? {
            Release::Released => Ok(true),
            other => Err(BenchError::Unexpected {
                subject: self.id.slug(),
                detail: format!("releasing what a wait was granted answered {other:?}"),
            }),
        }
    }

    /// Tries once; the ballast holds everything, so a grant is an error.
    async fn refused(&self) -> Result<(), BenchError> {
        let granted = match &self.attempted {
            Attempted::Lock { held, .. } => self.locker.try_lock(held).await.map(|g| g.is_some()),
            Attempted::Permits(semaphore) => semaphore.try_acquire().await.map(|p| p.is_some()),
        };
        if granted.map_err(|e| self.lock_err(e))? {
            return Err(BenchError::Unexpected {
                subject: self.id.slug(),
                detail: "an attempt on a full semaphore (a held lock) was granted".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Subject for Attempts {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, _task: &BenchKey) -> Result<Cycle, BenchError> {
        let sent = Instant::now();
        let acquired = if self.wait {
            self.wait_and_release().await?
        } else {
            self.refused().await?;
            false
        };
        if acquired || !self.wait {
            self.counted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Cycle {
            acquire: sent.elapsed(),
            acquired,
        })
    }
}

/// The sum of `usec` of every command in an `INFO commandstats` reply but `except`: the
/// time the server spent in the commands of a measurement that read its statistics with
/// `INFO` and reset them with `CONFIG`.
fn usec_of_all_but(info: &str, except: &[&str]) -> f64 {
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(':'))
        .filter(|(command, _)| !except.contains(command))
        .filter_map(|(_, stats)| {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("usec="))?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn commands_time_is_summed_but_for_the_measurements_own() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=3,usec=30,usec_per_call=10.00,\
                    rejected_calls=0\r\ncmdstat_info:calls=1,usec=9,usec_per_call=9.00\r\n\
                    cmdstat_publish:calls=2,usec=4,usec_per_call=2.00\r\n";
        assert_eq!(super::usec_of_all_but(info, &["info", "config"]), 34.0);
        assert_eq!(super::usec_of_all_but(info, &[]), 43.0);
    }
}
