//! `lockctl demo --tenants`: at most [`LIMIT`] exports per tenant at once, held by a
//! [`distlock::Semaphore`] under the same pauses and crashes as the payments.
//!
//! Each tenant has [`EXPORTS`] exports of [`STEPS`] steps; [`WORKERS`] worker processes
//! take them from one queue. Per tenant, the first export's worker pauses past the TTL
//! between its permit check and a step's write, and the second export's worker crashes
//! after its first step (its permit is never released: the TTL frees it). Every step
//! written lands in the export ledger with the instant it landed; the report counts, from
//! the ledger alone, the most executions of one tenant's exports that were in progress at
//! once (from an execution's first step written to its last). Three strategies run side
//! by side, each on its own store (or key prefix):
//!
//! - `no-limit`: every worker exports whatever it takes;
//! - `semaphore`: an export waits for a permit and checks it before every step, but a
//!   pause between the check and the write lets a stale step through after its permit
//!   went to another export;
//! - `semaphore+fence`: as `semaphore`, and each step is admitted only with the newest
//!   token of its permit slot, so the stale step is refused and the export goes back to
//!   the queue.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use distlock::{
    EnforcementMode, LockError, LockKey, Locker, MemoryFencedResource, Permit, RetryPolicy,
};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::{Instant, sleep};

use super::process::{ProcessLink, process_link};

/// Tenants in the workload.
pub const TENANTS: u32 = 3;
/// Exports per tenant.
pub const EXPORTS: u32 = 6;
/// Exports of one tenant allowed at once: the semaphore's permits.
pub const LIMIT: u32 = 2;
/// Steps of one export, each written to the ledger.
pub const STEPS: u32 = 3;
/// Worker processes per strategy.
pub const WORKERS: usize = 8;

/// How a worker keeps to the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Limit {
    /// Nothing: every worker exports what it takes.
    None,
    /// A permit of the tenant's semaphore, checked before every step.
    Semaphore,
    /// As `Semaphore`, and every step is fenced with the permit's token.
    SemaphoreFence,
}

impl Limit {
    /// Every strategy, weakest first: the rows of the report.
    pub const ALL: [Self; 3] = [Self::None, Self::Semaphore, Self::SemaphoreFence];

    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "no-limit",
            Self::Semaphore => "semaphore",
            Self::SemaphoreFence => "semaphore+fence",
        }
    }
}

/// One strategy's result, counted from its ledger.
#[derive(Clone, Debug, Serialize)]
pub struct TenantRow {
    /// The strategy.
    pub strategy: &'static str,
    /// Exports finished (every step written by one execution).
    pub exports: u32,
    /// The most executions of one tenant's exports in progress at once, from the ledger.
    pub most_at_once: u32,
    /// Steps the fencing check refused as stale.
    pub stale_refused: u64,
    /// Workers that paused past the TTL.
    pub pauses: u64,
    /// Worker processes that crashed.
    pub crashes: u64,
}

/// The timing of a run, scaled from the TTL.
#[derive(Clone, Copy, Debug)]
struct Timing {
    ttl: Duration,
    step: Duration,
    pause: Duration,
    restart: Duration,
}

impl Timing {
    fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            step: ttl / 3,
            // Long past the TTL, so the paused export's permit goes to a waiting one.
            pause: ttl * 4,
            restart: ttl,
        }
    }
}

/// One export of one tenant.
#[derive(Clone, Copy, Debug)]
struct Export {
    tenant: u32,
    number: u32,
}

impl Export {
    /// Its planted fault, on its first execution only.
    fn fault(self) -> Fault {
        match self.number {
            0 => Fault::PauseBeforeSecondWrite,
            1 => Fault::CrashAfterFirstStep,
            _ => Fault::None,
        }
    }

