//! `distlock::apalis`: plain apalis handlers behind the lock layer, called as an apalis
//! worker calls them (a `Task` with its attempt count), on the in-memory store.

use std::sync::Arc;
use std::time::Duration;

use apalis_core::error::{AbortError, BoxDynError, RetryAfterError};
use apalis_core::task::Task;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::status::Status;
use apalis_core::task::task_fn::task_fn;
use distlock::apalis::{ApalisLockLayer, JobLease, job_error};
use distlock::backend::Layered;
use distlock::memory::{Faults, MemoryBackend};
use distlock::tower::{JobError, Until};
use distlock::{FencingToken, LockError, LockKey, Locker, WriteFence};
use tower::{Layer, Service, ServiceExt};

#[derive(Clone, Debug)]
struct Payout {
    id: u64,
}

fn key(job: &Payout) -> Result<LockKey, LockError> {
    LockKey::new(format!("payout:{}", job.id))
}

async fn locker() -> Locker {
    Locker::builder(distlock::connect("memory://").await.unwrap())
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap()
}

fn delivery(id: u64, attempt: usize) -> Task<Payout> {
    TaskBuilder::new(Payout { id }).attempt(attempt).build()
}

/// The handler's own error, to tell it from the layer's.
#[derive(Debug)]
struct Declined;

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("declined by the provider")
    }
}

impl std::error::Error for Declined {}

#[tokio::test]
async fn a_plain_handler_runs_under_the_lock_and_gets_its_token() {
    let locker = locker().await;
    let probe = locker.clone();
    // The handler sees its key held (by its own lease) and returns its token.
    let handler = move |job: Payout, lease: JobLease| {
        let probe = probe.clone();
        async move {
            let held = probe.try_lock(&key(&job)?).await?.is_none();
            assert!(lease.status().is_held());
            Ok::<_, BoxDynError>((held, lease.token()))
        }
    };
    let mut worker = ApalisLockLayer::new(locker.clone(), key).layer(task_fn(handler));
    let (held, token) = worker
        .ready()
        .await
        .unwrap()
        .call(delivery(7, 1))
        .await
        .unwrap();
    assert!(held, "the job ran without its key held");
    let after = locker
        .try_lock(&key(&Payout { id: 7 }).unwrap())
        .await
        .unwrap();
    let after = after.expect("the key was not released when the job ended");
    assert!(after.token() > token, "{:?} after {token:?}", after.token());
}

#[tokio::test]
async fn a_handler_that_takes_no_lease_runs_too_and_its_own_errors_pass_unchanged() {
    let handler = |_: Payout| async { Err::<(), _>(Box::new(Declined) as BoxDynError) };
    let mut worker = ApalisLockLayer::new(locker().await, key).layer(task_fn(handler));
    let e = worker
        .ready()
        .await
        .unwrap()
        .call(delivery(1, 1))
        .await
        .unwrap_err();
    assert!(e.downcast_ref::<Declined>().is_some(), "{e:?}");
    assert!(job_error(&*e).is_none(), "{e:?}");
}

