//! The five ways a worker can run a job, from no protection to lock + renewal +
//! fencing + idempotency key, and the worker loop that applies one of them to every
//! delivery it receives.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use distlock::{
    EnforcementMode, FencingToken, LockBackend, LockError, LockGuard, LockKey, Locker,
    MemoryFencedResource, Release,
};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::time::sleep;

use super::ledger::{Applied, Ledger};
use super::process::{ProcessLink, process_link};
use super::queue::{Delivery, Queue};
use super::workload::{Fault, Job, Workload};

/// How a worker protects a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Strategy {
    /// Run every delivery.
    NoLock,
    /// Take a lease for the job and release it after the write; nothing renews it.
    Lock,
    /// A [`Locker`] whose watchdog renews the lease while the job runs.
    LockRenew,
    /// As `LockRenew`, and the write is gated on the lease's fencing token.
    LockRenewFence,
    /// As `LockRenewFence`, and the payment carries the idempotency key `payment:{job}`.
    LockRenewFenceIdempotency,
}

impl Strategy {
    /// Every strategy, weakest first: the rows of the report.
    pub const ALL: [Self; 5] = [
        Self::NoLock,
        Self::Lock,
        Self::LockRenew,
        Self::LockRenewFence,
        Self::LockRenewFenceIdempotency,
    ];

    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoLock => "no-lock",
            Self::Lock => "lock",
            Self::LockRenew => "lock+renew",
            Self::LockRenewFence => "lock+renew+fence",
            Self::LockRenewFenceIdempotency => "lock+renew+fence+idempotency",
        }
    }

    fn fences(self) -> bool {
        matches!(self, Self::LockRenewFence | Self::LockRenewFenceIdempotency)
    }

    fn idempotent(self) -> bool {
        self == Self::LockRenewFenceIdempotency
    }
}

/// What happened during one strategy's run, counted as it happens.
#[derive(Debug, Default)]
pub struct Counters {
    /// Executions of a job's body (past the lock, where there is one).
    pub executions: AtomicU64,
    /// Writes the fencing check refused because a newer lease had written.
    pub stale_rejected: AtomicU64,
    /// Writes the idempotency key turned into no-ops.
    pub idempotent_repeats: AtomicU64,
    /// Deliveries whose job lock was held by another worker.
    pub lock_misses: AtomicU64,
    /// Leases that had run out or moved on by the time their holder released them, or
    /// that the watchdog reported lost while the job ran.
    pub lost_leases: AtomicU64,
    /// Worker processes that crashed (after a write, before the ack).
    pub crashes: AtomicU64,
    /// Executions that paused before their write.
    pub pauses: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Everything one strategy's run shares between its workers.
#[derive(Debug)]
pub struct Run {
    /// The strategy every worker applies.
    pub strategy: Strategy,
    /// The jobs.
    pub workload: Arc<Workload>,
    /// The lock store (a fresh one, or a fresh key prefix on a shared store).
    pub store: Arc<dyn LockBackend>,
    /// The jobs' queue.
    pub queue: Queue,
    /// Where payments land.
    pub ledger: Ledger,
    /// The fencing gate in front of the ledger.
    pub fenced: MemoryFencedResource,
    /// What happened.
    pub counters: Counters,
    /// Prepended to every lock key, so runs on a shared store never meet.
    pub key_prefix: String,
    /// Jobs acked so far, shown while the run goes.
    pub progress: ProgressBar,
    /// Per job: whether its first execution (the one its fault hits) has begun.
    first_execution_taken: Vec<AtomicBool>,
}

/// What a worker does with the message after an execution.
enum Outcome {
    /// The job is done: ack.
    Done,
    /// Someone else holds the job's lock: put the message back for a while.
    Missed,
    /// The lease was lost or the write was refused as stale: leave the message for the
    /// queue to redeliver, in case the newer holder does not finish.
    Abandoned,
    /// The worker process died: no ack, no release.
    Crashed,
}

/// One worker process: its link to the store and, for the renewing strategies, the
/// process's `Locker` with its renewal task.
struct Process {
    link: Arc<ProcessLink>,
    locker: Option<Locker>,
}

impl Run {
    /// A run of `strategy` over `workload`; `queue` holds the workload's messages.
    pub fn new(
        strategy: Strategy,
        workload: Arc<Workload>,
        store: Arc<dyn LockBackend>,
        queue: Queue,
        key_prefix: String,
        progress: ProgressBar,
    ) -> Self {
        let first_execution_taken = workload
            .jobs
            .iter()
            .map(|_| AtomicBool::new(false))
            .collect();
        Self {
            strategy,
            workload,
            store,
            queue,
            ledger: Ledger::default(),
            fenced: MemoryFencedResource::new(EnforcementMode::Enforce),
            counters: Counters::default(),
            key_prefix,
            progress,
            first_execution_taken,
        }
    }

    /// One worker: takes deliveries until the queue is drained. A crashed worker comes
    /// back as a new process after the restart delay.
    ///
    /// # Errors
    /// The first error the lock store returns; the run cannot be trusted after it.
    pub async fn worker(self: Arc<Self>) -> Result<(), LockError> {
        let mut process = self.start_process()?;
        while let Some(delivery) = self.queue.receive().await {
            match self.execute(&process, delivery).await? {
                Outcome::Done => {
                    self.queue.ack(delivery.message);
                    self.progress.set_position(self.queue.acked() as u64);
                }
                Outcome::Missed => {
                    self.queue
                        .nack(delivery.message, self.workload.timing.miss_backoff);
                }
                Outcome::Abandoned => {}
                Outcome::Crashed => {
                    bump(&self.counters.crashes);
                    drop(process);
                    sleep(self.workload.timing.restart).await;
                    process = self.start_process()?;
                }
            }
        }
        Ok(())
    }

