//! [`LeaderService::poll_ready`] reports the inner service's readiness while leading.

use std::convert::Infallible;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use distlock_core::{Election, Locker};
use tokio::time::Instant;
use tower::limit::ConcurrencyLimit;
use tower_layer::Layer;
use tower_service::Service;

use super::{LeaderLayer, LeaderService};
use crate::tower::Locked;

/// A tick's job that waits for `gate` before it ends.
#[derive(Clone)]
struct Gated(Arc<tokio::sync::Semaphore>);

impl Service<Locked<u32>> for Gated {
    type Response = u32;
    type Error = Infallible;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<u32, Infallible>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, tick: Locked<u32>) -> Self::Future {
        let gate = self.0.clone();
        Box::pin(async move {
            drop(gate.acquire().await.unwrap());
            Ok(tick.request)
        })
    }
}

async fn leader(url: &str, role: &str) -> LeaderLayer {
    let locker = Locker::builder(crate::connect(url).await.unwrap())
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    LeaderLayer::new(Election::new(locker, role).unwrap()).unwrap()
}

async fn until_leading(layer: &LeaderLayer) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !layer.is_leading() {
        assert!(Instant::now() < deadline, "never elected");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls `service` for readiness once.
fn ready_now<S: Service<u32>>(service: &mut S) -> Poll<Result<(), S::Error>> {
    service.poll_ready(&mut Context::from_waker(std::task::Waker::noop()))
}

/// A leader whose inner service is at capacity (one tick at a time, one running) is not
/// ready, and becomes ready when the tick ends; a standby is ready at once, whatever its
/// inner service: it answers `Ok(None)` without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_at_capacity_is_not_ready_and_a_standby_is() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let role = format!("poll-ready-{:x}", rand::random::<u64>());
    let leading = leader(&redis.url(), &role).await;
    until_leading(&leading).await;
    let standby = leader(&redis.url(), &role).await;

    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let mut service: LeaderService<_> =
        leading.layer(ConcurrencyLimit::new(Gated(gate.clone()), 1));
    poll_fn(|cx| service.poll_ready(cx)).await.unwrap();
    let first = tokio::spawn(service.call(1));
    // The first tick holds the only permit until the gate opens.
    assert!(
        ready_now(&mut service).is_pending(),
        "the leader reported ready while its inner service had no capacity"
    );

    let mut standby_service = standby.layer(ConcurrencyLimit::new(Gated(gate.clone()), 1));
    assert!(!standby.is_leading());
    assert!(matches!(
        ready_now(&mut standby_service),
        Poll::Ready(Ok(()))
    ));
    assert_eq!(standby_service.call(7).await.unwrap(), None);

    gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap(), Some(1));
    poll_fn(|cx| service.poll_ready(cx)).await.unwrap();
    gate.add_permits(1);
    assert_eq!(service.call(2).await.unwrap(), Some(2));
    leading.resign().await;
    standby.resign().await;
}

/// [`LeaderLayer::resign`] gives the role up at once: a standby leads long before the
/// leader's lease (10 s) would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resigned_leader_hands_the_role_to_a_standby_before_its_ttl() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let role = format!("resign-{:x}", rand::random::<u64>());
    let first = leader(&redis.url(), &role).await;
    until_leading(&first).await;
    let second = leader(&redis.url(), &role).await;
    let resigned = Instant::now();
    first.resign().await;
    assert!(!first.is_leading());
    until_leading(&second).await;
    let took = resigned.elapsed();
    // Without the release the lease would run out a TTL after its last renewal, and the
    // watchdog renews every third of the TTL: no sooner than two thirds of it (6.7 s)
    // after the resignation. With it, the standby is woken by the release, or asks again
    // after its longest backoff: well within a third.
    assert!(
        took < Duration::from_secs(10) / 3,
        "the standby led {took:?} after the resignation"
    );
    println!("standby led {took:?} after the resignation");
    second.resign().await;
}

/// Made ready while it led (the inner service's only permit taken), then called after it
/// gave the role up: the call answers `Ok(None)` and the permit is given back, so that a
/// standby holds none of the inner service's capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_after_the_leadership_went_gives_the_readiness_back() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let role = format!("readiness-{:x}", rand::random::<u64>());
    let leading = leader(&redis.url(), &role).await;
    until_leading(&leading).await;
    let limited = ConcurrencyLimit::new(Gated(Arc::new(tokio::sync::Semaphore::new(1))), 1);
    // Another clone shares the limit's one permit.
    let mut probe = limited.clone();
    let mut service = leading.layer(limited);
    poll_fn(|cx| service.poll_ready(cx)).await.unwrap();
    assert!(
        ready_now_on(&mut probe).is_pending(),
        "the leader's readiness holds the permit"
    );
    leading.resign().await;
    assert_eq!(service.call(1).await.unwrap(), None);
    assert!(
        matches!(ready_now_on(&mut probe), Poll::Ready(Ok(()))),
        "the standby kept the inner service's permit after its call"
    );
}

/// Polls an inner service for readiness once.
fn ready_now_on<S: Service<Locked<u32>>>(service: &mut S) -> Poll<Result<(), S::Error>> {
    service.poll_ready(&mut Context::from_waker(std::task::Waker::noop()))
}
