//! A job paused past its lease takes no further step: its runtime's threads are blocked
//! (as by a stop signal, a long GC-like stall or a starved CPU) on the real clock, in the
//! middle of a job made of several awaited steps, and the lease's end must be seen before
//! the job is polled again, even though no timer has fired yet when the runtime resumes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::memory::MemoryBackend;
use distlock_core::{Election, LeaseStatus, LockError, LockKey, Locker};
use parking_lot::Mutex;
use tokio::runtime::{Builder, Runtime};

/// Long enough that a renewal (every TTL / 3) lands before the pause.
const TTL: Duration = Duration::from_millis(300);
/// Longer than the TTL: the lease runs out during it.
const PAUSE: Duration = Duration::from_millis(700);
/// The job's steps start this far apart.
const STEP: Duration = Duration::from_millis(10);
/// The pause starts after this many steps, while the job sleeps before the next.
const STEPS_BEFORE_PAUSE: usize = 5;

/// When each step of a job started, and when the pause ended.
#[derive(Default)]
struct Record {
    steps: Mutex<Vec<Instant>>,
    pause_ended: Mutex<Option<Instant>>,
}

impl Record {
    /// Steps that started after the pause ended.
    fn steps_after_pause(&self) -> usize {
        let ended = self.pause_ended.lock().expect("the pause happened");
        self.steps.lock().iter().filter(|at| **at >= ended).count()
    }
}

/// A job of many steps, each recorded as it starts, with a sleep between them.
async fn steps(record: Arc<Record>) {
    loop {
        record.steps.lock().push(Instant::now());
        tokio::time::sleep(STEP).await;
    }
}

/// Blocks the thread it runs on (every thread of the runtimes below: there is one)
/// once the job has taken its first steps, while it sleeps before the next.
async fn pause_the_runtime(record: Arc<Record>) {
    while record.steps.lock().len() < STEPS_BEFORE_PAUSE {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    std::thread::sleep(PAUSE);
    *record.pause_ended.lock() = Some(Instant::now());
}

/// The two runtimes a worker runs on, each with one thread that the pause blocks.
fn runtimes() -> [(&'static str, Runtime); 2] {
    let current = Builder::new_current_thread().enable_all().build().unwrap();
    let multi = Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    [("current_thread", current), ("multi_thread(1)", multi)]
}

fn locker() -> Locker {
    Locker::builder(Arc::new(MemoryBackend::new()))
        .ttl(TTL)
        .build()
        .unwrap()
}

/// Runs `worker` (which takes its steps through the record it is given) as a task on each
/// runtime, pauses the runtime once it has taken a few, and checks that it ended `Lost`
/// and took no step after the pause.
fn paused_worker_stops<W, Fut>(what: &str, worker: W)
where
    W: Fn(Arc<Record>) -> Fut,
    Fut: Future<Output = Result<(), LockError>> + Send + 'static,
{
    for (flavor, runtime) in runtimes() {
        let record = Arc::new(Record::default());
        // Spawned, so the worker runs on the runtime's worker thread like the pause.
        let working = runtime.spawn(worker(record.clone()));
        runtime
            .block_on(runtime.spawn(pause_the_runtime(record.clone())))
            .unwrap();
        let outcome = runtime.block_on(working).unwrap();
        assert!(
            matches!(outcome, Err(LockError::Lost)),
            "{flavor}: {outcome:?}"
        );
        assert_eq!(
            record.steps_after_pause(),
            0,
            "{flavor}: the {what} took a step after its lease ran out during the pause"
        );
    }
}

#[test]
fn a_job_paused_past_its_ttl_takes_no_step_after_the_pause() {
    paused_worker_stops("job", |record| async move {
        let key = LockKey::new("job").unwrap();
        locker().with_lock(&key, |_| steps(record)).await
    });
}

#[test]
fn a_leaders_loop_paused_past_its_ttl_triggers_nothing_after_the_pause() {
    paused_worker_stops("leader", |record| async move {
        let election = Election::new(locker(), "scheduler").unwrap();
        let leadership = election.campaign().await.unwrap();
        let acting = leadership.status().while_held(steps(record)).await;
        drop(leadership);
        acting
    });
}

#[test]
fn lost_is_ready_at_the_first_poll_at_which_is_held_says_false() {
    for (flavor, runtime) in runtimes() {
        // Spawned, so the pause blocks the thread the watchdog runs on too.
        let checked = runtime.block_on(runtime.spawn(async move {
            let locker = locker();
            let guard = locker.lock(&LockKey::new("job").unwrap()).await.unwrap();
            let status: LeaseStatus = guard.status();
            let lost = status.lost();
            tokio::pin!(lost);
            assert!(futures::poll!(lost.as_mut()).is_pending(), "{flavor}");
            // Nothing runs on this runtime meanwhile: no timer, no watchdog.
            std::thread::sleep(PAUSE);
            assert!(!status.is_held(), "{flavor}");
            let ready = futures::poll!(lost.as_mut()).is_ready();
            drop(guard);
            ready
        }));
        assert!(
            checked.unwrap(),
            "{flavor}: is_held says false but lost() is still pending"
        );
    }
}