    fn index(self) -> usize {
        (self.tenant * EXPORTS + self.number) as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    PauseBeforeSecondWrite,
    CrashAfterFirstStep,
}

/// What became of one execution of an export.
enum Outcome {
    Done,
    /// Stopped before its end (permit lost, step refused): back to the queue.
    Abandoned,
    /// The process died: the export goes back to the queue, the worker restarts.
    Crashed,
}

/// One strategy's run: its queue, ledger, fencing gate and counters.
struct Run {
    limit: Limit,
    timing: Timing,
    store: Arc<dyn distlock::LockBackend>,
    key_prefix: String,
    queue: Mutex<VecDeque<Export>>,
    done: AtomicU32,
    /// Per execution: the tenant and the instants its steps landed in the ledger.
    ledger: Mutex<Vec<(u32, Vec<Instant>)>>,
    fenced: MemoryFencedResource,
    first_run_taken: Vec<AtomicBool>,
    stale_refused: AtomicU64,
    pauses: AtomicU64,
    crashes: AtomicU64,
}

/// A worker process: its link to the store and its locker (with its renewal task).
struct Process {
    link: Arc<ProcessLink>,
    locker: Locker,
}

/// Runs the three strategies side by side on stores from `backend`, with `ttl`.
///
/// # Errors
/// A bad URL, a TTL the store cannot honour, or the first error the store returns.
pub async fn run(backend: &str, ttl: Duration) -> Result<Vec<TenantRow>, LockError> {
    let run_id = format!("{:016x}", rand::random::<u64>());
    let timing = Timing::new(ttl);
    let mut runs = Vec::new();
    for limit in Limit::ALL {
        let store = distlock::connect(backend).await?;
        store.capabilities().check_ttl(ttl)?;
        runs.push(Arc::new(Run::new(
            limit,
            timing,
            store,
            format!("lockctl-demo:{run_id}:{}:", limit.name()),
        )));
    }
    let rows = futures::future::try_join_all(runs.into_iter().map(|run| async move {
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| tokio::spawn(run.clone().worker()))
            .collect();
        for worker in workers {
            worker
                .await
                .map_err(|e| LockError::Config(format!("a demo worker failed: {e}")))??;
        }
        Ok::<_, LockError>(run.row())
    }))
    .await?;
    Ok(rows)
}

impl Run {
    fn new(
        limit: Limit,
        timing: Timing,
        store: Arc<dyn distlock::LockBackend>,
        key_prefix: String,
    ) -> Self {
        // Each tenant's exports arrive together, as a batch a tenant enqueues does.
        let exports: VecDeque<Export> = (0..TENANTS)
            .flat_map(|tenant| (0..EXPORTS).map(move |number| Export { tenant, number }))
            .collect();
        Self {
            limit,
            timing,
            store,
            key_prefix,
            first_run_taken: (0..TENANTS * EXPORTS)
                .map(|_| AtomicBool::new(false))
                .collect(),
            queue: Mutex::new(exports),
            done: AtomicU32::new(0),
            ledger: Mutex::new(Vec::new()),
            fenced: MemoryFencedResource::new(EnforcementMode::Enforce),
            stale_refused: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
            crashes: AtomicU64::new(0),
        }
    }

    fn start_process(&self) -> Result<Process, LockError> {
        let link = Arc::new(process_link(self.store.clone()));
        // Waiters retry often enough to take a permit freed by its TTL within the pause.
        let locker = Locker::builder(link.clone())
            .ttl(self.timing.ttl)
            .retry(RetryPolicy {
                initial: self.timing.ttl / 10,
                max: self.timing.ttl / 3,
            })
            .wait_timeout(Some(self.timing.ttl * 200))
            .build()?;
        Ok(Process { link, locker })
    }

    /// One worker: takes exports until every export is done; a crashed worker comes back
    /// as a new process after the restart delay.
    async fn worker(self: Arc<Self>) -> Result<(), LockError> {
        let mut process = self.start_process()?;
        while self.done.load(Ordering::SeqCst) < TENANTS * EXPORTS {
            let next = self.queue.lock().pop_front();
            let Some(export) = next else {
                sleep(self.timing.step / 4).await;
                continue;
            };
            match self.execute(&process, export).await? {
                Outcome::Done => {
                    self.done.fetch_add(1, Ordering::SeqCst);
                }
                Outcome::Abandoned => self.queue.lock().push_back(export),
                Outcome::Crashed => {
                    self.crashes.fetch_add(1, Ordering::SeqCst);
                    self.queue.lock().push_back(export);
                    sleep(self.timing.restart).await;
                    process = self.start_process()?;
                }
            }
        }
        Ok(())
    }

