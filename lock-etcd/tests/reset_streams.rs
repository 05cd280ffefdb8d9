//! A connection that HTTP/2 closes after too many streams the client reset itself.
//!
//! The h2 crate counts, per connection, the frames that arrive for a stream the client reset
//! and no longer remembers (a call cancelled or timed out whose reply comes later), and at
//! 1,024 closes the connection with `GOAWAY(ENHANCE_YOUR_CALM, "too_many_internal_resets")`.
//! A worker whose etcd calls are cancelled meets it in time; the backend must come through
//! it: the calls caught in flight fail with a retryable error, the next calls go out on a
//! new connection, and a held lock is still renewed.

mod common;

use std::time::Duration;

use common::EtcdFactory;
use distlock_core::{Fence, LockBackend, LockError, LockKey, Renewal};
use futures::future::join_all;
use tokio::time::{Instant, sleep_until, timeout};

/// Calls cancelled per round: about what the server's HTTP/2 flow-control window (64 KiB)
/// lets through in one round trip. h2 (0.4.20) remembers 50 reset streams at a time; a
/// reply for any other counts toward its limit, some 300 a round here.
const PER_ROUND: usize = 400;

/// Rounds after which the connection must have been closed: more than 1,024 late replies.
const MAX_ROUNDS: usize = 12;

/// The proxy's latency each way: the replies to a round's calls come after the round's
/// calls were cancelled, all at once.
const DELAY: Duration = Duration::from_millis(300);

/// How long a cancelled call runs: long enough for its request to be written, far shorter
/// than its round trip.
const CANCEL_AFTER: Duration = Duration::from_millis(250);

/// How often the steady stream of renewals starts one: many per round trip (`DELAY * 2`).
const STEADY_EVERY: Duration = Duration::from_millis(50);

const TTL: Duration = Duration::from_secs(60);

fn key(name: &str) -> LockKey {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    LockKey::new(format!("etcd-resets:{random:016x}:{name}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_too_many_cancelled_streams_go_out_on_a_new_connection() {
    // The request timeout is far longer than the proxy's round trip: every call cancelled
    // here is cancelled by the test, and every call not cancelled gets its reply.
    let factory = EtcdFactory::single()
        .await
        .with_request_timeout(Duration::from_secs(60));
    let backend = factory.etcd().await;
    let proxy = &factory.proxies()[0];
    let held_key = key("held");
    let held = backend
        .acquire(&held_key, TTL)
        .await
        .unwrap()
        .expect("a fresh key is free");
    let connections_before = proxy.accepted();

    proxy.delay(DELAY);
    // Beside the calls cancelled, a steady stream of renewals of the held lock: one starts
    // every `STEADY_EVERY`, and none can get its reply sooner than a round trip through
    // the proxy (`DELAY` each way) after it started. So whenever the connection closes,
    // the renewals started in the round trip before are in flight, and fail.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let steady = tokio::spawn({
        let backend = backend.clone();
        let held = held.clone();
        async move {
            let mut calls = tokio::task::JoinSet::new();
            let mut every = tokio::time::interval(STEADY_EVERY);
            tokio::pin!(stopped);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = every.tick() => {
                        let backend = backend.clone();
                        let held = held.clone();
                        calls.spawn(async move { backend.renew(&held).await });
                    }
                }
            }
            calls.join_all().await
        }
    });
    let mut errors: Vec<LockError> = Vec::new();
    let mut round = 0;
    while proxy.accepted() == connections_before {
        assert!(
            round < MAX_ROUNDS,
            "no new connection after {round} rounds of cancelled calls"
        );
        let started = Instant::now();
        let cancelled = join_all((0..PER_ROUND).map(|i| {
            let key = key(&format!("cancelled-{round}-{i}"));
            let backend = backend.clone();
            async move { timeout(CANCEL_AFTER, backend.acquire(&key, TTL)).await }
        }))
        .await;
        for outcome in cancelled {
            match outcome {
                Err(_cancelled) => {}
                // Caught by the closing connection before it was cancelled.
                Ok(Err(e)) => errors.push(e),
                Ok(Ok(got)) => panic!("a call got its reply before it was cancelled: {got:?}"),
            }
        }
        // The server's flow-control window comes back with the replies.
        sleep_until(started + DELAY * 2 + Duration::from_millis(300)).await;
        round += 1;
    }
    stop.send(()).unwrap();
    let renewals = steady.await.unwrap();
    let renewals_sent = renewals.len();
    for renewal in renewals {
        match renewal {
            Ok(renewal) => assert!(matches!(renewal, Renewal::Renewed { .. }), "{renewal:?}"),
            Err(e) => errors.push(e),
        }
    }
    assert!(
        !errors.is_empty(),
        "of {renewals_sent} renewals, those started in the round trip before the connection \
         closed were in flight then and must have failed"
    );
    for e in &errors {
        assert!(
            e.is_retryable(),
            "a call caught by the closed connection failed for good: {e} ({e:?})"
        );
    }

    proxy.delay(Duration::ZERO);
    // Later calls go out on the new connection, and the held lock was kept.
    let renewal = backend.renew(&held).await.expect("renew after the GoAway");
    assert!(matches!(renewal, Renewal::Renewed { .. }), "{renewal:?}");
    assert_eq!(backend.fence(&held).await.unwrap(), Fence::Current);
    let fresh = backend
        .acquire(&key("after"), TTL)
        .await
        .expect("acquire after the GoAway")
        .expect("a fresh key is free");
    assert!(
        proxy.accepted() > connections_before,
        "h2 closed the connection and the client made a new one ({} calls in flight \
         failed: {errors:?})",
        errors.len()
    );
    for lease in [&fresh, &held] {
        backend.release(lease).await.unwrap();
    }
}
