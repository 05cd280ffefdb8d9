//! Releases with a waiter on every key: acquire + release cycles of a backend at one
//! concurrency when every released key has a waiter that must be told, against the same
//! cycles on keys nobody waits for, measured in alternating rounds in one run.
//!
//! # What is measured
//!
//! `concurrency` tasks each run acquire + release cycles back to back on a key of their
//! own, as in the sweep. In the *waited* rounds the keys are `bench:<backend>:waited:<i>`,
//! and each of them has a waiter: a task blocked in [`ReleaseWatch::released`] on that
//! key, the wake-up path `Locker::lock` waits on, watching through the backend instance
//! the caller gives (the capacity report gives another instance, with its own connections
//! and release listener, as a worker of another process would have). So every release of
//! a waited round is a release the backend must announce. The waiters only wait: woken,
//! they count the wake-up and wait again without trying to acquire, so the waited rounds
//! add the announcements and the wake-ups to the same store calls, nothing else. In the
//! *unwaited* rounds the tasks run the same cycles on `bench:<backend>:unwaited:<i>`,
//! which nobody watches. The rate is cycles per second (one release per cycle), so the
//! ratio of the two is the ratio of release throughputs.
//!
//! # Proof that the waiters waited
//!
//! Before the rounds, every waiter must have been woken once, by its registration or a
//! release of its key ([`REGISTERED_WITHIN`]): the waiters are in place. After the rounds,
//! every waiter must have been woken again, by the releases of the waited rounds
//! ([`WOKEN_WITHIN`]). Otherwise the measurement fails: rounds whose releases nobody was
//! told of measured nothing this module is for. The wake-ups per waited release are
//! reported beside the ratio; they are below one where announcements of one key coalesce
//! (a waiter woken once for releases that came while it was being woken).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::LockBackend;
use distlock_core::wake::ReleaseWatch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cpu::CpuReading;
use crate::error::BenchError;
use crate::load::{self, Keys};
use crate::plan::Plan;
use crate::subject::{BenchKey, Cycle, Subject, SubjectId};

/// Whether a task that only watches a key of `subject` ([`ReleaseWatch`]) makes its
/// releases waited ones. Not on Redis: there a key is marked waited for by an acquire
/// that found it held, so a waiter that has not tried since the last grant is not told,
/// and this measurement would measure releases nobody waits for.
pub fn watching_waits(subject: SubjectId) -> bool {
    subject != SubjectId::Redis
}

/// Tasks (and waited keys) of the measurement the targets are judged on.
pub const TASKS: usize = 64;

/// How long the waiters have to be in place (woken once) before the rounds start.
pub const REGISTERED_WITHIN: Duration = Duration::from_secs(10);

/// How long after the last round every waiter must have been woken by a release.
pub const WOKEN_WITHIN: Duration = Duration::from_secs(5);

/// One side's rounds: its rate and what each of its cycles cost the machine.
#[derive(Clone, Debug, Default)]
pub struct Side {
    /// Cycles per second, round by round.
    pub per_sec: Vec<f64>,
    /// This process's CPU per cycle, µs, round by round (warm-up included): the cycles,
    /// and on the waited side the listener and the waiters' wake-ups.
    pub client_us: Vec<f64>,
    /// The server's CPU per cycle (every process of its tree), µs, round by round; empty
    /// when the server's processes could not be read.
    pub server_us: Vec<f64>,
}

impl Side {
    /// The median round's cycles/s.
    pub fn rate(&self) -> f64 {
        median(self.per_sec.clone())
    }

    /// The median round's client CPU per cycle, µs.
    pub fn client(&self) -> Option<f64> {
        (!self.client_us.is_empty()).then(|| median(self.client_us.clone()))
    }

    /// The median round's server CPU per cycle, µs.
    pub fn server(&self) -> Option<f64> {
        (!self.server_us.is_empty()).then(|| median(self.server_us.clone()))
    }
}

/// One backend's waited and unwaited rounds.
#[derive(Clone, Debug)]
pub struct WaitedReleases {
    /// The backend.
    pub subject: SubjectId,
    /// Tasks running cycles at once, and keys with a waiter (one each).
    pub concurrency: usize,
    /// The rounds with a waiter on every key.
    pub waited: Side,
    /// The rounds on keys nobody waits for.
    pub unwaited: Side,
    /// Releases of waited keys in the waited rounds, warm-up included.
    pub waited_releases: u64,
    /// Wake-ups the waiters received from those releases.
    pub wakes: u64,
}