    async fn execute(&self, process: &Process, export: Export) -> Result<Outcome, LockError> {
        let first = !self.first_run_taken[export.index()].swap(true, Ordering::SeqCst);
        let fault = if first { export.fault() } else { Fault::None };
        let permit = match self.limit {
            Limit::None => None,
            Limit::Semaphore | Limit::SemaphoreFence => {
                let name = LockKey::new(format!("{}tenant-{}", self.key_prefix, export.tenant))?;
                Some(process.locker.semaphore(&name, LIMIT)?.acquire().await?)
            }
        };
        let execution = {
            let mut ledger = self.ledger.lock();
            ledger.push((export.tenant, Vec::new()));
            ledger.len() - 1
        };
        for step in 0..STEPS {
            sleep(self.timing.step).await;
            if permit.as_ref().is_some_and(|p| !p.is_held()) {
                return Ok(Outcome::Abandoned);
            }
            if step == 1 && fault == Fault::PauseBeforeSecondWrite {
                // Between the check and the write, as a real pause can fall.
                self.pauses.fetch_add(1, Ordering::SeqCst);
                process.link.layer().freeze(self.timing.pause);
                sleep(self.timing.pause).await;
            }
            if !self.write(execution, permit.as_ref()) {
                return Ok(Outcome::Abandoned);
            }
            if step == 0 && fault == Fault::CrashAfterFirstStep {
                process.link.layer().crash();
                return Ok(Outcome::Crashed);
            }
        }
        if let Some(permit) = permit {
            // A release that finds the permit gone changes nothing here: the steps are
            // already written, and the ledger shows what the loss let through.
            let _ = permit.release().await;
        }
        Ok(Outcome::Done)
    }

    /// Writes one step of `execution` to the ledger; with fencing, only if the permit's
    /// token is still the newest of its slot. False when refused.
    fn write(&self, execution: usize, permit: Option<&Permit>) -> bool {
        let step = || self.ledger.lock()[execution].1.push(Instant::now());
        match permit.filter(|_| self.limit == Limit::SemaphoreFence) {
            // The step is written under the check's lock: no newer token between the two.
            Some(permit) => {
                let admitted = self
                    .fenced
                    .admit_with(permit.key().as_str(), permit.token(), step)
                    .is_admitted();
                if !admitted {
                    self.stale_refused.fetch_add(1, Ordering::SeqCst);
                }
                admitted
            }
            None => {
                step();
                true
            }
        }
    }

    fn row(&self) -> TenantRow {
        let ledger = self.ledger.lock();
        TenantRow {
            strategy: self.limit.name(),
            exports: self.done.load(Ordering::SeqCst),
            most_at_once: (0..TENANTS)
                .map(|tenant| most_at_once(ledger.iter().filter(|(t, _)| *t == tenant)))
                .max()
                .unwrap_or(0),
            stale_refused: self.stale_refused.load(Ordering::SeqCst),
            pauses: self.pauses.load(Ordering::SeqCst),
            crashes: self.crashes.load(Ordering::SeqCst),
        }
    }
}

/// The most executions in progress at once, each from its first step written to its
/// last; executions that wrote nothing are not in progress.
fn most_at_once<'a>(executions: impl Iterator<Item = &'a (u32, Vec<Instant>)>) -> u32 {
    let mut edges: Vec<(Instant, i32)> = Vec::new();
    for (_, steps) in executions {
        if let (Some(first), Some(last)) = (steps.iter().min(), steps.iter().max()) {
            edges.push((*first, 1));
            edges.push((*last, -1));
        }
    }
    // At one instant, a start counts before an end: both were in progress then.
    edges.sort_by_key(|(at, step)| (*at, -*step));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    u32::try_from(most).unwrap_or(0)
}

/// The report: one line per strategy.
pub fn table(backend: &str, ttl: Duration, rows: &[TenantRow]) -> String {
    let mut out = format!(
        "tenant limit on {backend}: at most {LIMIT} exports per tenant at once ({TENANTS} \
         tenants, {EXPORTS} exports of {STEPS} steps each, {WORKERS} workers, TTL {}); per \
         tenant one worker pauses past the TTL before a write and one crashes after a step\n\n",
        humantime::format_duration(ttl)
    );
    out += &format!(
        "{:<16} {:>8} {:>22} {:>14} {:>7} {:>8}\n",
        "strategy", "exports", "most at once (ledger)", "stale refused", "pauses", "crashes"
    );
    for row in rows {
        out += &format!(
            "{:<16} {:>8} {:>22} {:>14} {:>7} {:>8}\n",
            row.strategy, row.exports, row.most_at_once, row.stale_refused, row.pauses, row.crashes
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executions_that_overlap_are_counted_at_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let ledger = [
            (0, vec![at(0), at(10)]),
            (0, vec![at(5), at(20)]),
            (0, vec![at(10), at(30)]),
            (0, vec![at(40)]),
            (0, vec![]),
        ];
        assert_eq!(most_at_once(ledger.iter()), 3);
        assert_eq!(most_at_once(ledger[3..].iter()), 1);
        assert_eq!(most_at_once(ledger[..2].iter()), 2);
    }
}
