//! `distlock::apalis` on apalis's Redis and PostgreSQL storages, in process: a job whose
//! key another worker keeps held is sent back, delivery after delivery, and after
//! `dead_letter_after` of them is killed (apalis-redis's dead set, apalis-postgres's
//! `Killed` rows), its handler never run. apalis counts attempts and sets statuses only
//! where it calls the handler, so this is the layer's own doing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use distlock::LockKey;
use distlock::apalis::{ApalisLockLayer, JobLease};
use job_queue::storage::{Queue, Server, Storage};
use job_queue::{Payout, on_each_storage};
use tokio::task::JoinHandle;
use tokio::time::Instant;

on_each_storage!(a_job_whose_key_stays_held_is_dead_lettered_without_running);

async fn a_job_whose_key_stays_held_is_dead_lettered_without_running(storage: Storage) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Payout>("dead-letter").await.unwrap();
    let locker = server.locker(Duration::from_secs(30)).await.unwrap();
    let key = |job: &Payout| LockKey::new(format!("payout:{}", job.id));
    // Another worker holds the job's key for the whole test.
    let _holder = locker
        .try_lock(&key(&Payout { id: 1, work_ms: 0 }).unwrap())
        .await
        .unwrap()
        .expect("a free key");
    let lock = ApalisLockLayer::new(locker.clone(), key).dead_letter_after(3);
    let (worker, ran) = push_and_work(&mut queue, "dead-letter", lock, |_| {}).await;

    // A delivery sent back is delivered again soon (apalis-redis schedules it at once,
    // the task having run no attempt; apalis-postgres fetches it again at its next
    // fetch), so three take a few polls; 30 s without the job killed means it never is.
    let started = Instant::now();
    until_settled(storage, started, "is not killed", async || {
        let dead = queue.dead(&server).await.unwrap();
        if dead == 1 {
            Ok(())
        } else {
            Err(format!("{dead} dead"))
        }
    })
    .await;
    worker.abort();
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "{storage}: the handler ran without the job's lock"
    );
}

on_each_storage!(a_job_whose_holder_stopped_renewing_runs_once_the_lease_lapses);

/// The key's holder is paused (its lease is never renewed nor released): the job's
/// deliveries miss until the lease lapses, then one runs it. Both storages send a missed
/// job back sooner than the layer's retry delay (apalis-redis at once, apalis-postgres at
/// its next fetch), so ten deliveries pass inside the holder's TTL; counted one by one
/// they would dead-letter a job that nobody then runs.
async fn a_job_whose_holder_stopped_renewing_runs_once_the_lease_lapses(storage: Storage) {
    const HOLDER_TTL: Duration = Duration::from_secs(5);
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Payout>("lapsing-holder").await.unwrap();
    let locker = server.locker(Duration::from_secs(30)).await.unwrap();
    let key = |job: &Payout| LockKey::new(format!("payout:{}", job.id));
    let held = locker
        .backend()
        .acquire(&key(&Payout { id: 1, work_ms: 0 }).unwrap(), HOLDER_TTL)
        .await
        .unwrap()
        .expect("a free key");
    // Ten misses, at least half the retry delay apart, take 9 s or more: longer than the
    // holder's TTL. Sent straight back, ten deliveries take a few seconds at most.
    let lock = ApalisLockLayer::new(locker.clone(), key)
        .retry_after(Duration::from_secs(2))
        .unwrap()
        .dead_letter_after(10);
    let (worker, ran) = push_and_work(&mut queue, "lapsing-holder", lock, move |lease| {
        assert!(
            lease.token() > held.token(),
            "the job ran under the holder's token"
        );
    })
    .await;

    // A hang guard: the lease lapses 5 s after it was taken, and the next delivery comes
    // at most the retry delay (2 s) after a miss.
    let started = Instant::now();
    let dead = until_settled(storage, started, "neither ran nor was killed", async || {
        let dead = queue.dead(&server).await.unwrap();
        if dead > 0 || queue.done(&server).await.unwrap() == 1 {
            Ok(dead)
        } else {
            Err(format!("{dead} dead"))
        }
    })
    .await;
    worker.abort();
    assert_eq!(
        dead,
        0,
        "{storage}: the job was dead-lettered {:?} after it was pushed, while its holder's \
         lease ({HOLDER_TTL:?}) had yet to lapse",
        started.elapsed()
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1, "{storage}: the job ran once");
}

/// Pushes job 1 and starts worker `name` on `queue` under `lock`; its handler counts its
/// runs in the counter returned and hands each run's lease to `check`.
async fn push_and_work(
    queue: &mut Queue<Payout>,
    name: &str,
    lock: ApalisLockLayer<Payout>,
    check: impl Fn(&JobLease) + Clone + Send + Sync + 'static,
) -> (JoinHandle<()>, Arc<AtomicU32>) {
    queue.push(Payout { id: 1, work_ms: 0 }).await.unwrap();
    let ran = Arc::new(AtomicU32::new(0));
    let counted = ran.clone();
    let handler = move |_: Payout, lease: JobLease| {
        counted.fetch_add(1, Ordering::SeqCst);
        check(&lease);
        async { Ok::<_, BoxDynError>(()) }
    };
    (queue.work(name, 2, lock, handler), ran)
}

/// Polls `settled` every 100 ms until it tells the job's fate; until then it says what it
/// saw. 30 s after `started` the job `is_not` what the test waits for: a hang guard.
async fn until_settled<T>(
    storage: Storage,
    started: Instant,
    is_not: &str,
    mut settled: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    loop {
        let seen = match settled().await {
            Ok(fate) => return fate,
            Err(seen) => seen,
        };
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{storage}: the job {is_not} {:?} after it was pushed ({seen})",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