impl WaitedReleases {
    /// Waited cycles/s over unwaited cycles/s, round by round.
    pub fn ratios(&self) -> Vec<f64> {
        self.waited
            .per_sec
            .iter()
            .zip(&self.unwaited.per_sec)
            .filter(|(_, u)| **u > 0.0)
            .map(|(w, u)| w / u)
            .collect()
    }

    /// The median round's ratio: what the target is judged on.
    pub fn ratio(&self) -> Option<f64> {
        let ratios = self.ratios();
        (!ratios.is_empty()).then(|| median(ratios))
    }

    /// Wake-ups per waited release.
    pub fn wakes_per_release(&self) -> f64 {
        self.wakes as f64 / self.waited_releases.max(1) as f64
    }
}

/// The median of `values` (the upper one of an even count), 0 when there are none.
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Measures `worker`'s cycles at `concurrency` with a waiter of `waiters` (another
/// instance of the same backend) on every key, and without, alternating the order each
/// round: `plan.pair_rounds` rounds of `plan.warmup` then a third of `plan.duration`, as
/// the target pairs. With `server`, the pid of the server process, the CPU of its process
/// tree per cycle is measured too. Fails if the waiters were not in place before the
/// rounds or not woken by their releases (see the module docs).
pub async fn waited_releases(
    worker: Arc<dyn Subject>,
    waiters: Arc<dyn LockBackend>,
    concurrency: usize,
    plan: &Plan,
    server: Option<u32>,
) -> Result<WaitedReleases, BenchError> {
    let id = worker.id();
    let waited_keys = load::keys_for(id, "waited", concurrency, Keys::PerTask)?;
    let unwaited_keys = load::keys_for(id, "unwaited", concurrency, Keys::PerTask)?;
    let watchers = Watchers::start(id, &waiters, &waited_keys)?;
    watchers.until_in_place(&worker, &waited_keys).await?;
    let before = watchers.counts();
    let mut out = WaitedReleases {
        subject: id,
        concurrency,
        waited: Side::default(),
        unwaited: Side::default(),
        waited_releases: 0,
        wakes: 0,
    };
    for round in 0..plan.pair_rounds.max(1) {
        for waited in [round % 2 == 0, round % 2 != 0] {
            let (side, keys) = if waited {
                (&mut out.waited, &waited_keys)
            } else {
                (&mut out.unwaited, &unwaited_keys)
            };
            let releases = measure(side, &worker, keys, plan, server).await?;
            if waited {
                out.waited_releases += releases;
            }
        }
    }
    out.wakes = watchers.until_woken_since(&before, &waited_keys).await?;
    Ok(out)
}

/// One round of one side: its rate and CPU per cycle go into `side`; returns the
/// releases it made, warm-up included. Shared with the permit rounds.
pub(crate) async fn measure(
    side: &mut Side,
    worker: &Arc<dyn Subject>,
    keys: &[BenchKey],
    plan: &Plan,
    server: Option<u32>,
) -> Result<u64, BenchError> {
    let counted = Arc::new(CountedCycles {
        inner: worker.clone(),
        releases: AtomicU64::new(0),
    });
    let start = CpuReading::now(server);
    let sample = load::closed_loop_on(
        counted.clone(),
        keys.to_vec(),
        Keys::PerTask,
        plan.warmup,
        plan.duration / 3,
    )
    .await?;
    let end = CpuReading::now(server);
    let releases = counted.releases.load(Ordering::SeqCst);
    let per_cycle = |cpu: Duration| cpu.as_secs_f64() * 1e6 / releases.max(1) as f64;
    side.per_sec.push(sample.ops_per_sec());
    if let Some(cpu) = end.client_since(&start) {
        side.client_us.push(per_cycle(cpu));
    }
    if let Some(cpu) = end.server_since(&start) {
        side.server_us.push(per_cycle(cpu));
    }
    Ok(releases)
}

/// One waiting task per key, each counting the wake-ups of its [`ReleaseWatch`].
struct Watchers {
    subject: SubjectId,
    counts: Vec<Arc<AtomicU64>>,
    _tasks: JoinSet<()>,
}

