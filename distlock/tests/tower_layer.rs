//! The tower layer on the memory store: the job gets its token, a miss follows the policy
//! (requeue, skip, jittered retries, dead-letter with the reason), and a lost lease stops the
//! job before its next step.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use distlock::backend::Layered;
use distlock::memory::{Faults, MemoryBackend};
use distlock::tower::{JobError, LockLayer, Locked, OnMiss, Until, queue_key, run_key};
use distlock::{
    Admission, EnforcementMode, FencedResourceExt, FencingToken, LockBackend, LockError, LockKey,
    Locker, MemoryFencedResource, WriteFence,
};
use tokio::time::Instant;
use tower::limit::ConcurrencyLimit;
use tower_layer::Layer;
use tower_service::Service;

/// A job: its id and the delivery count the queue gave it.
#[derive(Clone, Debug)]
struct Job {
    id: u32,
    delivery: u32,
}

fn key_of(job: &Job) -> Result<LockKey, LockError> {
    LockKey::new(format!("job:{}", job.id))
}

/// An inner service from a closure.
#[derive(Clone)]
struct Handler<F>(F);

impl<F, Fut, T, E, Q> Service<Locked<Q>> for Handler<F>
where
    F: FnMut(Locked<Q>) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    type Response = T;
    type Error = E;
    type Future = Fut;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), E>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, locked: Locked<Q>) -> Fut {
        (self.0)(locked)
    }
}

fn locker(client: impl LockBackend + 'static, ttl: Duration) -> Locker {
    Locker::builder(Arc::new(client)).ttl(ttl).build().unwrap()
}

/// Holds `job`'s key from another client of the store.
async fn held_elsewhere(backend: &MemoryBackend, job: &Job) -> distlock::LockGuard {
    locker(backend.client(), Duration::from_secs(30))
        .try_lock(&key_of(job).unwrap())
        .await
        .unwrap()
        .expect("free key")
}

#[tokio::test]
async fn the_job_runs_under_its_lock_with_the_token() {
    let store = MemoryBackend::new();
    let layer = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of);
    let probe = Arc::new(store.client());
    let mut service = layer.layer(Handler(move |locked: Locked<Job>| {
        let probe = probe.clone();
        async move {
            let info = probe
                .inspect(&key_of(&locked.request).unwrap())
                .await
                .unwrap();
            Ok::<_, Infallible>((locked.token, info.token, locked.status.is_held()))
        }
    }));
    let (token, seen, held) = service.call(Job { id: 1, delivery: 1 }).await.unwrap();
    assert_eq!(
        Some(token),
        seen,
        "the job ran while its lease held the key"
    );
    assert!(held);
    let after = store
        .inspect(&LockKey::new("job:1").unwrap())
        .await
        .unwrap();
    assert_eq!(after.owner, None, "released when the job ended");
}

/// Each run hands out its lease's fence: a run whose key went to a later run is refused
/// under it, after the later run's write was admitted under its own.
#[tokio::test]
async fn a_stale_runs_write_under_its_fence_is_refused_and_the_newer_runs_admitted() {
    let store = MemoryBackend::new();
    let layer = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of);
    let mut service = layer.layer(Handler(|locked: Locked<Job>| async move {
        let fence = locked.fence().expect("a job's fence");
        Ok::<_, Infallible>((fence, locked.key, locked.token))
    }));
    let (stale, key, token) = service.call(Job { id: 3, delivery: 1 }).await.unwrap();
    assert_eq!(
        (stale.key(), stale.token()),
        (&key, token),
        "not the lease's key and token"
    );
    let (newer, ..) = service.call(Job { id: 3, delivery: 2 }).await.unwrap();
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    let admitted = ledger.write_under(&newer, b"run 2").await.unwrap();
    assert!(
        admitted.is_admitted(),
        "the newer run's write: {admitted:?}"
    );
    let refused = ledger.write_under(&stale, b"run 1, late").await.unwrap();
    assert!(!refused.is_admitted(), "the stale run's write: {refused:?}");
    let kept = ledger.read_under(&newer).await.unwrap();
    assert_eq!(
        kept.as_deref(),
        Some(&b"run 2"[..]),
        "the stale write overwrote the newer"
    );
}

/// Calls `job`, whose key another client holds, through the layer `configured` makes;
/// the call's result and how many times the handler ran.
async fn call_while_held(
    job: Job,
    configured: impl FnOnce(LockLayer<Job>) -> LockLayer<Job>,
) -> (Result<(), JobError<Infallible>>, u32) {
    let store = MemoryBackend::new();
    let _holder = held_elsewhere(&store, &job).await;
    let ran = Arc::new(AtomicU32::new(0));
    let counted = ran.clone();
    let layer = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of);
    let mut service = configured(layer).layer(Handler(move |_: Locked<Job>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(()) }
    }));
    let result = service.call(job).await;
    (result, ran.load(Ordering::SeqCst))
}

#[tokio::test]
async fn a_miss_hands_the_job_back_and_runs_nothing() {
    let job = Job { id: 2, delivery: 1 };
    let (result, ran) = call_while_held(job, |layer| layer.on_miss(OnMiss::Requeue)).await;
    assert!(
        matches!(result, Err(JobError::Busy { ref key }) if key.as_str() == "job:2"),
        "{result:?}"
    );
    assert_eq!(ran, 0);
}

#[tokio::test]
async fn skip_drops_a_duplicate_as_skipped_never_as_a_miss_to_dead_letter() {
    let job = Job { id: 3, delivery: 1 };
    let (result, ran) = call_while_held(job, |layer| {
        layer
            .on_miss(OnMiss::Skip)
            .dead_letter_after(1, |job: &Job| job.delivery)
    })
    .await;
    assert!(
        matches!(result, Err(JobError::Skipped { ref key }) if key.as_str() == "job:3"),
        "{result:?}"
    );
    assert_eq!(ran, 0);
}

