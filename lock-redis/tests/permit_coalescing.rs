//! Concurrent permit attempts on one node coalesce, as acquires do: the attempts that
//! arrive while others are in flight go as one `acquire_permit.lua` call, served in the
//! order they came; each caller still gets its own slot, and nothing it may have taken is
//! left held when it goes or its reply is lost.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::RedisFactory;
use distlock_core::{Lease, LockBackend, LockError, LockKey};
use futures::future::join_all;
use lock_redis::{RedisBackend, SENT_AT_ONCE};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(60);

fn slots(name: &str, n: usize) -> Vec<LockKey> {
    (0..n)
        .map(|i| LockKey::new(format!("{name}:permit:{i}")).unwrap())
        .collect()
}

/// The slots of a semaphore twice over: `ring[i..i + n]` asks for them from slot `i`
/// onwards, wrapping to 0, as a `Semaphore` does.
fn ring(slots: &[LockKey]) -> Vec<LockKey> {
    slots.iter().chain(slots).cloned().collect()
}

/// 64 attempts at once on a semaphore of 64 permits, attempt `i` asking from slot `i`:
/// each takes its own first slot (served in order, none takes another's), each slot key
/// holds its lease, in far fewer script calls than attempts; a 65th is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_permit_attempts_each_take_their_slot_in_fewer_script_calls() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let n = 64;
    let slots = slots("together", n);
    let ring = ring(&slots);
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
    let before = Instant::now();
    let leases: Vec<Lease> = join_all((0..n).map(|i| redis.acquire_any(&ring[i..i + n], TTL)))
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("a free slot"))
        .collect();
    let calls = f.calls("evalsha").await;
    assert!(
        calls <= 16,
        "{n} concurrent permit attempts took {calls} script calls"
    );
    for (i, lease) in leases.iter().enumerate() {
        assert_eq!(lease.key(), &slots[i], "attempt {i} from slot {i}");
        assert!(lease.valid_until() <= before + TTL);
        let info = redis.inspect(lease.key()).await.unwrap();
        assert_eq!(info.owner, Some(lease.owner()), "{}", lease.key());
        assert_eq!(info.token, Some(lease.token()));
    }
    let distinct: BTreeSet<&LockKey> = leases.iter().map(Lease::key).collect();
    assert_eq!(distinct.len(), n);
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    redis.release_many(&leases).await.unwrap();
    println!("{n} concurrent permit attempts: {calls} EVALSHA");
}

/// More attempts at once than permits, from random-looking starts: exactly N are granted,
/// on N distinct slots, and the rest refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_permit_attempts_never_take_more_than_the_permits() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let n = 16;
    let slots = slots("crowded", n);
    let ring = ring(&slots);
    let results = join_all((0..50).map(|i| {
        let start = (i * 7) % n;
        redis.acquire_any(&ring[start..start + n], TTL)
    }))
    .await;
    let leases: Vec<Lease> = results
        .into_iter()
        .filter_map(|r| r.expect("no error"))
        .collect();
    assert_eq!(leases.len(), n, "granted");
    let distinct: BTreeSet<&LockKey> = leases.iter().map(Lease::key).collect();
    assert_eq!(distinct.len(), n, "distinct slots");
    for lease in &leases {
        let info = redis.inspect(lease.key()).await.unwrap();
        assert_eq!(info.owner, Some(lease.owner()), "{}", lease.key());
    }
    redis.release_many(&leases).await.unwrap();
}

/// A backend with [`SENT_AT_ONCE`] permit attempts of its own on their way, each round
/// trip taking 400 ms: an attempt that comes now is queued.
async fn attempts_in_flight(
    slots: &[LockKey],
) -> (
    RedisFactory,
    RedisBackend,
    Vec<tokio::task::JoinHandle<Result<Option<Lease>, LockError>>>,
) {
    let f = RedisFactory::start().await;
    let (redis, in_flight) = f
        .calls_in_flight(|redis, _| {
            let slots = slots.to_vec();
            async move { redis.acquire_any(&slots, TTL).await }
        })
        .await;
    (f, redis, in_flight)
}

/// A queued permit attempt whose answer, a granted slot, was sent, and whose caller is
/// then dropped before reading it: the slot is given back, not held by nobody until its
/// TTL. Driven by hand: the caller is polled once (it queues), the caller queued after it
/// is answered (by the same call, after it), then the first is dropped unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_permit_attempt_dropped_with_its_answer_unread_leaves_no_slot_held() {
    let slots = slots("unread", 8);
    let (f, redis, in_flight) = attempts_in_flight(&slots).await;
    let mut dropped = Box::pin(redis.acquire_any(&slots, TTL));
    assert!(futures::poll!(dropped.as_mut()).is_pending(), "queued");
    let after = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("a free slot");
    // Served in order: the dropped caller's slot is the one before `after`'s.
    assert_eq!(after.key(), &slots[SENT_AT_ONCE + 1]);
    let unread = &slots[SENT_AT_ONCE];
    assert!(
        redis.inspect(unread).await.unwrap().owner.is_some(),
        "the call granted the first caller a slot, and sent it its lease"
    );
    drop(dropped);
    f.proxy.delay(Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis.inspect(unread).await.unwrap().owner.is_some() {
        assert!(
            Instant::now() < deadline,
            "the unread slot is still held 10 s on (its TTL is 60 s)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for call in in_flight {
        assert!(call.await.unwrap().unwrap().is_some());
    }
}

/// Permit attempts whose replies are lost (each way slower than half the 300 ms request
/// timeout: they run, their replies come too late), alone and coalesced: every caller is
/// told the outcome is unknown, and every slot they took is given back, found by its
/// owner id, long before the slots' 30 s leases would run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_attempts_whose_replies_are_lost_give_their_slots_back() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let ttl = Duration::from_secs(30);
    let slots = slots("lost", 12);
    f.proxy.delay(Duration::from_millis(200));
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
    let results = join_all((0..10).map(|_| redis.acquire_any(&slots, ttl))).await;
    for result in &results {
        assert!(
            matches!(result, Err(LockError::OutcomeUnknown { .. })),
            "{result:?}"
        );
    }
    let attempts = f.calls("evalsha").await;
    assert!(attempts < 10, "coalesced: {attempts} script calls");
    f.proxy.delay(Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut held = 0;
        for slot in &slots {
            held += usize::from(redis.inspect(slot).await.unwrap().owner.is_some());
        }
        if held == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{held} slots still held 5 s after the lost replies (their leases are 30 s)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
