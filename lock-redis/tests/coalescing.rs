//! Concurrent single calls on one node coalesce into multi-key script calls: every caller
//! still gets its own, correct result, and the server sees fewer script calls.

mod common;

use std::time::Duration;

use common::RedisFactory;
use distlock_core::{Lease, LockBackend, LockError, LockKey, Release};
use futures::future::join_all;
use lock_redis::{RedisBackend, SENT_AT_ONCE};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(60);

fn keys(prefix: &str, n: usize) -> Vec<LockKey> {
    (0..n)
        .map(|i| LockKey::new(format!("{prefix}-{i}")).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_on_distinct_keys_each_hold_their_key_with_fewer_script_calls() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys = keys("distinct", 200);
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
    let before = Instant::now();
    let leases: Vec<_> = join_all(keys.iter().map(|k| redis.acquire(k, TTL)))
        .await
        .into_iter()
        .map(|r| r.unwrap().expect("every key was free"))
        .collect();
    let acquire_calls = f.calls("evalsha").await;
    assert!(
        acquire_calls < 50,
        "200 concurrent acquires took {acquire_calls} script calls"
    );
    for (key, lease) in keys.iter().zip(&leases) {
        assert_eq!(lease.key(), key, "each caller got the lease of its own key");
        // Validity counts from the caller's own call, never from later.
        assert!(lease.valid_until() <= before + TTL);
        let info = redis.inspect(key).await.unwrap();
        assert_eq!(
            info.owner,
            Some(lease.owner()),
            "{key} is held by its lease"
        );
        assert_eq!(info.token, Some(lease.token()));
    }

    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
    let released = join_all(leases.iter().map(|l| redis.release(l))).await;
    assert!(
        released
            .into_iter()
            .all(|r| r.unwrap() == Release::Released)
    );
    let release_calls = f.calls("evalsha").await;
    assert!(
        release_calls < 50,
        "200 concurrent releases took {release_calls} script calls"
    );
    for key in &keys {
        assert_eq!(
            redis.inspect(key).await.unwrap().owner,
            None,
            "{key} is free"
        );
    }
    // Released again: each caller learns its own lease is no longer held.
    let again = join_all(leases.iter().map(|l| redis.release(l))).await;
    assert!(again.into_iter().all(|r| r.unwrap() == Release::NotHeld));
    println!(
        "200 concurrent acquires: {acquire_calls} EVALSHA; 200 releases: {release_calls} EVALSHA"
    );
}

/// A server whose replies take `delay` each way, its statistics reset, and one acquire
/// on its way to it: fewer than the limit in flight, so nothing queues for that.
async fn one_acquire_on_its_way(
    delay: Duration,
) -> (
    RedisFactory,
    RedisBackend,
    tokio::task::JoinHandle<Result<Option<Lease>, LockError>>,
) {
    let f = RedisFactory::start().await;
    let redis = f.redis_with(Duration::from_secs(2)).await;
    f.proxy.delay(delay);
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
    let slow = {
        let redis = redis.clone();
        tokio::spawn(async move { redis.acquire(&LockKey::new("slow").unwrap(), TTL).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    (f, redis, slow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_arrive_together_go_as_one_script_call_below_the_limit() {
    let (f, redis, slow) = one_acquire_on_its_way(Duration::from_millis(200)).await;
    // These arrive together (one task polls them all): the first leads, the others join it.
    let together = keys("together", SENT_AT_ONCE - 1);
    let leases = join_all(together.iter().map(|k| redis.acquire(k, TTL))).await;
    for (key, lease) in together.iter().zip(leases) {
        let lease = lease.unwrap().expect("a free key");
        assert_eq!(lease.key(), key);
        assert_eq!(redis.inspect(key).await.unwrap().owner, Some(lease.owner()));
    }
    assert!(slow.await.unwrap().unwrap().is_some());
    let calls = f.calls("evalsha").await;
    assert_eq!(
        calls,
        2,
        "the acquire in flight, then the {} that arrived together as one script call",
        together.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_mid_batch_leaves_the_others_answered_and_its_key_free() {
    let (f, redis, slow) = one_acquire_on_its_way(Duration::from_millis(100)).await;
    let keys = keys("led", 3);
    let mut leader = Box::pin(redis.acquire(&keys[0], TTL));
    let mut others: Vec<_> = keys[1..]
        .iter()
        .map(|k| Box::pin(redis.acquire(k, TTL)))
        .collect();
    // The leader yields, the others join it, and then it sends the batch and waits.
    assert!(futures::poll!(leader.as_mut()).is_pending());
    for other in &mut others {
        assert!(futures::poll!(other.as_mut()).is_pending());
    }
    assert!(futures::poll!(leader.as_mut()).is_pending());
    drop(leader);
    for (key, other) in keys[1..].iter().zip(others) {
        let lease = other.await.unwrap().expect("a free key");
        assert_eq!(lease.key(), key);
    }
    assert!(slow.await.unwrap().unwrap().is_some());
    // The batch ran once, after its leader had gone, and gave the leader's key back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis.inspect(&keys[0]).await.unwrap().owner.is_some() {
        assert!(
            Instant::now() < deadline,
            "the gone leader's key is still held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each grant's script also raises the high-water key once: two script calls.
    assert_eq!(
        f.calls("set").await,
        4 + 2,
        "the acquire in flight, and each key of the batch taken once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_of_one_key_have_exactly_one_winner() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let key = LockKey::new("contended").unwrap();
    let results = join_all((0..50).map(|_| redis.acquire(&key, TTL))).await;
    let winners: Vec<_> = results.into_iter().filter_map(|r| r.unwrap()).collect();
    assert_eq!(winners.len(), 1, "exactly one caller holds the lock");
    let info = redis.inspect(&key).await.unwrap();
    assert_eq!(info.owner, Some(winners[0].owner()));
    assert_eq!(info.token, Some(winners[0].token()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_concurrent_acquires_give_one_winner_per_key() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let shared = keys("shared", 10);
    let alone = keys("alone", 50);
    // Each shared key is asked for 8 times, interleaved with the keys asked for once.
    let mut asked: Vec<&LockKey> = Vec::new();
    for round in 0..8 {
        asked.extend(shared.iter());
        asked.extend(alone.iter().skip(round * 7).take(7));
    }
    assert_eq!(asked.len(), 80 + 50);
    let results = join_all(asked.iter().map(|k| redis.acquire(k, TTL))).await;
    let mut held = std::collections::HashMap::new();
    for (key, result) in asked.iter().zip(results) {
        if let Some(lease) = result.unwrap() {
            assert_eq!(lease.key(), *key);
            assert!(
                held.insert((*key).clone(), lease).is_none(),
                "{key} won twice"
            );
        }
    }
    assert_eq!(held.len(), 60, "every key has exactly one winner");
    for (key, lease) in &held {
        assert_eq!(redis.inspect(key).await.unwrap().owner, Some(lease.owner()));
    }
}

// One thread: the connection's reader cannot run while the callers are polled, so the
// first caller is in flight, the second leads (it yields, and the others join it), and
// every other one is queued when they all give up.
#[tokio::test(flavor = "current_thread")]
async fn acquires_whose_callers_left_are_given_back_in_the_background() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys = keys("dropped", 30);
    let mut answered = Vec::new();
    {
        let mut pending: Vec<_> = keys.iter().map(|k| redis.acquire(k, TTL)).collect();
        // Polled once: the first ones go out, the others join the queue; then every
        // caller gives up before any reply.
        for fut in &mut pending {
            if let std::task::Poll::Ready(result) = futures::poll!(fut.as_mut()) {
                answered.extend(result.unwrap());
            }
        }
    }
    assert!(
        answered.is_empty(),
        "a caller was answered within its first poll"
    );
    for lease in &answered {
        assert_eq!(redis.release(lease).await.unwrap(), Release::Released);
    }
    // The queued ones still ran (each took its key with a `SET` in the script), and
    // nothing stays held anywhere near the 60 s TTL (the ones sent directly may or may not
    // have run).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut held = 0;
        for key in &keys {
            held += usize::from(redis.inspect(key).await.unwrap().owner.is_some());
        }
        let ran = usize::try_from(f.calls("set").await).unwrap();
        if held == 0 && ran >= keys.len() - SENT_AT_ONCE {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{held} locks of gone callers still held, {ran} of {} acquires ran",
            keys.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The keys are free for everyone else.
    for key in &keys {
        assert!(redis.acquire(key, TTL).await.unwrap().is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_fails_every_caller_of_the_batch_with_an_unknown_outcome() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let keys = keys("cut", 20);
    let ttl = Duration::from_secs(2);
    f.proxy.blackhole();
    let results = join_all(keys.iter().map(|k| redis.acquire(k, ttl))).await;
    for result in results {
        assert!(
            matches!(result, Err(LockError::OutcomeUnknown { .. })),
            "{result:?}"
        );
    }
    f.proxy.heal();
    // Whatever the lost batch took frees itself (cleanup in the background, or the TTL).
    let deadline = Instant::now() + Duration::from_secs(15);
    for key in &keys {
        loop {
            if let Ok(Some(_)) = redis.acquire(key, ttl).await {
                break;
            }
            assert!(Instant::now() < deadline, "{key} was never freed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Three queued acquires go as one script call: a fresh key, a key holding a hash, another
/// fresh key. The script stops with an error at the hash, after it took the first key;
/// every caller of the call gets the error, and the first key, whose lease nobody got, is
/// given back at once, not held until its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_call_stopped_part_way_gives_back_what_it_took() {
    let (f, redis, in_flight) = calls_in_flight_filled().await;
    harness::require(
        f.server
            .command(&["HSET", "distlock:{stopped-hash}", "field", "value"])
            .await,
    );
    let keys: Vec<LockKey> = ["stopped-first", "stopped-hash", "stopped-last"]
        .into_iter()
        .map(|name| LockKey::new(name).unwrap())
        .collect();
    let mut queued = Vec::new();
    for key in keys.clone() {
        let redis = redis.clone();
        queued.push(tokio::spawn(async move { redis.acquire(&key, TTL).await }));
        // Apart, so that they queue in this order.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for result in join_all(queued).await {
        let result = result.unwrap();
        assert!(
            matches!(result, Err(LockError::Backend { .. })),
            "one call for the three, stopped by the hash: {result:?}"
        );
    }
    freed(&redis, &keys[0], "the key the stopped call took").await;
    assert!(redis.inspect(&keys[2]).await.unwrap().owner.is_none());
    for lease in join_all(in_flight).await {
        let lease = lease.unwrap().unwrap().unwrap();
        redis.release(&lease).await.unwrap();
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Call {
    Acquire,
    Release,
}

/// An acquire of a fresh key, or a release of `lease`: `Ok(true)` when it took or freed it.
async fn call(
    redis: &RedisBackend,
    kind: Call,
    name: &str,
    lease: &Lease,
) -> Result<bool, LockError> {
    match kind {
        Call::Acquire => redis
            .acquire(&LockKey::new(name).unwrap(), TTL)
            .await
            .map(|l| l.is_some()),
        Call::Release => redis.release(lease).await.map(|r| r == Release::Released),
    }
}

/// The calls in flight belong to a runtime that shuts down, with a caller of another
/// runtime queued behind them: that caller is served, and the queue does not stay busy.
async fn a_runtime_shutting_down_mid_call_leaves_the_queue_working(kind: Call) {
    let f = RedisFactory::start().await;
    let redis = f.redis_with(Duration::from_secs(2)).await;
    let mut held = Vec::new();
    for key in keys("held", SENT_AT_ONCE + 2) {
        held.push(redis.acquire(&key, TTL).await.unwrap().expect("free key"));
    }
    f.proxy.delay(Duration::from_millis(200));
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    for (i, lease) in held.iter().take(SENT_AT_ONCE).enumerate() {
        let (first, lease) = (redis.clone(), lease.clone());
        other.spawn(async move { call(&first, kind, &format!("first-{i}"), &lease).await });
        // Apart, so that each is sent on its own (calls that arrive together go together)
        // and they fill the calls in flight.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The other runtime's calls are on their way (a round trip takes 400 ms); this one
    // queues.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (second, lease) = (redis.clone(), held[SENT_AT_ONCE].clone());
    let queued = tokio::spawn(async move { call(&second, kind, "queued", &lease).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    other.shutdown_background();

    let queued = tokio::time::timeout(Duration::from_secs(30), queued)
        .await
        .expect("the queued caller was answered")
        .unwrap();
    // Its batch runs on its own runtime, not on the one shutting down.
    assert!(
        matches!(queued, Ok(true)),
        "the queued caller got {queued:?}"
    );
    // Later calls of this runtime go through.
    f.proxy.heal();
    let later = tokio::time::timeout(
        Duration::from_secs(30),
        call(&redis, kind, "later", &held[SENT_AT_ONCE + 1]),
    )
    .await
    .expect("a later call was wedged behind the dropped batch");
    assert!(matches!(later, Ok(true)), "{later:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_keep_working_after_the_runtime_of_the_call_in_flight_shut_down() {
    a_runtime_shutting_down_mid_call_leaves_the_queue_working(Call::Acquire).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_keep_working_after_the_runtime_of_the_call_in_flight_shut_down() {
    a_runtime_shutting_down_mid_call_leaves_the_queue_working(Call::Release).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_releases_whose_connection_dropped_are_settled_and_free_their_keys() {
    let f = RedisFactory::start().await;
    let redis = f.redis_with(Duration::from_secs(5)).await;
    let direct = keys("direct", SENT_AT_ONCE);
    let queued = keys("queued", 4);
    let mut leases = Vec::new();
    for key in direct.iter().chain(&queued) {
        leases.push(redis.acquire(key, TTL).await.unwrap().expect("free key"));
    }
    let queued_leases = leases.split_off(SENT_AT_ONCE);

    // 500 ms each way: the queued batch is sent when the direct releases' replies come
    // back, and is held in the proxy (blackholed before its delay is up) when the
    // connection drops, so it never reached the server and its outcome is knowable.
    f.proxy.delay(Duration::from_millis(500));
    let release_all = |leases: Vec<Lease>| {
        leases
            .into_iter()
            .map(|lease| {
                let redis = redis.clone();
                tokio::spawn(async move { redis.release(&lease).await })
            })
            .collect::<Vec<_>>()
    };
    // Apart, so that each is sent on its own (calls that arrive together go together) and
    // they fill the calls in flight.
    let mut in_flight = Vec::new();
    for lease in leases {
        in_flight.extend(release_all(vec![lease]));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    let waiting = release_all(queued_leases);
    for release in in_flight {
        assert_eq!(release.await.unwrap().unwrap(), Release::Released);
    }
    f.proxy.blackhole();
    f.proxy.reset();
    // The reset takes effect within a scheduler tick; the held batch goes with it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    f.proxy.heal();

    for release in waiting {
        let outcome = release.await.unwrap();
        assert!(
            matches!(outcome, Ok(Release::Released)),
            "a queued release after a dropped connection: {outcome:?}"
        );
    }
    for key in direct.iter().chain(&queued) {
        let lock_key = redis.redis_key(key);
        assert_eq!(
            harness::require(f.server.command(&["EXISTS", &lock_key]).await),
            harness::redis::RespValue::Integer(0),
            "{lock_key} is still held"
        );
    }
}

/// A backend with [`SENT_AT_ONCE`] acquires of its own on their way, each round trip
/// taking 400 ms: a caller that comes now is queued.
async fn calls_in_flight_filled() -> (
    RedisFactory,
    RedisBackend,
    Vec<tokio::task::JoinHandle<Result<Option<Lease>, LockError>>>,
) {
    let f = RedisFactory::start().await;
    let (redis, in_flight) = f
        .calls_in_flight(|redis, i| async move {
            let key = LockKey::new(format!("in-flight-{i}")).unwrap();
            redis.acquire(&key, TTL).await
        })
        .await;
    (f, redis, in_flight)
}

/// Waits (10 s at most, far below the 60 s TTL) until `key` is free.
async fn freed(redis: &RedisBackend, key: &LockKey, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis.inspect(key).await.unwrap().owner.is_some() {
        assert!(Instant::now() < deadline, "{what}: {key} is still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first caller of a batch was on a current-thread runtime and gave up before its
/// batch went (its `block_on` returned: nobody drives that runtime any more). The batch
/// still runs, for the caller queued behind it, and the gone caller's lease is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_when_a_caller_who_gave_up_was_on_a_runtime_nobody_drives() {
    let (_f, redis, in_flight) = calls_in_flight_filled().await;
    let gone = LockKey::new("gave-up").unwrap();
    let (idle, gave_up) = tokio::task::spawn_blocking({
        let (redis, gone) = (redis.clone(), gone.clone());
        move || {
            let idle = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let queued = idle.block_on(tokio::time::timeout(
                Duration::from_millis(50),
                redis.acquire(&gone, TTL),
            ));
            (idle, queued.is_err())
        }
    })
    .await
    .unwrap();
    assert!(gave_up, "the caller gave up before its batch went");

    let waiting = LockKey::new("waiting").unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(30), redis.acquire(&waiting, TTL))
        .await
        .expect("the queued caller was answered");
    assert!(
        matches!(answer, Ok(Some(ref lease)) if lease.key() == &waiting),
        "the caller queued behind the one who gave up got {answer:?}"
    );
    for call in in_flight {
        assert!(call.await.unwrap().unwrap().is_some());
    }
    freed(&redis, &gone, "the lease of the caller who gave up").await;
    tokio::task::spawn_blocking(move || drop(idle))
        .await
        .unwrap();
}

/// A queued caller whose answer, a granted lease, was sent, and who is then dropped
/// before reading it: the lease is released, not left held by nobody until its TTL.
/// Driven by hand: the caller is polled once (it queues), the caller queued after it is
/// answered (by the same batch, after it), then the first is dropped unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_caller_dropped_with_its_answer_unread_leaves_no_lease_held() {
    let (_f, redis, in_flight) = calls_in_flight_filled().await;
    let unread = LockKey::new("unread").unwrap();
    let mut dropped = Box::pin(redis.acquire(&unread, TTL));
    assert!(futures::poll!(dropped.as_mut()).is_pending(), "queued");
    let after = LockKey::new("after").unwrap();
    let lease = redis
        .acquire(&after, TTL)
        .await
        .unwrap()
        .expect("a free key");
    assert_eq!(lease.key(), &after);
    assert!(
        redis.inspect(&unread).await.unwrap().owner.is_some(),
        "the batch granted the first caller's key, and sent it its lease"
    );
    drop(dropped);
    freed(&redis, &unread, "the unread lease").await;
    for call in in_flight {
        assert!(call.await.unwrap().unwrap().is_some());
    }
}