#[tokio::test]
async fn retries_take_the_key_once_its_holder_lets_go() {
    let store = MemoryBackend::new();
    let job = Job { id: 3, delivery: 1 };
    let holder = held_elsewhere(&store, &job).await;
    let mut service = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of)
        .on_miss(OnMiss::Retry {
            attempts: 50,
            delay: Duration::from_millis(20),
        })
        .layer(Handler(|locked: Locked<Job>| async move {
            Ok::<_, Infallible>(locked.token)
        }));
    let releasing = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        holder.release().await.unwrap();
    });
    let token: FencingToken = service.call(job).await.unwrap();
    releasing.await.unwrap();
    assert!(token.get() >= 2, "the second grant of the key: {token:?}");
}

/// A retry is woken by the holder's release, which the store announces, instead of
/// sleeping out its delay: the job runs sooner after the call than the shortest wait
/// between two tries that sleep (`delay / 2`) would allow.
#[tokio::test]
async fn a_retry_takes_the_key_when_its_release_is_announced_not_a_delay_later() {
    let store = MemoryBackend::new();
    let job = Job { id: 7, delivery: 1 };
    let holder = held_elsewhere(&store, &job).await;
    let delay = Duration::from_secs(4);
    let mut service = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of)
        .on_miss(OnMiss::Retry { attempts: 2, delay })
        .layer(Handler(|_: Locked<Job>| async {
            Ok::<_, Infallible>(Instant::now())
        }));
    let called = Instant::now();
    let running = tokio::spawn(async move { service.call(job).await });
    // The first try finds the key held; the holder lets go while the job waits.
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.release().await.unwrap();
    let released = Instant::now();
    let ran = running.await.unwrap().unwrap();
    println!(
        "the job ran {:?} after its call, {:?} after the release",
        ran - called,
        ran.saturating_duration_since(released)
    );
    ran_sooner_than_a_slept_delay("the job", called, ran, delay);
}

