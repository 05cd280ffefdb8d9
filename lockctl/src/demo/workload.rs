//! The seeded workload every strategy runs: which jobs arrive when, how long each one
//! works, and which failure hits its first execution.
//!
//! Every duration is a multiple of the lease TTL, so the scenario keeps its shape at any
//! time scale. The failures are chosen so each one defeats a known set of strategies
//! whatever the scheduling, not by luck of timing:
//!
//! - jobs work between 0.3 and 1.8 TTLs, while the queue's visibility timeout is
//!   0.8 TTL: many jobs are redelivered while still running, and a lease that is not
//!   renewed runs out under half of them;
//! - a paused worker freezes for about 5 TTLs between its last lease check and its
//!   write, long enough for the job to be redelivered, re-run and written by another
//!   worker with a newer lease;
//! - a crashed worker has made its payment but never acks, so the job always runs again.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The share of jobs whose first delivery is followed by a duplicate delivery.
const DUPLICATE_SHARE: f64 = 0.2;
/// The share of jobs whose first execution pauses before its write.
const PAUSE_SHARE: f64 = 0.1;
/// The share of jobs whose first execution crashes after its write, before the ack.
const CRASH_SHARE: f64 = 0.08;
/// How busy the workers are, on average, with first executions: spare capacity keeps
/// redelivered jobs from waiting behind a backlog.
const UTILISATION: f64 = 0.5;

/// The timings of the scenario, all derived from the lease TTL.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// The lease TTL every lock strategy uses.
    pub ttl: Duration,
    /// How long a delivered message stays invisible before the queue delivers it again.
    pub visibility_timeout: Duration,
    /// How long a worker that missed the lock puts the message back for.
    pub miss_backoff: Duration,
    /// How long a crashed worker takes to come back.
    pub restart: Duration,
}

impl Timing {
    /// The timings for a lease TTL.
    pub fn for_ttl(ttl: Duration) -> Self {
        Self {
            ttl,
            visibility_timeout: ttl.mul_f64(0.8),
            miss_backoff: ttl.mul_f64(0.25),
            restart: ttl.mul_f64(0.5),
        }
    }
}

/// What goes wrong during a job's first execution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing: the execution works, writes and acks.
    None,
    /// The worker freezes for this long after its last lease check, before its write
    /// (a stop-the-world pause, CPU starvation): its lease is not renewed meanwhile.
    PauseBeforeWrite(Duration),
    /// The worker dies after its write, before the ack (and without releasing its lease).
    CrashBeforeAck,
}

/// One job: a payment of `amount_cents` for job `id`.
#[derive(Clone, Debug)]
pub struct Job {
    /// The job's id, also its lock key and idempotency key suffix.
    pub id: u32,
    /// The payment the job makes.
    pub amount_cents: u64,
    /// When the job is enqueued, from the start of the run.
    pub arrival: Duration,
    /// How long an execution works before its write.
    pub work: Duration,
    /// What goes wrong during the job's first execution.
    pub fault: Fault,
    /// If set, the queue delivers the job's message a second time this long after its
    /// first delivery, while the first is still in flight.
    pub duplicate_after: Option<Duration>,
}

/// The jobs of one run and the timings they were drawn for.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The jobs, in arrival order.
    pub jobs: Vec<Job>,
    /// The timings of the run.
    pub timing: Timing,
}

impl Workload {
    /// Draws `jobs` jobs for `workers` workers from `seed`: the same arguments always
    /// give the same workload.
    pub fn generate(seed: u64, jobs: u32, workers: u32, ttl: Duration) -> Self {
        let timing = Timing::for_ttl(ttl);
        let mut rng = StdRng::seed_from_u64(seed);
        let mean_work = ttl.mul_f64((0.3 + 1.8) / 2.0);
        // Arrivals spread so that first executions keep the workers about half busy.
        let gap = mean_work.mul_f64(1.0 / (UTILISATION * f64::from(workers.max(1))));
        let jobs = (0..jobs)
            .map(|id| {
                let jitter = rng.random_range(0.0..1.0);
                let arrival = gap.mul_f64(f64::from(id) + jitter);
                let work = ttl.mul_f64(rng.random_range(0.3..=1.8));
                let roll: f64 = rng.random_range(0.0..1.0);
                let fault = if roll < PAUSE_SHARE {
                    Fault::PauseBeforeWrite(ttl.mul_f64(rng.random_range(4.5..=5.5)))
                } else if roll < PAUSE_SHARE + CRASH_SHARE {
                    Fault::CrashBeforeAck
                } else {
                    Fault::None
                };
                let duplicate_after = rng
                    .random_bool(DUPLICATE_SHARE)
                    .then(|| ttl.mul_f64(rng.random_range(0.05..=0.4)));
                Job {
                    id,
                    amount_cents: rng.random_range(100..=50_000),
                    arrival,
                    work,
                    fault,
                    duplicate_after,
                }
            })
            .collect();
        Self { jobs, timing }
    }

    /// How many jobs have a duplicate delivery, a pause, a crash, and work longer than
    /// the TTL, for the summary line.
    pub fn census(&self) -> Census {
        let mut census = Census::default();
        for job in &self.jobs {
            census.duplicate_deliveries += u32::from(job.duplicate_after.is_some());
            census.longer_than_ttl += u32::from(job.work > self.timing.ttl);
            match job.fault {
                Fault::None => {}
                Fault::PauseBeforeWrite(_) => census.pauses += 1,
                Fault::CrashBeforeAck => census.crashes += 1,
            }
        }
        census
    }
}

/// Counts of the failures planted in a workload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Jobs delivered twice by the queue.
    pub duplicate_deliveries: u32,
    /// Jobs whose first execution pauses before its write.
    pub pauses: u32,
    /// Jobs whose first execution crashes before its ack.
    pub crashes: u32,
    /// Jobs that work longer than the lease TTL.
    pub longer_than_ttl: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_workload() {
        let ttl = Duration::from_millis(300);
        let a = Workload::generate(7, 50, 8, ttl);
        let b = Workload::generate(7, 50, 8, ttl);
        let c = Workload::generate(8, 50, 8, ttl);
        let shape = |w: &Workload| {
            w.jobs
                .iter()
                .map(|j| {
                    (
                        j.arrival,
                        j.work,
                        j.fault,
                        j.duplicate_after,
                        j.amount_cents,
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(shape(&a), shape(&b));
        assert_ne!(shape(&a), shape(&c));
    }

    #[test]
    fn the_default_workload_plants_every_failure() {
        let w = Workload::generate(42, 200, 24, Duration::from_millis(300));
        let census = w.census();
        assert!(census.pauses > 5, "{census:?}");
        assert!(census.crashes > 5, "{census:?}");
        assert!(census.duplicate_deliveries > 10, "{census:?}");
        assert!(census.longer_than_ttl > 50, "{census:?}");
        for job in &w.jobs {
            if let Fault::PauseBeforeWrite(pause) = job.fault {
                assert!(pause > w.timing.ttl * 4, "a pause must outlast a re-run");
            }
        }
    }
}
