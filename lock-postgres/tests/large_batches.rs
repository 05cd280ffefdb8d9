//! Lease-table batches larger than what PostgreSQL's shared lock table has room for:
//! `release_many` takes a transaction-level advisory lock per released name (the
//! waiters' check, `waiters.rs`). The table of a default-configured server
//! (`max_locks_per_transaction = 64` per connection slot) is shared by every session; on
//! the test server (`max_connections = 200`) one transaction found room for 23,000 locks
//! and not 24,000 when it was alone. With another application holding 10,000 advisory
//! locks, a batch of 20,000 is still released whole, a waiter of the name it releases
//! last is woken, and nothing stays held.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{acquire_all, builder, start_server};
use distlock_core::{LockBackend, LockKey, Locker, Release, RetryPolicy};
use sqlx::Connection;
use tokio::time::Instant;

const NAMES: usize = 20_000;
/// Session-level advisory locks another application's session holds meanwhile.
const OTHER_LOCKS: usize = 10_000;
const TTL: Duration = Duration::from_secs(120);
/// The waiter sleeps this long between attempts: getting the key well within it means the
/// release announced it.
const BACKOFF: Duration = Duration::from_secs(10);
/// How long after the release returned (its last statement, the waited name among them,
/// committed by then) the waiter may take to be woken and acquire.
const WOKEN_WITHIN: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_release_many_of_20000_names_releases_them_all() {
    let server = start_server().await;
    assert_eq!(
        harness::require(server.psql("SHOW max_locks_per_transaction").await),
        "64",
        "the server's lock table is not the default size"
    );
    let mut other = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let taken: i64 = sqlx::query_scalar(
        "SELECT count(pg_advisory_lock(-i)) FROM generate_series(1, $1::bigint) AS i",
    )
    .bind(OTHER_LOCKS as i64)
    .fetch_one(&mut other)
    .await
    .unwrap();
    assert_eq!(taken, OTHER_LOCKS as i64);
    let settings = builder(&server).request_timeout(Duration::from_secs(60));
    let holder = settings.build_lease_backend().unwrap();
    holder.connect().await.unwrap();
    let waiter: Arc<dyn LockBackend> = Arc::new(settings.build_lease_backend().unwrap());

    let keys: Vec<LockKey> = (0..NAMES)
        .map(|i| LockKey::new(format!("big:{i:05}")).unwrap())
        .collect();
    let leases = acquire_all(&holder, &keys, TTL).await;

    // A waiter of another instance on the name the batch releases last.
    let last = keys.last().unwrap().clone();
    let locker = Locker::builder(waiter.clone())
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(BACKOFF * 3))
        .build()
        .unwrap();
    let waiting = tokio::spawn(async move {
        let guard = locker.lock(&last).await.unwrap();
        (Instant::now(), guard)
    });
    let watched_since = Instant::now();
    while waiter.watched_keys().is_empty() {
        assert!(
            watched_since.elapsed() < Duration::from_secs(10),
            "no watch"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its listener has registered the key and it sleeps in its backoff.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let released_at = Instant::now();
    let released = holder.release_many(&leases).await.unwrap();
    let took = released_at.elapsed();
    assert_eq!(released.len(), NAMES);
    let not_released: Vec<_> = released
        .iter()
        .zip(&keys)
        .filter(|(r, _)| **r != Release::Released)
        .collect();
    assert!(
        not_released.is_empty(),
        "{} not released, the first {:?}",
        not_released.len(),
        not_released[0]
    );
    println!("release_many of {NAMES} names took {took:?}");

    let (granted_at, guard) = waiting.await.unwrap();
    assert!(
        granted_at - released_at < took + WOKEN_WITHIN,
        "the waiter got the last name {:?} after the release began",
        granted_at - released_at
    );
    guard.release().await.unwrap();

    let held = harness::require(
        server
            .psql(
                "SELECT count(*) FROM distlock.distlock_leases \
                  WHERE name LIKE 'big:%' AND owner IS NOT NULL",
            )
            .await,
    );
    assert_eq!(held, "0", "names still have an owner");
    let advisory = harness::require(
        server
            .psql(
                "SELECT count(*) FROM pg_locks \
                  WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND objsubid = 2",
            )
            .await,
    );
    assert_eq!(advisory, "0", "release locks outlived their transactions");
    other.close().await.unwrap();
    let again = holder.acquire_many(&keys, TTL).await.unwrap();
    assert!(again.iter().all(Option::is_some), "a name is still held");
}
