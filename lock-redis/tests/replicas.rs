//! `replica_acks`: an acquire holds only once enough replicas have the write (`WAIT`);
//! otherwise it fails, says how many acknowledged, and leaves the key free.

mod common;

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockBackend, LockError, LockKey, Locker, Release};
use harness::{redis::RedisServer, redis::RespValue};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_holds_only_when_the_replica_acknowledges() {
    let (master, replica, redis) = replicated_with(Duration::from_secs(2), WAIT).await;

    let key = LockKey::new("replicated").unwrap();
    let lease = redis
        .acquire(&key, TTL)
        .await
        .expect("the replica acknowledged")
        .expect("free key");
    let lock_key = redis.redis_key(&key);
    // WAIT returned 1: the replica already has the lock.
    assert_eq!(
        harness::require(replica.command(&["GET", lock_key.as_str()]).await).as_text(),
        Some(format!("{}:{}", lease.owner(), lease.token()))
    );
    assert_eq!(redis.release(&lease).await.unwrap(), Release::Released);

    harness::require(replica.pause());
    let outcome = redis.acquire(&key, TTL).await;
    harness::require(replica.resume());
    let err = outcome.expect_err("a paused replica cannot acknowledge");
    assert!(
        matches!(&err, LockError::Unavailable { message, .. }
            if message.contains("only 0 of 1 replicas acknowledged")),
        "{err:?}"
    );
    // The lock the acquire took was released.
    assert_eq!(
        harness::require(master.command(&["EXISTS", lock_key.as_str()]).await),
        RespValue::Integer(0)
    );

    // With the replica back, the key can be taken again.
    let again = redis
        .acquire(&key, TTL)
        .await
        .expect("the replica is back")
        .expect("the failed acquire left the key free");
    assert!(again.token() > lease.token());
}

#[tokio::test]
async fn a_wait_as_long_as_the_response_timeout_is_a_config_error() {
    let err = RedisBackend::builder()
        .url("redis://127.0.0.1:1/")
        .request_timeout(Duration::from_millis(500))
        .replica_acks(1, Duration::from_millis(500))
        .build()
        .await
        .expect_err("WAIT would outlive the response timeout");
    assert!(matches!(err, LockError::Config(_)), "{err:?}");
}

/// A master with one replica, and a client that needs the replica's acknowledgement
/// (`WAIT` of up to 1 s) within a 3 s response timeout.
async fn replicated() -> (RedisServer, RedisServer, RedisBackend) {
    replicated_with(Duration::from_secs(3), Duration::from_secs(1)).await
}

/// A master with one replica, and a client that needs the replica's acknowledgement
/// (`WAIT` of up to `wait`) within `response_timeout`.
async fn replicated_with(
    response_timeout: Duration,
    wait: Duration,
) -> (RedisServer, RedisServer, RedisBackend) {
    let (master, replica) = common::master_and_replica().await;
    let redis = RedisBackend::builder()
        .url(master.url())
        .request_timeout(response_timeout)
        .replica_acks(1, wait)
        .build()
        .await
        .expect("connect");
    // Each slot of a semaphore is asked on its own (each grant waits for its replicas):
    // no index, so a semaphore spreads its first slot asked.
    assert!(!redis.capabilities().permit_index);
    (master, replica, redis)
}

async fn exists(server: &RedisServer, key: &str) -> bool {
    harness::require(server.command(&["EXISTS", key]).await) == RespValue::Integer(1)
}