    fn start_process(&self) -> Result<Process, LockError> {
        let link = Arc::new(process_link(self.store.clone()));
        let locker = match self.strategy {
            Strategy::NoLock | Strategy::Lock => None,
            Strategy::LockRenew
            | Strategy::LockRenewFence
            | Strategy::LockRenewFenceIdempotency => Some(
                Locker::builder(link.clone())
                    .ttl(self.workload.timing.ttl)
                    .build()?,
            ),
        };
        Ok(Process { link, locker })
    }

    async fn execute(&self, process: &Process, delivery: Delivery) -> Result<Outcome, LockError> {
        let job = &self.workload.jobs[delivery.job];
        let key = LockKey::new(format!("{}job:{}", self.key_prefix, job.id))?;
        match (&process.locker, self.strategy) {
            (_, Strategy::NoLock) => Ok(self.run_unlocked(process, delivery.job, job).await),
            (None, _) => self.run_with_lease(process, delivery.job, job, &key).await,
            (Some(locker), _) => {
                self.run_with_guard(process, locker, delivery.job, job, &key)
                    .await
            }
        }
    }

    /// No lock: work, write, ack.
    async fn run_unlocked(&self, process: &Process, index: usize, job: &Job) -> Outcome {
        let fault = self.begin_execution(index);
        sleep(job.work).await;
        self.pause_if(process, fault).await;
        self.write(job, None);
        if fault == Fault::CrashBeforeAck {
            process.link.layer().crash();
            return Outcome::Crashed;
        }
        Outcome::Done
    }

    /// A lease nobody renews: it runs out under any job longer than the TTL, and the
    /// worker, which never looks at it again, writes anyway.
    async fn run_with_lease(
        &self,
        process: &Process,
        index: usize,
        job: &Job,
        key: &LockKey,
    ) -> Result<Outcome, LockError> {
        let Some(lease) = process.link.acquire(key, self.workload.timing.ttl).await? else {
            bump(&self.counters.lock_misses);
            return Ok(Outcome::Missed);
        };
        let fault = self.begin_execution(index);
        sleep(job.work).await;
        self.pause_if(process, fault).await;
        self.write(job, Some(lease.token()));
        if fault == Fault::CrashBeforeAck {
            process.link.layer().crash();
            return Ok(Outcome::Crashed);
        }
        if process.link.release(&lease).await? == Release::NotHeld {
            bump(&self.counters.lost_leases);
        }
        Ok(Outcome::Done)
    }

    /// A renewed lease: the job stops if the lease is lost while it works, checks the
    /// lease right before writing, and (depending on the strategy) fences the write and
    /// keys the payment.
    async fn run_with_guard(
        &self,
        process: &Process,
        locker: &Locker,
        index: usize,
        job: &Job,
        key: &LockKey,
    ) -> Result<Outcome, LockError> {
        let Some(guard) = locker.try_lock(key).await? else {
            bump(&self.counters.lock_misses);
            return Ok(Outcome::Missed);
        };
        let fault = self.begin_execution(index);
        let finished = tokio::select! {
            biased;
            () = guard.lost() => false,
            () = sleep(job.work) => true,
        };
        if !finished || !guard.is_held() {
            bump(&self.counters.lost_leases);
            guard.release().await?;
            return Ok(Outcome::Abandoned);
        }
        // The pause falls between the last check and the write, as a real one can.
        self.pause_if(process, fault).await;
        let written = self.write(job, Some(guard.token()));
        if fault == Fault::CrashBeforeAck {
            process.link.layer().crash();
            drop(guard);
            return Ok(Outcome::Crashed);
        }
        self.finish(guard).await?;
        Ok(if written {
            Outcome::Done
        } else {
            Outcome::Abandoned
        })
    }

    async fn finish(&self, guard: LockGuard) -> Result<(), LockError> {
        if guard.release().await? == Release::NotHeld {
            bump(&self.counters.lost_leases);
        }
        Ok(())
    }

    /// Counts an execution and hands out the job's fault if this is its first one.
    fn begin_execution(&self, index: usize) -> Fault {
        bump(&self.counters.executions);
        let first = !self.first_execution_taken[index].swap(true, Ordering::SeqCst);
        if first {
            self.workload.jobs[index].fault
        } else {
            Fault::None
        }
    }

    async fn pause_if(&self, process: &Process, fault: Fault) {
        if let Fault::PauseBeforeWrite(pause) = fault {
            bump(&self.counters.pauses);
            process.link.layer().freeze(pause);
            sleep(pause).await;
        }
    }

    /// The side effect: a payment, fenced and keyed as the strategy says. False when the
    /// fencing check refused it, which tells the worker it is stale and must stop.
    fn write(&self, job: &Job, token: Option<FencingToken>) -> bool {
        let pay = || {
            if self.strategy.idempotent() {
                let key = format!("payment:{}", job.id);
                if self.ledger.apply_once(&key, job.id, job.amount_cents) == Applied::Repeat {
                    bump(&self.counters.idempotent_repeats);
                }
            } else {
                self.ledger.apply(job.id, job.amount_cents);
            }
        };
        match token.filter(|_| self.strategy.fences()) {
            // The payment runs under the check's lock: no newer token between the two.
            Some(token) => {
                let resource = format!("{}job:{}", self.key_prefix, job.id);
                let admitted = self.fenced.admit_with(&resource, token, pay).is_admitted();
                if !admitted {
                    bump(&self.counters.stale_rejected);
                }
                admitted
            }
            None => {
                pay();
                true
            }
        }
    }
}