impl Watchers {
    /// Watches every key of `keys` on `backend`, one task each.
    fn start(
        subject: SubjectId,
        backend: &Arc<dyn LockBackend>,
        keys: &[BenchKey],
    ) -> Result<Self, BenchError> {
        let mut tasks = JoinSet::new();
        let mut counts = Vec::with_capacity(keys.len());
        for key in keys {
            let watch: ReleaseWatch =
                backend
                    .watch_releases(key.lock_key())
                    .ok_or_else(|| BenchError::Unexpected {
                        subject: subject.slug(),
                        detail: "the backend does not wake waiters: no release is waited for"
                            .into(),
                    })?;
            let count = Arc::new(AtomicU64::new(0));
            counts.push(count.clone());
            tasks.spawn(wait_forever(watch, count));
        }
        Ok(Self {
            subject,
            counts,
            _tasks: tasks,
        })
    }

    fn counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .collect()
    }

    /// Waits until every waiter was woken once (by its registration, or by a release of
    /// its key, which this runs on `worker` every so often), for at most
    /// [`REGISTERED_WITHIN`].
    async fn until_in_place(
        &self,
        worker: &Arc<dyn Subject>,
        keys: &[BenchKey],
    ) -> Result<(), BenchError> {
        let deadline = Instant::now() + REGISTERED_WITHIN;
        loop {
            let idle: Vec<&BenchKey> = keys
                .iter()
                .zip(self.counts())
                .filter(|(_, n)| *n == 0)
                .map(|(k, _)| k)
                .collect();
            if idle.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.unwoken(idle.len(), keys.len(), "before the rounds"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            for key in idle {
                worker.cycle(key).await?;
            }
        }
    }

    /// Waits until every waiter was woken since `before`, for at most [`WOKEN_WITHIN`],
    /// and returns the wake-ups since then.
    async fn until_woken_since(
        &self,
        before: &[u64],
        keys: &[BenchKey],
    ) -> Result<u64, BenchError> {
        let deadline = Instant::now() + WOKEN_WITHIN;
        loop {
            let now = self.counts();
            let unwoken = now.iter().zip(before).filter(|(n, b)| n <= b).count();
            if unwoken == 0 {
                return Ok(now.iter().sum::<u64>() - before.iter().sum::<u64>());
            }
            if Instant::now() >= deadline {
                return Err(self.unwoken(unwoken, keys.len(), "by the waited rounds' releases"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn unwoken(&self, unwoken: usize, of: usize, when: &str) -> BenchError {
        BenchError::Unexpected {
            subject: self.subject.slug(),
            detail: format!(
                "{unwoken} of {of} waiters were never woken {when}: their releases were not \
                 announced, so the waited rounds would measure releases nobody waits for"
            ),
        }
    }
}

async fn wait_forever(mut watch: ReleaseWatch, count: Arc<AtomicU64>) {
    loop {
        watch.released().await;
        count.fetch_add(1, Ordering::SeqCst);
    }
}

/// A subject that counts the releases of its cycles.
struct CountedCycles {
    inner: Arc<dyn Subject>,
    releases: AtomicU64,
}

#[async_trait]
impl Subject for CountedCycles {
    fn id(&self) -> SubjectId {
        self.inner.id()
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let cycle = self.inner.cycle(key).await?;
        self.releases
            .fetch_add(u64::from(cycle.acquired), Ordering::Relaxed);
        Ok(cycle)
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::memory::MemoryBackend;

    use super::*;
    use crate::memory_subject::MemorySubject;

    fn plan(rounds: usize) -> Plan {
        Plan {
            warmup: Duration::from_millis(5),
            duration: Duration::from_millis(60),
            pair_rounds: rounds,
            ..Plan::quick()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_round_is_measured_and_the_waiters_are_woken_by_the_waited_releases() {
        let backend = Arc::new(MemoryBackend::new());
        let worker = Arc::new(MemorySubject(backend.clone()));
        let w = waited_releases(worker, backend, 8, &plan(3), None)
            .await
            .unwrap();
        assert_eq!(w.ratios().len(), 3, "{w:?}");
        assert_eq!(w.waited.client_us.len(), 3, "{w:?}");
        assert!(w.waited.server_us.is_empty(), "no server: {w:?}");
        assert!(w.waited_releases > 0, "{w:?}");
        assert!(w.wakes >= 8, "every waiter woken at least once: {w:?}");
        assert!(w.ratio().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_whose_releases_are_never_announced_fail_the_measurement() {
        // The waiters watch another store: no release they could hear ever happens.
        let worker = Arc::new(MemorySubject::new());
        let elsewhere: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
        let err = waited_releases(worker, elsewhere, 4, &plan(1), None)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("4 of 4 waiters were never woken"),
            "{err}"
        );
    }
}