#[tokio::test]
async fn a_job_that_keeps_missing_is_dead_lettered_with_the_reason() {
    let store = MemoryBackend::new();
    let _holder = held_elsewhere(&store, &Job { id: 4, delivery: 1 }).await;
    let mut service = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of)
        .dead_letter_after(3, |job: &Job| job.delivery)
        .layer(Handler(|_: Locked<Job>| async { Ok::<_, Infallible>(()) }));
    for delivery in 1..=2 {
        let result = service.call(Job { id: 4, delivery }).await;
        assert!(matches!(result, Err(JobError::Busy { .. })), "{result:?}");
    }
    let result = service.call(Job { id: 4, delivery: 3 }).await;
    match result {
        Err(e @ JobError::DeadLetter { misses: 3, .. }) => {
            assert!(
                e.to_string().contains("job:4") && e.to_string().contains("dead-lettered"),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A job that failed on 19 deliveries for its own reasons and then finds its key held is
/// handed back, not dead-lettered: only the deliveries that found the key held count, from
/// the first of them.
#[tokio::test]
async fn only_deliveries_that_found_the_key_held_count_towards_dead_lettering() {
    let store = MemoryBackend::new();
    let mut service = LockLayer::new(locker(store.client(), Duration::from_secs(30)), key_of)
        .dead_letter_after(3, |job: &Job| job.delivery)
        .layer(Handler(|_: Locked<Job>| async {
            Err::<(), _>("the provider refused")
        }));
    for delivery in 1..=19 {
        let result = service.call(Job { id: 6, delivery }).await;
        assert!(
            matches!(result, Err(JobError::Job("the provider refused"))),
            "{result:?}"
        );
    }
    let _holder = held_elsewhere(&store, &Job { id: 6, delivery: 1 }).await;
    for delivery in 20..=21 {
        let result = service.call(Job { id: 6, delivery }).await;
        assert!(
            matches!(result, Err(JobError::Busy { .. })),
            "delivery {delivery}: {result:?}"
        );
    }
    let result = service
        .call(Job {
            id: 6,
            delivery: 22,
        })
        .await;
    match result {
        Err(e @ JobError::DeadLetter { misses: 3, .. }) => {
            assert!(e.to_string().contains("3 deliveries in a row"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

/// What a worker saw when it asked the layer for readiness before taking a job.
#[derive(Debug, PartialEq, Eq)]
enum Readiness {
    /// Not ready at first: the worker waited before it took job `id`.
    Waited(u32),
    /// Ready: the worker took job `id` (and the layer its lock).
    Took(u32),
}

/// The inner service runs one job at a time (a concurrency limit inside the layer). While
/// the first job runs the layer is not ready, so a worker that asks for readiness before
/// it takes a job, as apalis does, takes no second job: no lease is held for a job that
/// cannot run, and the job stays in the queue for another worker.
#[tokio::test]
async fn no_job_holds_a_lock_while_the_inner_service_is_at_capacity() {
    let store = MemoryBackend::new();
    let locker = locker(store.client(), Duration::from_secs(30));
    let (started, mut running) = tokio::sync::mpsc::unbounded_channel();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let opened = gate.clone();
    let one_at_a_time = ConcurrencyLimit::new(
        Handler(move |locked: Locked<Job>| {
            let (started, gate) = (started.clone(), opened.clone());
            async move {
                started.send(locked.request.id).unwrap();
                drop(gate.acquire().await.unwrap());
                Ok::<_, Infallible>(locked.token)
            }
        }),
        1,
    );
    let mut service = LockLayer::new(locker.clone(), key_of).layer(one_at_a_time);
    // A worker as apalis runs one: readiness first, then the job, in a task of its own.
    let (seen, mut readiness) = tokio::sync::mpsc::unbounded_channel();
    let worker = tokio::spawn(async move {
        let mut jobs = Vec::new();
        for id in [1, 2] {
            let mut waited = false;
            poll_fn(|cx| {
                let ready = service.poll_ready(cx);
                if ready.is_pending() && !waited {
                    waited = true;
                    seen.send(Readiness::Waited(id)).unwrap();
                }
                ready
            })
            .await
            .unwrap();
            seen.send(Readiness::Took(id)).unwrap();
            jobs.push(tokio::spawn(service.call(Job { id, delivery: 1 })));
        }
        jobs
    });
    assert_eq!(readiness.recv().await, Some(Readiness::Took(1)));
    assert_eq!(running.recv().await, Some(1));
    assert_eq!(
        readiness.recv().await,
        Some(Readiness::Waited(2)),
        "the worker took job 2 while job 1 ran and held the only capacity"
    );
    let second = store
        .inspect(&LockKey::new("job:2").unwrap())
        .await
        .unwrap();
    assert_eq!(second.owner, None, "job 2's key is free while job 1 runs");
    assert_eq!(locker.held(), 1, "one lease renewed: job 1's");

    // Job 1 ends: the capacity and the worker's next job are free.
    gate.add_permits(2);
    assert_eq!(readiness.recv().await, Some(Readiness::Took(2)));
    let jobs = worker.await.unwrap();
    let mut tokens = Vec::new();
    for job in jobs {
        tokens.push(job.await.unwrap().unwrap());
    }
    assert_eq!(running.recv().await, Some(2));
    assert!(tokens.iter().all(|token| token.get() >= 1), "{tokens:?}");
}

/// The store stops answering renewals: the lease runs out, and the job, which would take
/// another step after its pause, is stopped instead.
#[tokio::test]
async fn a_lost_lease_stops_the_job_before_its_next_step() {
    let faults = Arc::new(Faults::default());
    let store = Layered::new(Arc::new(MemoryBackend::new()), faults.clone());
    let steps = Arc::new(AtomicU32::new(0));
    let counted = steps.clone();
    let locker = locker(store, Duration::from_millis(300));
    let mut service = LockLayer::new(locker, key_of).layer(Handler(move |_: Locked<Job>| {
        let steps = counted.clone();
        let faults = faults.clone();
        async move {
            steps.fetch_add(1, Ordering::SeqCst);
            // Every call to the store fails from now on: renewals never succeed.
            faults.partition();
            tokio::time::sleep(Duration::from_secs(2)).await;
            steps.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Infallible>(())
        }
    }));
    let started = Instant::now();
    let result = service.call(Job { id: 5, delivery: 1 }).await;
    assert!(matches!(result, Err(JobError::Lost { .. })), "{result:?}");
    assert_eq!(
        steps.load(Ordering::SeqCst),
        1,
        "no step after the lease was lost"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// Three instances of a cron worker fire every tick; only the leader runs it, with its
/// token. When the leader goes (its layer dropped), a standby leads and the ticks still run
/// once each, with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tick_runs_once_across_instances_and_a_standby_takes_over() {
    use distlock::Election;
    use distlock::tower::{LeaderLayer, LeaderService};

    type Runs = Arc<std::sync::Mutex<Vec<(u32, FencingToken)>>>;
    let store = MemoryBackend::new();
    let runs: Runs = Arc::default();
    let instance = |store: &MemoryBackend| {
        let election =
            Election::new(locker(store.client(), Duration::from_secs(30)), "nightly").unwrap();
        let layer = LeaderLayer::new(election).unwrap();
        let runs = runs.clone();
        let service = layer.layer(Handler(move |tick: Locked<Job>| {
            runs.lock().unwrap().push((tick.request.id, tick.token));
            async { Ok::<_, Infallible>(()) }
        }));
        (layer, service)
    };
    let mut instances: Vec<(LeaderLayer, LeaderService<_>)> =
        (0..3).map(|_| instance(&store)).collect();

    async fn leader_among<S>(instances: &[(LeaderLayer, S)]) -> usize {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let leading: Vec<usize> = (0..instances.len())
                .filter(|&i| instances[i].0.is_leading())
                .collect();
            if let [one] = leading[..] {
                return one;
            }
            assert!(Instant::now() < deadline, "no single leader: {leading:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    let first = leader_among(&instances).await;
    let mut first_token = None;
    for tick in 0..20 {
        if tick == 10 {
            // The leader goes; a standby must lead for the next ten ticks.
            first_token = Some(runs.lock().unwrap()[0].1);
            drop(instances.remove(first));
            leader_among(&instances).await;
        }
        let mut answers = Vec::new();
        for (_, service) in instances.iter_mut() {
            answers.push(
                service
                    .call(Job {
                        id: tick,
                        delivery: 1,
                    })
                    .await,
            );
        }
        assert_eq!(
            answers.iter().filter(|a| matches!(a, Ok(Some(())))).count(),
            1,
            "tick {tick}: {answers:?}"
        );
    }
    let first_token = first_token.expect("the leader went at tick 10");
    let runs = runs.lock().unwrap().clone();
    let ticks: Vec<u32> = runs.iter().map(|(tick, _)| *tick).collect();
    assert_eq!(
        ticks,
        (0..20).collect::<Vec<_>>(),
        "each tick once, in order"
    );
    assert!(
        runs[10..].iter().all(|(_, token)| *token > first_token),
        "{runs:?}"
    );
}

#[tokio::test]
async fn with_permits_n_jobs_of_one_key_run_at_once_and_the_next_is_a_miss() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::new(locker(backend.client(), Duration::from_secs(30)), key_of)
        .permits(2)
        .unwrap();
    // Each job waits until it is let go, so that the jobs overlap.
    let (go, _) = tokio::sync::broadcast::channel::<()>(1);
    let running = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let service = |go: tokio::sync::broadcast::Sender<()>| {
        let (running, most) = (running.clone(), most.clone());
        layer.layer(Handler(move |job: Locked<Job>| {
            let mut go = go.subscribe();
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let _ = go.recv().await;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>((job.key, job.token))
            }
        }))
    };
    let job = Job { id: 4, delivery: 1 };
    let mut first = service(go.clone());
    let mut second = service(go.clone());
    let a = tokio::spawn(first.call(job.clone()));
    let b = tokio::spawn(second.call(job.clone()));
    until_running(
        &running,
        2,
        "the second job of the key to run beside the first",
    )
    .await;
    // Both permits are taken: a third job of the key is a miss, and runs nothing.
    let third = service(go.clone()).call(job.clone()).await;
    assert!(matches!(third, Err(JobError::Busy { .. })), "{third:?}");
    // Another key is not limited by this one's permits.
    let other = tokio::spawn(service(go.clone()).call(Job { id: 5, delivery: 1 }));
    until_running(&running, 3, "a job of another key to run").await;
    go.send(()).unwrap();
    let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    other.await.unwrap().unwrap();
    assert_eq!(most.load(Ordering::SeqCst), 3);
    // Each ran under a permit slot of the job's semaphore, and fences on that slot.
    let mut slots = vec![a.0.to_string(), b.0.to_string()];
    slots.sort();
    assert_eq!(slots, ["job:4:permit:0", "job:4:permit:1"]);
    // Given back when the jobs ended: two more run.
    let c = tokio::spawn(service(go.clone()).call(job.clone()));
    let d = tokio::spawn(service(go.clone()).call(job.clone()));
    until_running(&running, 2, "two jobs of the key to run again").await;
    go.send(()).unwrap();
    let (c, d) = (c.await.unwrap(), d.await.unwrap());
    assert!(c.is_ok() && d.is_ok(), "{c:?} {d:?}");
    assert!(matches!(
        LockLayer::new(locker(backend.client(), Duration::from_secs(30)), key_of).permits(0),
        Err(LockError::Config(_))
    ));
}

/// Waits until `n` jobs run at once; in-memory jobs start within a few polls, so 10 s
/// without it means they never will.
async fn until_running(running: &AtomicU32, n: u32, what: &str) {
    let wait = async {
        while running.load(Ordering::SeqCst) < n {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .unwrap_or_else(|_| panic!("waited 10 s for {what}"));
}

/// Asserts that `who`, called at `called`, ran at `ran` sooner than the shortest wait
/// between two tries that sleep out the retry `delay` (`delay / 2`) would allow.
fn ran_sooner_than_a_slept_delay(who: &str, called: Instant, ran: Instant, delay: Duration) {
    assert!(
        ran - called < delay / 2,
        "{who} ran {:?} after its call: it slept out the retry's delay",
        ran - called
    );
}

#[tokio::test]
async fn until_expired_keeps_a_succeeded_jobs_key_for_its_ttl_and_a_failed_one_releases_it() {
    let store = MemoryBackend::new();
    let ttl = Duration::from_millis(500);
    let locker = locker(store.client(), ttl);
    let ran = Arc::new(AtomicU32::new(0));
    let counted = ran.clone();
    let mut service = LockLayer::new(locker.clone(), key_of)
        .until_expired()
        .unwrap()
        .layer(Handler(move |locked: Locked<Job>| {
            counted.fetch_add(1, Ordering::SeqCst);
            // Job 2 fails; the others succeed.
            let failed = locked.request.id == 2;
            async move { if failed { Err(()) } else { Ok(()) } }
        }));
    let job = Job { id: 1, delivery: 1 };
    let done_at = Instant::now();
    service.call(job.clone()).await.unwrap();
    // The key stays taken: a duplicate within the TTL is a miss and runs nothing.
    let again = service.call(job.clone()).await;
    assert!(matches!(again, Err(JobError::Busy { .. })), "{again:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert!(locker.held() == 0, "the kept lease is still renewed");
    // Once the TTL has run out the store frees the key, and the job runs again.
    let key = key_of(&job).unwrap();
    while store.inspect(&key).await.unwrap().owner.is_some() {
        assert!(
            done_at.elapsed() < ttl * 4,
            "the kept key is still held {:?} after a {ttl:?} TTL",
            done_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        done_at.elapsed() >= ttl / 2,
        "freed after {:?}",
        done_at.elapsed()
    );
    service.call(job).await.unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // A job that failed releases its key: its retry runs at once.
    let failing = Job { id: 2, delivery: 1 };
    let first = service.call(failing.clone()).await;
    assert!(matches!(first, Err(JobError::Job(()))), "{first:?}");
    let retry = service.call(failing).await;
    assert!(matches!(retry, Err(JobError::Job(()))), "{retry:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 4);
    // Not with permits.
    assert!(matches!(
        LockLayer::new(locker.clone(), key_of)
            .permits(2)
            .unwrap()
            .until_expired(),
        Err(LockError::Config(_))
    ));
}

/// A job carrying the claim its producer took when it enqueued it.
#[derive(Clone, Debug)]
struct Enqueued {
    job: Job,
    claim: Option<distlock::Claim>,
}

fn claimed_layer(locker: Locker, until: distlock::tower::Until) -> LockLayer<Enqueued> {
    LockLayer::new(locker, |e: &Enqueued| key_of(&e.job))
        .claimed(|e: &Enqueued| e.claim.clone(), until)
}

/// Whether a producer could claim `key` now, as it does to enqueue a job (the claim it
/// takes is dropped at once).
async fn claimable(producer: &Locker, key: &LockKey) -> bool {
    producer
        .claim(key, Duration::from_secs(60))
        .await
        .unwrap()
        .is_some()
}

/// Job `id` as its producer enqueues it until executed: with the claim it took on the
/// job's key.
async fn claimed_job(producer: &Locker, id: u32) -> Enqueued {
    let job = Job { id, delivery: 1 };
    let claim = producer
        .claim(&key_of(&job).unwrap(), Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a free key");
    Enqueued {
        job,
        claim: Some(claim),
    }
}

#[tokio::test]
async fn until_executed_the_producers_claim_keeps_duplicates_out_until_the_job_is_done() {
    let store = MemoryBackend::new();
    let locker = locker(store.client(), Duration::from_secs(30));
    let job = Job { id: 6, delivery: 1 };
    let key = key_of(&job).unwrap();
    // The producer claims the key and enqueues; a duplicate finds it claimed.
    let claim = locker.claim(&key, Duration::from_secs(60)).await.unwrap();
    let claim = claim.expect("a free key");
    assert!(!claimable(&locker, &key).await);
    let (probe, records) = (locker.clone(), Arc::new(store.client()));
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executed).layer(
        Handler(move |locked: Locked<Enqueued>| {
            let (probe, records) = (probe.clone(), records.clone());
            async move {
                // While it runs, the key is still claimed: no duplicate is enqueued.
                let job_key = key_of(&locked.request.job).unwrap();
                let duplicate = probe.claim(&job_key, Duration::from_secs(60)).await;
                let run = records.inspect(&locked.key).await.unwrap();
                let job = records.inspect(&job_key).await.unwrap();
                let fenced = (locked.key, locked.token, run.token);
                Ok::<_, Infallible>((fenced, job.token, duplicate.unwrap().is_none()))
            }
        }),
    );
    let ((fence_key, token, run_token), job_key_token, kept_out) = service
        .call(Enqueued {
            job,
            claim: Some(claim.clone()),
        })
        .await
        .unwrap();
    assert!(kept_out, "a duplicate was claimed while the job ran");
    // What held the job's key was the producer's claim, resumed: not the key taken afresh
    // (as a run whose claim had lapsed would).
    assert_eq!(
        job_key_token,
        Some(claim.token()),
        "the run held the job's key under another lease than the producer's claim"
    );
    // The run's token is its run key's, which fences it.
    assert_eq!(fence_key.as_str(), "running:job:6");
    assert_eq!(Some(token), run_token);
    // Done: the key is free for the next job.
    assert!(claimable(&locker, &key).await);
}

#[tokio::test]
async fn until_executed_a_delivery_while_an_earlier_one_runs_under_the_claim_is_a_miss() {
    let store = MemoryBackend::new();
    let locker = locker(store.client(), Duration::from_secs(30));
    let enqueued = claimed_job(&locker, 8).await;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let runs = Arc::new(AtomicU32::new(0));
    let (waiting, counted) = (gate.clone(), runs.clone());
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executed).layer(
        Handler(move |locked: Locked<Enqueued>| {
            let (waiting, counted) = (waiting.clone(), counted.clone());
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                let _pass = waiting.acquire().await.unwrap();
                Ok::<_, Infallible>(locked.token)
            }
        }),
    );
    let first = tokio::spawn(service.call(enqueued.clone()));
    let started = Instant::now();
    until_running(&runs, 1, "the job to run").await;
    // The queue delivers the job again while the first run goes on (it took that worker
    // for dead): the delivery carries the same claim, whose lease is alive.
    let again = tokio::spawn(service.call(enqueued));
    while !again.is_finished() {
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "a second run went on beside the first under the same claim"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "no answer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let again = again.await.unwrap();
    assert!(matches!(again, Err(JobError::Busy { .. })), "{again:?}");
    let run_key = LockKey::new("running:job:8").unwrap();
    let run_token = store.inspect(&run_key).await.unwrap().token;
    gate.add_permits(1);
    assert_eq!(Some(first.await.unwrap().unwrap()), run_token);
}

/// Until executed, a retry of a job whose earlier delivery runs is woken by that run's
/// end: the run releases the job's key and then its run key, and the retry, which needs
/// the run key first, is woken by the release of the run key, not a delay later.
#[tokio::test]
async fn until_executed_a_retry_is_woken_when_the_run_before_it_ends() {
    /// Releases run keys a while after the job's key, as a store across a network does
    /// (two round trips): a retry woken by the job's key alone finds the run key held.
    #[derive(Debug)]
    struct SlowRunKeyReleases;

    #[distlock::backend::async_trait]
    impl distlock::backend::BackendLayer for SlowRunKeyReleases {
        async fn release(
            &self,
            next: &dyn LockBackend,
            lease: &distlock::Lease,
        ) -> Result<distlock::Release, LockError> {
            if lease.key().as_str().starts_with("running:") {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            next.release(lease).await
        }
    }

    let store = MemoryBackend::new();
    let locker = locker(
        Layered::new(Arc::new(store.client()), SlowRunKeyReleases),
        Duration::from_secs(30),
    );
    let enqueued = claimed_job(&locker, 12).await;
    let delay = Duration::from_secs(4);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let runs = Arc::new(AtomicU32::new(0));
    let (waiting, counted) = (gate.clone(), runs.clone());
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executed)
        .on_miss(OnMiss::Retry { attempts: 2, delay })
        .layer(Handler(move |_: Locked<Enqueued>| {
            let (waiting, counted) = (waiting.clone(), counted.clone());
            async move {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    let _pass = waiting.acquire().await.unwrap();
                }
                Ok::<_, Infallible>(Instant::now())
            }
        }));
    let first = tokio::spawn(service.call(enqueued.clone()));
    until_running(&runs, 1, "the job to run").await;
    // Delivered again while the first run goes on: its first try misses, and it waits.
    let called = Instant::now();
    let again = tokio::spawn(service.call(enqueued));
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.add_permits(1);
    first.await.unwrap().unwrap();
    let ran = again.await.unwrap().unwrap();
    ran_sooner_than_a_slept_delay("the retry", called, ran, delay);
}

/// Under a claim a run holds two leases, the claim and its run key: losing the run key
/// (here its record deleted in the store) while the claim stays renewed stops the run, as
/// another delivery of the job could now take the run key and run beside it.
#[tokio::test]
async fn until_executed_a_run_that_loses_its_run_key_stops() {
    const TTL: Duration = Duration::from_millis(300);
    let store = MemoryBackend::new();
    let locker = locker(store.client(), TTL);
    let enqueued = claimed_job(&locker, 9).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let running = started.clone();
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executed).layer(
        Handler(move |_: Locked<Enqueued>| {
            let running = running.clone();
            async move {
                running.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, Infallible>(())
            }
        }),
    );
    let run = tokio::spawn(service.call(enqueued));
    started.notified().await;
    let run_key = LockKey::new("running:job:9").unwrap();
    store.client().purge(&run_key).await.unwrap();
    // Its next renewal, a third of the TTL on, finds it gone; a hang guard, not a bound.
    let stopped = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the run went on without its run key")
        .unwrap();
    assert!(matches!(stopped, Err(JobError::Lost { .. })), "{stopped:?}");
}

/// The lock TTL of the worker of [`a_stopped_run`]: short, as the test waits for its lease
/// to end.
const STOPPED_TTL: Duration = Duration::from_millis(300);
/// The lock TTL of the runs after it, which must keep their leases while the test goes on:
/// with [`STOPPED_TTL`], a loaded machine that held up the next run's watchdog for 200 ms
/// stopped the run before the test was done with it.
const NEXT_RUN_TTL: Duration = Duration::from_secs(3);

/// A run of a job under its producer's claim until executed, stopped as a paused
/// worker's is, and what the test needs after it.
struct StoppedRun {
    store: MemoryBackend,
    producer: Locker,
    enqueued: Enqueued,
    /// The stopped run's fence.
    fence: WriteFence,
    /// The producer's hold on the claim, when the claim outlives the run key.
    holder: Option<distlock::LockGuard>,
    /// The stopped worker's store: its calls hang until healed.
    paused: Arc<Faults>,
}

/// Job `id` pushed under its producer's claim and run until executed by a worker that
/// pauses as the job starts (every call to its store hangs from then on), so the run
/// stops when its lease ends; returned once its run key has lapsed, the claim still alive
/// (`claim_outlives_run_key`: the two lapse apart by the time between their renewals;
/// here the producer's locker holds the claim on, so the order is certain) or lapsed too.
async fn a_stopped_run(id: u32, claim_outlives_run_key: bool) -> StoppedRun {
    let store = MemoryBackend::new();
    let producer = locker(store.client(), STOPPED_TTL);
    let enqueued = claimed_job(&producer, id).await;
    let (key, claim) = (
        key_of(&enqueued.job).unwrap(),
        enqueued.claim.clone().unwrap(),
    );

    let paused = Arc::new(Faults::default());
    let (started, mut first_lease) = tokio::sync::mpsc::unbounded_channel();
    let hangs = paused.clone();
    let first_store = Layered::new(Arc::new(store.client()), paused.clone());
    let mut first_worker = claimed_layer(
        locker(first_store, STOPPED_TTL),
        distlock::tower::Until::Executed,
    )
    .layer(Handler(move |locked: Locked<Enqueued>| {
        started
            .send(locked.fence().expect("a job's fence"))
            .unwrap();
        hangs.hang();
        std::future::pending::<Result<(), Infallible>>()
    }));
    let first = tokio::spawn(first_worker.call(enqueued.clone()));
    let fence = first_lease.recv().await.expect("the first run started");
    let holder = if claim_outlives_run_key {
        Some(
            producer
                .resume(&claim)
                .await
                .unwrap()
                .expect("the claim is alive"),
        )
    } else {
        None
    };
    // A hang guard, not a bound: the stopped run's lease ends a TTL after it started.
    let stopped = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the stopped run went on")
        .unwrap();
    assert!(matches!(stopped, Err(JobError::Lost { .. })), "{stopped:?}");
    let run_key = run_key(&key).unwrap();
    let lapsed = Instant::now();
    loop {
        let run_free = store.inspect(&run_key).await.unwrap().owner.is_none();
        let claim_free = store.inspect(&key).await.unwrap().owner.is_none();
        if run_free && claim_free != claim_outlives_run_key {
            break;
        }
        assert!(
            lapsed.elapsed() < Duration::from_secs(10),
            "run key free: {run_free}, claim free: {claim_free}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    StoppedRun {
        store,
        producer,
        enqueued,
        fence,
        holder,
        paused,
    }
}

/// A stopped run of job 10 and the job's next delivery, to another worker: each run's
/// fence ([`Locked::fence`]), and the verdict on the stopped run's write under its fence,
/// in flight when it stopped and arriving after the next run's.
async fn a_stopped_run_and_the_next(
    claim_outlives_run_key: bool,
) -> (WriteFence, WriteFence, Admission) {
    let stopped = a_stopped_run(10, claim_outlives_run_key).await;
    let ledger = Arc::new(MemoryFencedResource::new(EnforcementMode::Enforce));
    let writes = ledger.clone();
    let mut next_worker = claimed_layer(
        locker(stopped.store.client(), NEXT_RUN_TTL),
        distlock::tower::Until::Executed,
    )
    .layer(Handler(move |locked: Locked<Enqueued>| {
        let fence = locked.fence().expect("a job's fence");
        let admitted = writes.admit_under(&fence, || {});
        async move { Ok::<_, Infallible>((fence, admitted)) }
    }));
    let (next, admitted) = next_worker.call(stopped.enqueued).await.unwrap();
    assert!(admitted.is_admitted(), "{admitted:?}");
    let stale = ledger.admit_under(&stopped.fence, || {});
    if let Some(holder) = stopped.holder {
        holder.leave_to_expire();
    }
    (stopped.fence, next, stale)
}

/// The next run after a stopped one fences the key the stopped run fenced, under a higher
/// token, and the stopped run's late write is refused.
async fn the_next_run_fences_the_same_key_higher(claim_outlives_run_key: bool) {
    let (first, next, stale) = a_stopped_run_and_the_next(claim_outlives_run_key).await;
    assert_eq!(first.key(), next.key(), "the runs fence different keys");
    assert!(
        next.token() > first.token(),
        "the next run's token {:?} is not higher than the stopped run's {:?}",
        next.token(),
        first.token()
    );
    assert!(!stale.is_admitted(), "the stopped run's write: {stale:?}");
}

/// A stopped run's run key lapsed before its claim: the next delivery resumes the claim,
/// and runs under a token of its own, higher, so the stopped run's late write is refused.
#[tokio::test]
async fn until_executed_a_delivery_that_resumes_a_stopped_runs_claim_runs_under_a_higher_token() {
    the_next_run_fences_the_same_key_higher(true).await;
}

/// A stopped run's claim lapsed too: the next delivery takes the job's key as usual, and
/// still fences the key the stopped run fenced, under a higher token.
#[tokio::test]
async fn until_executed_a_delivery_after_a_stopped_runs_claim_ran_out_fences_the_same_key() {
    the_next_run_fences_the_same_key_higher(false).await;
}

/// The next delivery of a job resumed the claim of a stopped run (the claim outlived that
/// run's run key): the stopped run, once its worker reaches the store again, leaves the
/// claim alone instead of releasing it, so the next run keeps it, and duplicates out, to
/// its end.
#[tokio::test]
async fn until_executed_a_stopped_run_leaves_alone_the_claim_the_next_run_resumed() {
    let stopped = a_stopped_run(11, true).await;
    // The next delivery resumes the claim and runs until let go; its calls are counted.
    let counted = Arc::new(Faults::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (began, mut next_started) = tokio::sync::mpsc::unbounded_channel();
    let waiting = gate.clone();
    let next_store = Layered::new(Arc::new(stopped.store.client()), counted.clone());
    let mut next_worker = claimed_layer(
        locker(next_store, NEXT_RUN_TTL),
        distlock::tower::Until::Executed,
    )
    .layer(Handler(move |_: Locked<Enqueued>| {
        began.send(()).unwrap();
        let waiting = waiting.clone();
        async move {
            let _pass = waiting.acquire().await.unwrap();
            Ok::<_, Infallible>(())
        }
    }));
    let next = tokio::spawn(next_worker.call(stopped.enqueued.clone()));
    next_started.recv().await.expect("the next run started");
    if let Some(holder) = stopped.holder {
        holder.leave_to_expire();
    }

    // The stopped worker reaches the store again. Two renewals of the next run later (a
    // third of the TTL apart), whatever it sent on waking has arrived.
    stopped.paused.heal();
    let (calls, healed) = (counted.calls(), Instant::now());
    while counted.calls() < calls + 2 {
        assert!(
            healed.elapsed() < NEXT_RUN_TTL * 3,
            "no renewal; the next run ended: {}",
            next.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let key = key_of(&stopped.enqueued.job).unwrap();
    let duplicate = stopped
        .producer
        .claim(&key, Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        duplicate.is_none(),
        "a duplicate was claimed while the next run went on"
    );
    gate.add_permits(1);
    let next = next.await.unwrap();
    assert!(next.is_ok(), "{next:?}");
}

#[tokio::test]
async fn until_executing_the_claim_ends_when_the_job_starts() {
    let store = MemoryBackend::new();
    let locker = locker(store.client(), Duration::from_secs(30));
    let job = Job { id: 7, delivery: 1 };
    let queued = LockKey::new("queued:job:7").unwrap();
    let claim = locker
        .claim(&queued, Duration::from_secs(60))
        .await
        .unwrap();
    let probe = locker.clone();
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executing).layer(
        Handler(move |locked: Locked<Enqueued>| {
            let probe = probe.clone();
            let queued = LockKey::new("queued:job:7").unwrap();
            async move {
                // Started: the next one may be enqueued, while this one holds its key.
                let next = probe.claim(&queued, Duration::from_secs(60)).await.unwrap();
                Ok::<_, Infallible>((locked.key, next.is_some()))
            }
        }),
    );
    let (ran_under, next_enqueued) = service.call(Enqueued { job, claim }).await.unwrap();
    assert_eq!(ran_under.to_string(), "job:7");
    assert!(
        next_enqueued,
        "the claim still held the queue key once the job ran"
    );
}

#[tokio::test]
async fn a_claim_that_ran_out_in_the_queue_leaves_the_job_to_take_its_key() {
    let store = MemoryBackend::new();
    let locker = locker(store.client(), Duration::from_secs(30));
    let job = Job { id: 8, delivery: 1 };
    let key = key_of(&job).unwrap();
    let ttl = Duration::from_millis(200);
    let claim = locker.claim(&key, ttl).await.unwrap().unwrap();
    let claimed_at = Instant::now();
    while store.inspect(&key).await.unwrap().owner.is_some() {
        assert!(claimed_at.elapsed() < ttl * 10, "the claim never ran out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let probe = locker.clone();
    let mut service = claimed_layer(locker.clone(), distlock::tower::Until::Executed).layer(
        Handler(move |locked: Locked<Enqueued>| {
            let probe = probe.clone();
            async move {
                // The job holds its key while it runs: no duplicate is enqueued.
                let job_key = key_of(&locked.request.job).unwrap();
                let duplicate = probe.claim(&job_key, Duration::from_secs(60)).await;
                Ok::<_, Infallible>((locked.key, duplicate.unwrap().is_none()))
            }
        }),
    );
    let (fence_key, kept_out) = service
        .call(Enqueued {
            job: job.clone(),
            claim: Some(claim.clone()),
        })
        .await
        .unwrap();
    assert!(kept_out, "the job ran without its key");
    // Fenced on its run key, as a run under the claim would be.
    assert_eq!(fence_key.as_str(), "running:job:8");
    // Until executed, a claim on another key than the job's is refused before it runs.
    let other = locker
        .claim(
            &LockKey::new("queued:job:8").unwrap(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let refused = service.call(Enqueued { job, claim: other }).await;
    assert!(
        matches!(refused, Err(JobError::Lock(LockError::Config(_)))),
        "{refused:?}"
    );
}

/// The worker of [`until_executing_or_replaced_drops_the_job_a_newer_one_replaced`]: it
/// counts its runs and answers each with the token of the claim it ran under.
fn replaceable_worker(
    locker: Locker,
    until: Until,
    runs: Arc<AtomicU32>,
) -> impl Service<Enqueued, Response = Option<FencingToken>, Error = JobError<Infallible>> {
    claimed_layer(locker, until).layer(Handler(move |locked: Locked<Enqueued>| {
        runs.fetch_add(1, Ordering::SeqCst);
        let token = locked.request.claim.as_ref().map(distlock::Claim::token);
        async move { Ok::<_, Infallible>(token) }
    }))
}

/// Replace: a job whose claim a newer job's producer took over is dropped when it is
/// delivered, and the newer job runs; a job whose claim ran out in the queue with no newer
/// claim after it still runs; and under plain `Until::Executing` nothing changes.
#[tokio::test]
async fn until_executing_or_replaced_drops_the_job_a_newer_one_replaced() {
    let store = MemoryBackend::new();
    let producer = locker(store.client(), Duration::from_secs(30));
    let job = Job {
        id: 12,
        delivery: 1,
    };
    let queued = queue_key(&key_of(&job).unwrap()).unwrap();
    let ttl = Duration::from_secs(60);
    let first = producer.claim_replacing(&queued, ttl).await.unwrap();
    let newer = producer.claim_replacing(&queued, ttl).await.unwrap();
    let (first, newer) = (first.expect("a free key"), newer.expect("replaced"));
    let enqueued = |claim: &distlock::Claim| Enqueued {
        job: job.clone(),
        claim: Some(claim.clone()),
    };

    let runs = Arc::new(AtomicU32::new(0));
    let worker = locker(store.client(), Duration::from_secs(30));
    let mut service = replaceable_worker(worker.clone(), Until::ExecutingOrReplaced, runs.clone());
    // The superseded job, delivered first: dropped, not run.
    let dropped = service.call(enqueued(&first)).await;
    assert!(
        matches!(&dropped, Err(JobError::Replaced { key, by }) if *key == queued && *by == newer.token()),
        "{dropped:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the superseded job ran");
    // The newer one runs, and its claim stays: delivered again now, the superseded job
    // still finds it.
    let ran = service.call(enqueued(&newer)).await.unwrap();
    assert_eq!(ran, Some(newer.token()));
    let again = service.call(enqueued(&first)).await;
    assert!(matches!(again, Err(JobError::Replaced { .. })), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A claim that ran out in the queue, nobody claiming after it: the job runs.
    let other = Job {
        id: 13,
        delivery: 1,
    };
    let other_queued = queue_key(&key_of(&other).unwrap()).unwrap();
    let short = Duration::from_millis(100);
    let lapsed = producer
        .claim_replacing(&other_queued, short)
        .await
        .unwrap();
    let lapsed = lapsed.expect("a free key");
    let claimed_at = Instant::now();
    while store.inspect(&other_queued).await.unwrap().owner.is_some() {
        assert!(claimed_at.elapsed() < short * 50, "the claim never ran out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ran = service
        .call(Enqueued {
            job: other,
            claim: Some(lapsed.clone()),
        })
        .await
        .unwrap();
    assert_eq!(ran, Some(lapsed.token()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // A claim on the job's own key is refused before anything runs.
    let mine = Job {
        id: 14,
        delivery: 1,
    };
    let own = producer.claim(&key_of(&mine).unwrap(), ttl).await.unwrap();
    let refused = service
        .call(Enqueued {
            job: mine,
            claim: own,
        })
        .await;
    assert!(
        matches!(refused, Err(JobError::Lock(LockError::Config(_)))),
        "{refused:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Until executing as before, replace not chosen: the superseded job runs.
    let mut plain = replaceable_worker(worker, Until::Executing, runs.clone());
    assert_eq!(
        plain.call(enqueued(&first)).await.unwrap(),
        Some(first.token())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
