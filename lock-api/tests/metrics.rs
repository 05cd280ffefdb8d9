//! The metrics the dashboard needs are recorded with the names DESIGN.md gives.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::telemetry::{
    ACQUIRE_SECONDS, ACQUIRE_TOTAL, FENCE_REJECTED_TOTAL, HELD, HELD_SECONDS, LOST_TOTAL,
    RENEW_TOTAL, WAIT_SECONDS,
};
use distlock_core::{
    BackendLayer, Election, EnforcementMode, FencingToken, Layered, Lease, LockBackend, LockError,
    LockKey, Locker, MemoryFencedResource, async_trait,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::time::Instant;

type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

fn value<'a>(
    snapshot: &'a Snapshot,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    snapshot
        .iter()
        .find(|(key, _, _, _)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(_, _, _, value)| value)
}

#[test]
fn acquire_renew_loss_and_stale_writes_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let faults = Arc::new(Faults::default());
            let backend = Arc::new(Layered::new(Arc::new(MemoryBackend::new()), faults.clone()));
            let locker = Locker::builder(backend.clone())
                .ttl(Duration::from_secs(3))
                .build()
                .unwrap();
            let key = LockKey::new("job").unwrap();
            let guard = locker.try_lock(&key).await.unwrap().unwrap();
            assert!(locker.try_lock(&key).await.unwrap().is_none());
            let held = locker.held();
            assert_eq!(held, 1);
            tokio::time::sleep(Duration::from_millis(1100)).await;
            faults.partition();
            guard.lost().await;

            let fenced = MemoryFencedResource::new(EnforcementMode::Shadow);
            fenced.check_only_now("ledger", FencingToken(2));
            fenced.check_only_now("ledger", FencingToken(1));
        });
    });
    let snapshot: Snapshot = snapshotter.snapshot().into_vec();
    let counter = |name, labels: &[(&str, &str)]| value(&snapshot, name, labels);
    assert_eq!(
        counter(
            ACQUIRE_TOTAL,
            &[("outcome", "acquired"), ("backend", "memory")]
        ),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        counter(ACQUIRE_TOTAL, &[("outcome", "contended")]),
        Some(&DebugValue::Counter(1))
    );
    assert!(matches!(
        counter(ACQUIRE_SECONDS, &[("backend", "memory")]),
        Some(DebugValue::Histogram(h)) if h.len() == 2
    ));
    assert_eq!(
        counter(RENEW_TOTAL, &[("outcome", "renewed")]),
        Some(&DebugValue::Counter(1))
    );
    assert!(matches!(
        counter(RENEW_TOTAL, &[("outcome", "error")]),
        Some(&DebugValue::Counter(n)) if n >= 1
    ));
    assert_eq!(counter(LOST_TOTAL, &[]), Some(&DebugValue::Counter(1)));
    assert_eq!(
        counter(HELD, &[("backend", "memory")]),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert_eq!(
        counter(FENCE_REJECTED_TOTAL, &[("mode", "shadow")]),
        Some(&DebugValue::Counter(1))
    );
}

/// Runs `scenario` on a current-thread runtime with a paused clock, recording into a
/// recorder of its own, and returns what was recorded.
fn recorded<F, Fut>(scenario: F) -> Snapshot
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(scenario());
    });
    snapshotter.snapshot().into_vec()
}

/// The samples of the histogram `name` with `labels`; none if it was never recorded.
fn samples(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    match value(snapshot, name, labels) {
        Some(DebugValue::Histogram(samples)) => samples.iter().map(|s| s.into_inner()).collect(),
        Some(other) => panic!("{name} is not a histogram: {other:?}"),
        None => Vec::new(),
    }
}

fn memory_locker(backend: Arc<dyn LockBackend>, wait: Duration) -> Locker {
    Locker::builder(backend)
        .ttl(Duration::from_secs(3))
        .wait_timeout(Some(wait))
        .build()
        .unwrap()
}

/// A waiter blocked by a holder records a wait at least as long as the holder held the
/// lease, labelled `acquired`; the holder's hold is recorded when it releases; and each
/// attempt the waiter made while the key was held counts as contended.
#[test]
fn a_waited_lock_records_the_wait_and_the_holders_hold() {
    const HOLD: Duration = Duration::from_secs(2);
    let snapshot = recorded(|| async {
        let locker = memory_locker(Arc::new(MemoryBackend::new()), Duration::from_secs(30));
        let key = LockKey::new("job").unwrap();
        let holder = locker.try_lock(&key).await.unwrap().unwrap();
        let releasing = tokio::spawn(async move {
            tokio::time::sleep(HOLD).await;
            holder.release().await.unwrap();
        });
        // `with_lock` waits through `Locker::lock`, as a caller of either does.
        locker.with_lock(&key, |_| async {}).await.unwrap();
        releasing.await.unwrap();
    });

    let waits = samples(
        &snapshot,
        WAIT_SECONDS,
        &[("backend", "memory"), ("outcome", "acquired")],
    );
    let holds = samples(&snapshot, HELD_SECONDS, &[("backend", "memory")]);
    assert_eq!(waits.len(), 1, "one waiting acquire: {waits:?}");
    assert_eq!(
        holds.len(),
        2,
        "the holder's lease and the waiter's: {holds:?}"
    );
    let holders = holds.iter().copied().fold(0.0, f64::max);
    assert!(holders >= HOLD.as_secs_f64(), "the holder held {holders} s");
    assert!(
        holders < HOLD.as_secs_f64() + 0.1,
        "the holder held {holders} s"
    );
    assert!(
        waits[0] >= holders,
        "the waiter waited {} s for a lease held {holders} s",
        waits[0]
    );
    for outcome in ["timed_out", "error"] {
        assert_eq!(
            samples(&snapshot, WAIT_SECONDS, &[("outcome", outcome)]),
            Vec::<f64>::new()
        );
    }
    assert!(matches!(
        value(&snapshot, ACQUIRE_TOTAL, &[("outcome", "contended")]),
        Some(&DebugValue::Counter(n)) if n >= 1
    ));
}

