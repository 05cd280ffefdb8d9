//! A release notifies only when some process waits for its key, so a release nobody waits
//! for never takes PostgreSQL's cluster-wide notify lock; an advisory release nobody waits
//! for writes nothing to the WAL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{builder, start_server, wal_insert_lsn};
use distlock_core::{LockBackend, LockKey, Locker, Release, RetryPolicy};
use harness::postgres::PostgresServer;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgListener;

const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// The release channel of `mode` in the default schema, as the backend names it.
fn channel(mode: &str) -> String {
    let digest = Sha256::digest(b"distlock");
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("distlock_{mode}_{hex}")
}

/// A plain `LISTEN` on the release channel of `mode`: hears every notification sent,
/// whether or not a waiter is registered.
async fn eavesdrop(server: &PostgresServer, mode: &str) -> PgListener {
    let mut listener = PgListener::connect(&server.url()).await.unwrap();
    listener.listen(&channel(mode)).await.unwrap();
    listener
}

/// Whether a notification naming `name` arrives within a second.
async fn heard(listener: &mut PgListener, name: &str) -> bool {
    let wait = async {
        loop {
            let n = listener.recv().await.unwrap();
            if n.payload() == name {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), wait)
        .await
        .is_ok()
}

/// The holder releases a key nobody waits for: nothing is sent. Then a waiter of another
/// instance waits for a second key: its release is sent (the eavesdropper works).
async fn only_a_waited_for_key_is_announced(
    server: &PostgresServer,
    mode: &str,
    holder: Arc<dyn LockBackend>,
    waiter: Arc<dyn LockBackend>,
) {
    let mut listener = eavesdrop(server, mode).await;
    let alone = key(&format!("{mode}:alone"));
    let lease = holder.acquire(&alone, TTL).await.unwrap().expect("free");
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert!(
        !heard(&mut listener, alone.as_str()).await,
        "a release nobody waits for was announced"
    );

    let waited = key(&format!("{mode}:waited"));
    let lease = holder.acquire(&waited, TTL).await.unwrap().expect("free");
    let locker = Locker::builder(waiter.clone())
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(10),
        })
        .build()
        .unwrap();
    let waiting = {
        let waited = waited.clone();
        tokio::spawn(async move { locker.lock(&waited).await.unwrap() })
    };
    // The waiter's listener registers the key, then wakes the waiter, which is refused
    // again and sleeps.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert!(
        heard(&mut listener, waited.as_str()).await,
        "a release of a key a waiter waits for was not announced"
    );
    let guard = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("woken, not polled")
        .unwrap();
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_release_is_announced_only_when_someone_waits_for_its_key() {
    let server = start_server().await;
    let holder = builder(&server).build_lease_backend().unwrap();
    let waiter = builder(&server).build_lease_backend().unwrap();
    only_a_waited_for_key_is_announced(&server, "lease", Arc::new(holder), Arc::new(waiter)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_release_is_announced_only_when_someone_waits_for_its_key() {
    let server = start_server().await;
    let holder = builder(&server).build_advisory_backend().unwrap();
    let waiter = builder(&server).build_advisory_backend().unwrap();
    only_a_waited_for_key_is_announced(&server, "advisory", Arc::new(holder), Arc::new(waiter))
        .await;
}

/// Forty advisory releases nobody waits for write no WAL: each would otherwise write a
/// commit record (a notify gives its transaction an id), over 1.5 KiB in all. The margin
/// allows for a record the server writes on its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_releases_nobody_waits_for_write_no_wal() {
    const LOCKS: u32 = 40;
    let server = start_server().await;
    let backend = builder(&server)
        .pool_size(LOCKS)
        .build_advisory_backend()
        .unwrap();
    let mut leases = Vec::new();
    for i in 0..LOCKS {
        let k = key(&format!("wal:{i}"));
        leases.push(backend.acquire(&k, TTL).await.unwrap().expect("free"));
    }
    let before = wal_insert_lsn(&server).await;
    for lease in &leases {
        assert_eq!(backend.release(lease).await.unwrap(), Release::Released);
    }
    let written = wal_insert_lsn(&server).await - before;
    assert!(
        written < 300,
        "{LOCKS} releases wrote {written} bytes of WAL"
    );
}
