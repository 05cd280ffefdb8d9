//! [`TickLayer`] on a real redis-server: a tick claimed by one leader does not run again in
//! the next, a tick nobody claimed is caught up by the instance that gains leadership, a
//! tick older than the catch-up window does not run, and bad settings fail before anything
//! is sent.

use std::convert::Infallible;
use std::future::Ready;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use distlock_core::{Election, LockError, Locker};
use tokio::time::Instant;
use tower::limit::ConcurrencyLimit;
use tower_layer::Layer;
use tower_service::Service;

use super::{TickLayer, TickService};
use crate::tower::{LeaderLayer, Locked};

/// A tick as a scheduler hands it: its nominal fire time.
#[derive(Clone, Copy, Debug)]
struct Tick(SystemTime);

/// The runs of every instance: (instance, fire time).
type Runs = Arc<Mutex<Vec<(&'static str, SystemTime)>>>;

/// The job: records which instance ran which tick.
#[derive(Clone)]
struct Record {
    instance: &'static str,
    runs: Runs,
}

impl Service<Locked<Tick>> for Record {
    type Response = ();
    type Error = Infallible;
    type Future = Ready<Result<(), Infallible>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, tick: Locked<Tick>) -> Self::Future {
        self.runs
            .lock()
            .unwrap()
            .push((self.instance, tick.request.0));
        std::future::ready(Ok(()))
    }
}

/// One scheduler instance: its leader layer and its tick service.
struct Instance {
    leader: LeaderLayer,
    service: TickService<Record, Tick>,
}

async fn instance(url: &str, role: &str, name: &'static str, runs: &Runs) -> Instance {
    let locker = Locker::builder(crate::connect(url).await.unwrap())
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    let leader = LeaderLayer::new(Election::new(locker.clone(), role).unwrap()).unwrap();
    let layer = TickLayer::builder(&leader, locker, "every-second", |tick: &Tick| tick.0)
        .catch_up(Duration::from_secs(30))
        .retention(Duration::from_secs(120))
        .build()
        .unwrap();
    let service = layer.layer(Record {
        instance: name,
        runs: runs.clone(),
    });
    Instance { leader, service }
}

async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Two instances of a run on `redis`: `a` leads, `b` is a standby.
async fn pair(redis: &harness::redis::RedisServer, runs: &Runs) -> (Instance, Instance) {
    let role = format!("ticks-{:x}", rand::random::<u64>());
    let a = instance(&redis.url(), &role, "a", runs).await;
    until("a's election", || a.leader.is_leading()).await;
    let b = instance(&redis.url(), &role, "b", runs).await;
    (a, b)
}

/// A leader runs a tick and resigns; the standby, whose clock is behind, leads and fires
/// the same tick: it does not run it again, neither from its catch-up nor from its call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_one_leader_ran_does_not_run_again_in_the_next() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let runs = Runs::default();
    let (mut a, mut b) = pair(&redis, &runs).await;
    let fire = SystemTime::now();
    assert_eq!(a.service.call(Tick(fire)).await.unwrap(), Some(()));
    // The standby fires the tick before the hand-over too (kept to catch up)...
    assert_eq!(b.service.call(Tick(fire)).await.unwrap(), None);
    a.leader.resign().await;
    until("b's election", || b.leader.is_leading()).await;
    // ... and after it, its clock being behind.
    assert_eq!(b.service.call(Tick(fire)).await.unwrap(), None);
    let next = fire + Duration::from_secs(1);
    assert_eq!(b.service.call(Tick(next)).await.unwrap(), Some(()));
    assert_eq!(*runs.lock().unwrap(), [("a", fire), ("b", next)]);
    b.leader.resign().await;
}