#[tokio::test]
async fn a_held_key_sends_the_job_back_after_a_jittered_growing_delay() {
    let locker = locker().await;
    let _other = locker
        .try_lock(&key(&Payout { id: 3 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    let handler = move |_: Payout| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        async { Ok::<_, BoxDynError>(()) }
    };
    let base = Duration::from_millis(400);
    let mut worker = ApalisLockLayer::new(locker, key)
        .retry_after(base)
        .unwrap()
        .layer(task_fn(handler));
    for (attempt, ceiling) in [(1, base), (2, base * 2), (4, base * 8), (30, base * 64)] {
        let e = worker
            .ready()
            .await
            .unwrap()
            .call(delivery(3, attempt))
            .await
            .unwrap_err();
        let retry = e
            .downcast_ref::<RetryAfterError>()
            .unwrap_or_else(|| panic!("not a RetryAfterError: {e:?}"));
        let delay = retry.get_duration();
        assert!(
            delay >= ceiling / 2 && delay <= ceiling,
            "delivery {attempt}: {delay:?} outside [{:?}, {ceiling:?}]",
            ceiling / 2
        );
        assert!(
            matches!(job_error(&*e), Some(JobError::Busy { .. })),
            "{e:?}"
        );
    }
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "the job ran without its lock"
    );
}

#[tokio::test]
async fn a_job_that_keeps_meeting_its_key_held_is_dead_lettered_and_marked_killed() {
    let locker = locker().await;
    let _other = locker
        .try_lock(&key(&Payout { id: 5 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let handler = |_: Payout| async { Ok::<_, BoxDynError>(()) };
    const RETRY_AFTER: Duration = Duration::from_millis(100);
    let mut worker = ApalisLockLayer::new(locker, key)
        .retry_after(RETRY_AFTER)
        .unwrap()
        .dead_letter_after(3)
        .layer(task_fn(handler));
    let mut outcomes = Vec::new();
    // apalis counts an attempt only when its handler runs: every delivery the layer
    // sends back comes again with the same attempt count, and the layer counts itself,
    // one miss at most every half retry delay.
    for delivered in 1..=3 {
        if delivered > 1 {
            tokio::time::sleep(RETRY_AFTER / 2).await;
        }
        let task = delivery(5, 1);
        let ctx = task.ctx().clone();
        let e = worker.ready().await.unwrap().call(task).await.unwrap_err();
        outcomes.push((
            e.downcast_ref::<RetryAfterError>().is_some(),
            e.downcast_ref::<AbortError>().is_some(),
            format!("{:?}", job_error(&*e)),
            ctx.status(),
        ));
    }
    assert!(outcomes[0].0 && outcomes[1].0, "{outcomes:#?}");
    // apalis's storage acknowledges by the task's status: pending goes back to the
    // queue, killed to the dead letters.
    assert_eq!(outcomes[0].3, Status::Pending, "{outcomes:#?}");
    assert!(outcomes[2].1, "{outcomes:#?}");
    assert!(
        outcomes[2].2.contains("DeadLetter") && outcomes[2].2.contains("misses: 3"),
        "{outcomes:#?}"
    );
    assert_eq!(outcomes[2].3, Status::Killed, "{outcomes:#?}");
}

/// A storage that sends a missed job straight back (apalis-redis 1.0 does) runs through
/// deliveries far faster than the layer's retry delay: they count as one miss, so the
/// job is not dead-lettered while a paused holder's lease is still running out.
#[tokio::test]
async fn deliveries_sent_back_sooner_than_half_the_retry_delay_count_as_one_miss() {
    let locker = locker().await;
    let _other = locker
        .try_lock(&key(&Payout { id: 6 }).unwrap())
        .await
        .unwrap()
        .unwrap();
    let handler = |_: Payout| async { Ok::<_, BoxDynError>(()) };
    let mut worker = ApalisLockLayer::new(locker, key)
        .retry_after(Duration::from_secs(60))
        .unwrap()
        .dead_letter_after(3)
        .layer(task_fn(handler));
    for delivered in 1..=20 {
        let task = delivery(6, 1);
        let ctx = task.ctx().clone();
        let e = worker.ready().await.unwrap().call(task).await.unwrap_err();
        assert!(
            matches!(job_error(&*e), Some(JobError::Busy { .. })),
            "delivery {delivered}: {:?}",
            job_error(&*e)
        );
        assert_eq!(ctx.status(), Status::Pending, "delivery {delivered}");
    }
}

/// A job the layer cannot lock whatever it does (its key is invalid) is killed: marked
/// so, and an `AbortError`, so that apalis does not deliver it again and again.
#[tokio::test]
async fn a_job_whose_key_is_invalid_is_killed_not_retried() {
    let handler = |_: Payout| async { Ok::<_, BoxDynError>(()) };
    let invalid = |_: &Payout| LockKey::new("");
    let mut worker = ApalisLockLayer::new(locker().await, invalid).layer(task_fn(handler));
    let task = delivery(1, 1);
    let ctx = task.ctx().clone();
    let e = worker.ready().await.unwrap().call(task).await.unwrap_err();
    assert!(e.downcast_ref::<AbortError>().is_some(), "{e}");
    assert!(
        matches!(
            job_error(&*e),
            Some(JobError::Lock(LockError::InvalidKey { .. }))
        ),
        "{:?}",
        job_error(&*e)
    );
    assert_eq!(ctx.status(), Status::Killed);
}

/// A job whose lock store does not answer is a failed attempt, to be tried again: marked
/// failed (not left as it was), and not an `AbortError`.
#[tokio::test]
async fn a_job_whose_store_is_unreachable_is_a_failed_attempt() {
    let faults = Arc::new(Faults::default());
    let store = Layered::new(Arc::new(MemoryBackend::new()), faults.clone());
    let locker = Locker::builder(Arc::new(store))
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    faults.partition();
    let handler = |_: Payout| async { Ok::<_, BoxDynError>(()) };
    let mut worker = ApalisLockLayer::new(locker, key).layer(task_fn(handler));
    let task = delivery(2, 1);
    let ctx = task.ctx().clone();
    let e = worker.ready().await.unwrap().call(task).await.unwrap_err();
    assert!(e.downcast_ref::<AbortError>().is_none(), "{e}");
    assert!(
        matches!(job_error(&*e), Some(JobError::Lock(l)) if l.is_retryable()),
        "{:?}",
        job_error(&*e)
    );
    assert_eq!(ctx.status(), Status::Failed);
}

#[tokio::test]
async fn a_lease_asked_for_outside_the_layer_is_a_missing_data_error() {
    let handler = |_: Payout, lease: JobLease| async move { Ok::<_, BoxDynError>(lease.token()) };
    let mut worker = task_fn(handler);
    let e: BoxDynError = worker
        .ready()
        .await
        .unwrap()
        .call(delivery(9, 1))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("JobLease"), "{e}");
}

#[tokio::test]
async fn a_zero_retry_delay_is_refused() {
    let e = ApalisLockLayer::new(locker().await, key)
        .retry_after(Duration::ZERO)
        .unwrap_err();
    assert!(matches!(e, LockError::Config(_)), "{e:?}");
}

/// What a handler of the fence test returns: its fence, its lease's token and the token the
/// store shows on the fence's key.
async fn fence_and_holder(
    probe: Locker,
    lease: JobLease,
) -> Result<(WriteFence, FencingToken, Option<FencingToken>), BoxDynError> {
    let fence = lease.fence();
    let held = probe.backend().inspect(fence.key()).await?;
    Ok((fence, lease.token(), held.token))
}

/// A payout its producer claimed before it pushed it, for `Until::Executed`.
#[derive(Clone, Debug)]
struct ClaimedPayout {
    id: u64,
    claim: Option<distlock::Claim>,
}

#[tokio::test]
async fn the_handlers_fence_is_its_leases_key_and_token_the_run_key_until_executed() {
    let locker = locker().await;
    let probe = locker.clone();
    let handler = move |_: Payout, lease| fence_and_holder(probe.clone(), lease);
    let mut worker = ApalisLockLayer::new(locker.clone(), key).layer(task_fn(handler));
    let (fence, token, held) = worker
        .ready()
        .await
        .unwrap()
        .call(delivery(11, 1))
        .await
        .unwrap();
    assert_eq!(
        fence.key().as_str(),
        "payout:11",
        "fenced on another key than the job's"
    );
    assert_eq!(fence.token(), token);
    assert_eq!(
        held,
        Some(token),
        "the fence's token is not its key's holder's"
    );

    // Until executed: the run key, under the run key's token.
    let producer = locker.clone();
    let job_key = LockKey::new("payout:12").unwrap();
    let claim = producer
        .claim(&job_key, Duration::from_secs(60))
        .await
        .unwrap();
    let claim = claim.expect("a free key");
    let layer = ApalisLockLayer::new(locker.clone(), |job: &ClaimedPayout| {
        LockKey::new(format!("payout:{}", job.id))
    })
    .claimed(|job: &ClaimedPayout| job.claim.clone(), Until::Executed);
    let probe = locker.clone();
    let handler = move |_: ClaimedPayout, lease| fence_and_holder(probe.clone(), lease);
    let mut worker = layer.layer(task_fn(handler));
    let task = TaskBuilder::new(ClaimedPayout {
        id: 12,
        claim: Some(claim.clone()),
    })
    .attempt(1)
    .build();
    let (fence, token, held) = worker.ready().await.unwrap().call(task).await.unwrap();
    assert_eq!(
        fence.key().as_str(),
        "running:payout:12",
        "not fenced on the run key"
    );
    assert_eq!(fence.token(), token);
    assert_eq!(
        held,
        Some(token),
        "the fence's token is not the run key's holder's"
    );
}