/// Waits (far less than the 60 s TTL) until none of `keys` is held on `server`.
async fn until_freed(server: &RedisServer, keys: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for key in keys {
        while exists(server, key).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{key} is still held by a call whose caller left"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

const LONG_TTL: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_while_waiting_for_replicas_gives_its_key_back() {
    let (master, replica, redis) = replicated().await;
    let key = LockKey::new("dropped-in-wait").unwrap();
    let lock_key = redis.redis_key(&key);
    harness::require(replica.pause());

    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), redis.acquire(&key, LONG_TTL)).await;
    assert!(
        cancelled.is_err(),
        "WAIT cannot finish while the replica is paused"
    );
    assert!(
        exists(&master, &lock_key).await,
        "the script ran before WAIT"
    );
    harness::require(replica.resume());
    until_freed(&master, &[&lock_key]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_dropped_midway_gives_back_what_it_took() {
    // WAIT outlasts any pause of the test between two polls on a loaded machine, so the
    // first acquire can only end once the test lets its replica acknowledge it.
    let (master, replica, redis) =
        replicated_with(Duration::from_secs(10), Duration::from_secs(8)).await;
    let (first, second) = (
        LockKey::new("first").unwrap(),
        LockKey::new("second").unwrap(),
    );
    let (first_key, second_key) = (redis.redis_key(&first), redis.redis_key(&second));
    let keys = [first.clone(), second.clone()];
    let mut batch = Box::pin(redis.acquire_many(&keys, LONG_TTL));

    // The replica is paused, so the first acquire's WAIT cannot be answered during the
    // poll that sends it: the batch cannot go on to the second key by itself, however
    // long the machine holds up this thread after the send. (With the replica live, a
    // thread held up after its first poll found both keys granted at its next one.)
    harness::require(replica.pause());
    assert!(futures::poll!(&mut batch).is_pending());
    while !exists(&master, &first_key).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    harness::require(replica.resume());
    // The master has the replica's acknowledgement of the first lock: WAIT has answered
    // 1, and its reply waits for the next poll.
    acknowledged(&master).await;
    // The second acquire's WAIT cannot be answered: the batch stops midway.
    harness::require(replica.pause());
    while !exists(&master, &second_key).await {
        tokio::select! {
            early = &mut batch => panic!("the batch finished early: {early:?}"),
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    drop(batch);
    harness::require(replica.resume());
    until_freed(&master, &[&first_key, &second_key]).await;
}

/// Waits (at most 5 s) until `master` has its replica's acknowledgement of every write
/// it took so far: the replica's offset in the master's `INFO replication` reaches the
/// master's own, read now.
async fn acknowledged(master: &RedisServer) {
    let written = common::info_field(master, "replication", "master_repl_offset").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let info = harness::require(master.command(&["INFO", "replication"]).await)
            .as_text()
            .unwrap_or_default();
        let acked = info
            .lines()
            .filter_map(|l| l.strip_prefix("slave0:"))
            .flat_map(|l| l.split(','))
            .find_map(|f| f.strip_prefix("offset="))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if acked >= written {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica acknowledged offset {acked} of {written} after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_lock_that_could_not_be_released_is_an_unknown_outcome() {
    let (master, replica, redis) = replicated().await;
    let key = LockKey::new("stuck").unwrap();
    harness::require(replica.pause());
    let acquire = tokio::spawn({
        let (redis, key) = (redis.clone(), key.clone());
        async move { redis.acquire(&key, LONG_TTL).await }
    });
    // While WAIT runs, scripts are forbidden: the release after it fails.
    let lock_key = redis.redis_key(&key);
    while !exists(&master, &lock_key).await {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    harness::require(
        master
            .command(&["ACL", "SETUSER", "default", "-evalsha", "-eval"])
            .await,
    );
    let outcome = acquire.await.unwrap();
    harness::require(
        master
            .command(&["ACL", "SETUSER", "default", "+evalsha", "+eval"])
            .await,
    );
    harness::require(replica.resume());
    assert!(
        matches!(&outcome, Err(LockError::OutcomeUnknown { message, .. })
            if message.contains("only 0 of 1 replicas acknowledged")
                && message.contains("releasing it failed")),
        "{outcome:?}"
    );
}

/// How many acquires with acknowledgements run at once in the test below: as many as
/// the backend has connections for them, so none waits for another's `WAIT`.
const CONCURRENT_ACKED: usize = lock_redis::ACKED_CONNECTIONS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_leases_keep_renewing_while_acquires_wait_for_a_paused_replica() {
    // WAIT gives up after 400 ms; a renewal queued behind a few of them would pass its
    // 1 s response timeout, and the 1.5 s leases would be lost.
    let (master, replica, redis) =
        replicated_with(Duration::from_secs(1), Duration::from_millis(400)).await;
    let locker = Locker::builder(Arc::new(redis.clone()))
        .ttl(Duration::from_millis(1500))
        .build()
        .unwrap();
    let held = [
        LockKey::new("held-a").unwrap(),
        LockKey::new("held-b").unwrap(),
    ];
    let mut guards = Vec::new();
    for key in &held {
        guards.push(locker.try_lock(key).await.unwrap().expect("free key"));
    }

    harness::require(replica.pause());
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    let acquirers: Vec<_> = (0..CONCURRENT_ACKED)
        .map(|worker| {
            let redis = redis.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                let mut n = 0;
                while tokio::time::Instant::now() < until {
                    let key = LockKey::new(format!("acked-{worker}-{n}")).unwrap();
                    n += 1;
                    outcomes.push((redis.redis_key(&key), redis.acquire(&key, TTL).await));
                }
                outcomes
            })
        })
        .collect();
    while tokio::time::Instant::now() < until {
        for guard in &guards {
            assert!(
                guard.is_held(),
                "{} was lost while acquires waited for the paused replica",
                guard.key()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut failed = Vec::new();
    for acquirer in acquirers {
        failed.extend(acquirer.await.unwrap());
    }
    harness::require(replica.resume());

    assert!(!failed.is_empty());
    for (lock_key, outcome) in &failed {
        assert!(
            matches!(outcome, Err(LockError::Unavailable { message, .. })
                if message.contains("only 0 of 1 replicas acknowledged")),
            "{lock_key}: {outcome:?}"
        );
        assert!(!exists(&master, lock_key).await, "{lock_key} is still held");
    }
    for guard in guards {
        assert!(guard.is_held());
        assert_eq!(guard.release().await.unwrap(), Release::Released);
    }
}
