//! A lease-table attempt on a held name is refused without writing: it takes no
//! transaction id, writes no WAL (so no commit to flush), and does not wait for the
//! holder's row, which a renewal may have locked.

mod common;

use std::time::Duration;

use common::{builder, start_server, wal_insert_lsn};
use distlock_core::{LockBackend, LockKey};
use sqlx::Connection;

const TTL: Duration = Duration::from_secs(60);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Forty refused single attempts and a refused batch of forty write no WAL: each would
/// otherwise lock the holder's row and commit (over 5 KiB in all). The margin allows for
/// a record the server writes on its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_lease_table_attempts_write_no_wal() {
    const LOCKS: usize = 40;
    let server = start_server().await;
    let holder = builder(&server).build_lease_backend().unwrap();
    let other = builder(&server).build_lease_backend().unwrap();
    let keys: Vec<LockKey> = (0..LOCKS).map(|i| key(&format!("refused:{i}"))).collect();
    let held = holder.acquire_many(&keys, TTL).await.unwrap();
    assert!(held.iter().all(Option::is_some));
    // Every connection of the other backend opened first, so opening one writes nothing
    // during the measurement.
    other.connect().await.unwrap();

    let before = wal_insert_lsn(&server).await;
    for k in &keys {
        assert!(
            other.acquire(k, TTL).await.unwrap().is_none(),
            "{k} is held"
        );
    }
    let batch = other.acquire_many(&keys, TTL).await.unwrap();
    assert!(batch.iter().all(Option::is_none));
    let written = wal_insert_lsn(&server).await - before;
    assert!(
        written < 300,
        "{} refused attempts wrote {written} bytes of WAL",
        LOCKS + 1
    );
}

/// A renewal in flight holds the holder's row lock; an attempt on the held name is
/// refused at once instead of waiting for it (and timing out when it takes long).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_attempt_does_not_wait_for_the_holders_row() {
    let server = start_server().await;
    let holder = builder(&server).build_lease_backend().unwrap();
    let other = builder(&server)
        .request_timeout(Duration::from_secs(2))
        .build_lease_backend()
        .unwrap();
    let k = key("row-locked");
    holder.acquire(&k, TTL).await.unwrap().expect("free");

    // The row locked as an UPDATE of it would, in a transaction left open.
    let mut conn = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM distlock.distlock_leases WHERE name = $1 FOR NO KEY UPDATE")
        .bind(k.as_str())
        .execute(&mut *tx)
        .await
        .unwrap();

    let single = other.acquire(&k, TTL).await;
    let batch = other.acquire_many(std::slice::from_ref(&k), TTL).await;
    tx.rollback().await.unwrap();
    assert!(matches!(single, Ok(None)), "single attempt: {single:?}");
    assert!(
        matches!(batch.as_deref(), Ok([None])),
        "batch attempt: {batch:?}"
    );
}