/// A wait that runs out records the time waited, labelled `timed_out`.
#[test]
fn a_wait_that_times_out_records_it() {
    const WAIT: Duration = Duration::from_millis(500);
    let snapshot = recorded(|| async {
        let locker = memory_locker(Arc::new(MemoryBackend::new()), WAIT);
        let key = LockKey::new("job").unwrap();
        let _holder = locker.try_lock(&key).await.unwrap().unwrap();
        let err = locker.lock(&key).await.unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }), "{err}");
    });
    let waits = samples(
        &snapshot,
        WAIT_SECONDS,
        &[("backend", "memory"), ("outcome", "timed_out")],
    );
    assert_eq!(waits.len(), 1, "{waits:?}");
    assert!(
        waits[0] >= WAIT.as_secs_f64() && waits[0] < WAIT.as_secs_f64() + 0.1,
        "waited {} s",
        waits[0]
    );
    assert_eq!(
        samples(&snapshot, WAIT_SECONDS, &[("outcome", "acquired")]),
        Vec::<f64>::new()
    );
}

/// A store that refuses every acquire with an error no retry can fix.
#[derive(Debug)]
struct Refuses;

#[async_trait]
impl BackendLayer for Refuses {
    async fn acquire(
        &self,
        _next: &dyn LockBackend,
        _key: &LockKey,
        _ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        Err(LockError::Config("refused".into()))
    }
}

/// A wait that ends with an error it could not retry records the time waited, labelled
/// `error`.
#[test]
fn a_wait_that_fails_records_an_error() {
    let snapshot = recorded(|| async {
        let backend = Layered::new(Arc::new(MemoryBackend::new()), Refuses);
        let locker = memory_locker(Arc::new(backend), Duration::from_secs(30));
        let err = locker
            .lock(&LockKey::new("job").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Config(_)), "{err}");
    });
    let waits = samples(
        &snapshot,
        WAIT_SECONDS,
        &[("backend", "memory"), ("outcome", "error")],
    );
    assert_eq!(
        waits,
        vec![0.0],
        "an error at the first attempt, no time passed"
    );
}

/// A lease lost while its process was paused past its deadline counts as held up to the
/// deadline, not up to when the loss was noticed.
#[test]
fn a_lost_lease_records_its_hold_up_to_its_deadline() {
    let mut expected = Duration::ZERO;
    let valid_for = &mut expected;
    let snapshot = recorded(move || async move {
        let faults = Arc::new(Faults::default());
        let backend = Arc::new(Layered::new(Arc::new(MemoryBackend::new()), faults.clone()));
        let locker = memory_locker(backend.clone(), Duration::from_secs(30));
        let granted = Instant::now();
        let guard = locker
            .try_lock(&LockKey::new("job").unwrap())
            .await
            .unwrap()
            .unwrap();
        *valid_for = guard.valid_until() - granted;
        faults.partition();
        // A pause of ten seconds, three times the TTL: no renewal runs during it.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!guard.is_held());
    });
    let holds = samples(&snapshot, HELD_SECONDS, &[("backend", "memory")]);
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert!(
        (holds[0] - expected.as_secs_f64()).abs() < 1e-6,
        "held {} s, the lease was valid for {expected:?}",
        holds[0]
    );
    assert_eq!(
        value(&snapshot, LOST_TOTAL, &[("backend", "memory")]),
        Some(&DebugValue::Counter(1))
    );
}

/// The guard metrics say what a lease is for: a lock, a permit or a leadership, each
/// under its own `kind`, so permits and leaderships do not blur the locks' figures.
#[test]
fn locks_permits_and_leaderships_are_told_apart_by_kind() {
    let snapshot = recorded(|| async {
        let locker = memory_locker(Arc::new(MemoryBackend::new()), Duration::from_secs(30));
        let lock = locker.lock(&LockKey::new("job").unwrap()).await.unwrap();
        let semaphore = locker
            .semaphore(&LockKey::new("exports").unwrap(), 2)
            .unwrap();
        let permit = semaphore.acquire().await.unwrap();
        let election = Election::new(locker.clone(), "scheduler").unwrap();
        let leadership = election.campaign().await.unwrap();
        lock.release().await.unwrap();
        permit.release().await.unwrap();
        drop(leadership);
    });
    for kind in ["lock", "permit", "leader"] {
        let holds = samples(&snapshot, HELD_SECONDS, &[("kind", kind)]);
        assert_eq!(holds.len(), 1, "{kind}: {holds:?}");
        assert!(
            value(&snapshot, HELD, &[("kind", kind)]).is_some(),
            "{kind}: no {HELD} gauge"
        );
    }
    for kind in ["lock", "permit"] {
        let waits = samples(
            &snapshot,
            WAIT_SECONDS,
            &[("kind", kind), ("outcome", "acquired")],
        );
        assert_eq!(waits.len(), 1, "{kind}: {waits:?}");
    }
}