/// The standby, whose clock is ahead, fires a tick the leader has not reached yet; the
/// leader resigns before its own clock gets there: the new leader runs the tick at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_runs_the_tick_it_fired_as_a_standby_that_nobody_ran() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let runs = Runs::default();
    let (a, mut b) = pair(&redis, &runs).await;
    let fire = SystemTime::now();
    assert_eq!(b.service.call(Tick(fire)).await.unwrap(), None);
    a.leader.resign().await;
    until("the caught-up tick's run", || {
        !runs.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(*runs.lock().unwrap(), [("b", fire)]);
    assert!(b.leader.is_leading());
    b.leader.resign().await;
}

/// A leader handed a tick older than the catch-up window (a scheduler that was paused)
/// does not run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_older_than_the_catch_up_window_does_not_run() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let runs = Runs::default();
    let (mut a, b) = pair(&redis, &runs).await;
    let old = SystemTime::now() - Duration::from_secs(31);
    assert_eq!(a.service.call(Tick(old)).await.unwrap(), None);
    let recent = SystemTime::now() - Duration::from_secs(29);
    assert_eq!(a.service.call(Tick(recent)).await.unwrap(), Some(()));
    assert_eq!(*runs.lock().unwrap(), [("a", recent)]);
    a.leader.resign().await;
    b.leader.resign().await;
}

/// Settings that cannot keep the promise fail with a typed error, before any claim.
#[tokio::test]
async fn bad_settings_fail_before_anything_is_sent() {
    let locker = Locker::builder(crate::connect("memory://").await.unwrap())
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    let leader = LeaderLayer::new(Election::new(locker.clone(), "settings").unwrap()).unwrap();
    let fire_time = |tick: &Tick| tick.0;
    let too_short = TickLayer::builder(&leader, locker.clone(), "s", fire_time)
        .catch_up(Duration::from_secs(60))
        .retention(Duration::from_secs(60))
        .build();
    assert!(
        matches!(too_short, Err(LockError::Config(_))),
        "{too_short:?}"
    );
    let unnamed = TickLayer::builder(&leader, locker.clone(), "", fire_time).build();
    assert!(matches!(unnamed, Err(LockError::Config(_))), "{unnamed:?}");
    let bad_key = TickLayer::builder(&leader, locker.clone(), "a\nb", fire_time).build();
    assert!(
        matches!(bad_key, Err(LockError::InvalidKey { .. })),
        "{bad_key:?}"
    );
    let finer_than_the_store = TickLayer::builder(&leader, locker, "s", fire_time)
        .catch_up(Duration::ZERO)
        .retention(Duration::from_micros(1500))
        .build();
    assert!(
        matches!(finer_than_the_store, Err(LockError::InvalidTtl { .. })),
        "{finer_than_the_store:?}"
    );
    leader.resign().await;
}

/// Made ready while it led (the inner service's only permit taken), then handed a tick
/// after it gave the role up: the tick is kept to catch up and the permit is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tick_kept_by_a_standby_holds_none_of_the_inner_capacity() {
    let redis = harness::require(harness::redis::RedisServer::start().await);
    let locker = Locker::builder(crate::connect(&redis.url()).await.unwrap())
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    let role = format!("ticks-{:x}", rand::random::<u64>());
    let leader = LeaderLayer::new(Election::new(locker.clone(), &role).unwrap()).unwrap();
    until("the election", || leader.is_leading()).await;
    let layer = TickLayer::builder(&leader, locker, "every-second", |tick: &Tick| tick.0)
        .build()
        .unwrap();
    let limited = ConcurrencyLimit::new(
        Record {
            instance: "a",
            runs: Runs::default(),
        },
        1,
    );
    let mut probe = limited.clone();
    let mut service = layer.layer(limited);
    let noop = &mut Context::from_waker(std::task::Waker::noop());
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .unwrap();
    assert!(
        probe.poll_ready(noop).is_pending(),
        "the leader's readiness holds the permit"
    );
    leader.resign().await;
    assert_eq!(service.call(Tick(SystemTime::now())).await.unwrap(), None);
    assert!(
        matches!(probe.poll_ready(noop), Poll::Ready(Ok(()))),
        "the standby kept the inner service's permit after its call"
    );
}
