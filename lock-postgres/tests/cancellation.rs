//! A cancelled advisory acquire never leaves its lock on a pooled session: whatever point
//! the caller's future is dropped at, the key is free again at once (not one TTL later)
//! and another backend instance can take it.

mod common;

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use common::{Kind, backend, builder_at, shared_server};
use distlock_core::{LockBackend, LockKey, Release};
use harness::postgres::{PASSWORD, PostgresServer, USER};
use harness::proxy::FaultProxy;
use tokio::time::Instant;

/// Long enough that a lock left on a pooled session stays for the whole test: the
/// session's idle timeout (the TTL) never frees it here.
const TTL: Duration = Duration::from_secs(120);

/// How long a key a cancelled acquire took may take to come free: the time the server
/// needs to see the session closed, with a wide margin, and far below the TTL.
const FREED_WITHIN: Duration = Duration::from_secs(10);

/// The delay each way on the taker's link for the timed cut points: a reply then takes
/// long enough that some cut always falls after the statement ran and before its reply
/// arrived, however busy the machine.
const LINK_DELAY: Duration = Duration::from_millis(40);

/// Polls `fut` at most `polls` times, then drops it; `None` when it did not finish.
async fn poll_at_most<F: Future>(fut: F, polls: usize) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut polled = 0;
    std::future::poll_fn(|cx| {
        if polled == polls {
            return Poll::Ready(None);
        }
        polled += 1;
        fut.as_mut().poll(cx).map(Some)
    })
    .await
}

/// The pids of the sessions holding the advisory lock `lock_id`, with their state.
async fn holders(server: &PostgresServer, lock_id: i64) -> String {
    let bits = lock_id as u64;
    let (classid, objid) = (bits >> 32, bits & 0xffff_ffff);
    server
        .psql(&format!(
            "SELECT l.pid || ':' || coalesce(a.state, '?') FROM pg_locks l \
               LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                AND l.classid = {classid} AND l.objid = {objid}"
        ))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_advisory_acquire_leaves_no_lock_on_a_pooled_session() {
    let server = shared_server().await;
    // The taker reaches the server through a proxy that delays the timed cut points.
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let url = format!("postgres://{USER}:{PASSWORD}@{}/postgres", proxy.addr());
    let taker = builder_at(&url).build_advisory_backend().unwrap();
    taker.connect().await.unwrap();
    let other = backend(&server, Kind::Advisory).await;
    let k = LockKey::new("cancel:acquire").unwrap();
    let lock_id = taker.lock_id(&k);

    // Dropped after 1, 2, ... polls, then (over the delayed link) every 10 ms up to a
    // dozen one-way delays: before the statement is sent, while it runs, and after it
    // ran with its reply on the way.
    let points = (1..=12)
        .map(|polls| (Some(polls), Duration::ZERO))
        .chain((0..=48).map(|i| (None, LINK_DELAY * i / 4)));
    let mut took_the_lock_then_cancelled = 0;
    for (polls, after) in points {
        let token_before = other.inspect(&k).await.unwrap().token;
        let outcome = match polls {
            Some(polls) => poll_at_most(taker.acquire(&k, TTL), polls).await,
            None => {
                proxy.delay(LINK_DELAY);
                let outcome = tokio::time::timeout(after, taker.acquire(&k, TTL))
                    .await
                    .ok();
                proxy.heal();
                outcome
            }
        };
        match outcome {
            Some(lease) => {
                let lease = lease.unwrap().expect("the key is free");
                assert_eq!(taker.release(&lease).await.unwrap(), Release::Released);
            }
            None => {
                let deadline = Instant::now() + FREED_WITHIN;
                loop {
                    let held_by = holders(&server, lock_id).await;
                    if held_by.is_empty() {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "acquire dropped at {polls:?} polls / {after:?}: session(s) {held_by} \
                         still hold the lock {FREED_WITHIN:?} later"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if other.inspect(&k).await.unwrap().token > token_before {
                    took_the_lock_then_cancelled += 1;
                }
            }
        }
        let lease = other
            .acquire(&k, TTL)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("dropped at {polls:?} polls / {after:?}: key not free"));
        assert_eq!(other.release(&lease).await.unwrap(), Release::Released);
    }
    assert!(
        took_the_lock_then_cancelled > 0,
        "no acquire was dropped after its statement had run, so nothing was tested"
    );
}
