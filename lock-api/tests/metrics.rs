//! The metrics the dashboard needs are recorded with the names DESIGN.md gives.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::memory::MemoryBackend;
use distlock_core::telemetry::{
    ACQUIRE_SECONDS, ACQUIRE_TOTAL, FENCE_REJECTED_TOTAL, HELD, LOST_TOTAL, RENEW_TOTAL,
};
use distlock_core::{EnforcementMode, FencingToken, LockKey, Locker, MemoryFencedResource};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

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
            let backend = Arc::new(MemoryBackend::new());
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
            backend.faults().partition();
            guard.lost().await;

            let fenced = MemoryFencedResource::new(EnforcementMode::Shadow);
            fenced.admit_now("ledger", FencingToken(2));
            fenced.admit_now("ledger", FencingToken(1));
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
