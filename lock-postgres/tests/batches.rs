//! Advisory batches: a batch holding a lease of another backend instance is refused
//! before any session is asked. (An item whose session fails is reported on its own, as
//! `Unreachable`: a unit test of the advisory backend.)

mod common;

use std::time::Duration;

use common::{Kind, backend, builder, shared_server};
use distlock_core::{LockBackend, LockError, LockKey, Release};
use harness::postgres::PostgresServer;
use lock_postgres::PgAdvisoryBackend;

const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// The pid of the session holding the advisory lock of `key`.
async fn holder_pid(server: &PostgresServer, backend: &PgAdvisoryBackend, key: &LockKey) -> String {
    let bits = backend.lock_id(key) as u64;
    let pid = server
        .psql(&format!(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
               AND classid = {} AND objid = {} AND objsubid = 1",
            bits >> 32,
            bits & 0xffff_ffff
        ))
        .await
        .unwrap();
    assert!(!pid.is_empty(), "no session holds {key}");
    pid
}

/// When the session `pid` last changed state (a statement started or ended on it).
async fn state_change(server: &PostgresServer, pid: &str) -> String {
    server
        .psql(&format!(
            "SELECT state_change FROM pg_stat_activity WHERE pid = {pid}"
        ))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_release_many_with_a_foreign_lease_releases_nothing() {
    let server = shared_server().await;
    let (mine, theirs) = (
        backend(&server, Kind::Advisory).await,
        backend(&server, Kind::Advisory).await,
    );
    let (k1, k2) = (key("batch:release:mine"), key("batch:release:theirs"));
    let held = mine.acquire(&k1, TTL).await.unwrap().expect("free");
    let foreign = theirs.acquire(&k2, TTL).await.unwrap().expect("free");

    let err = mine
        .release_many(&[held.clone(), foreign.clone()])
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::ForeignLease { .. }), "{err}");

    assert_eq!(
        mine.inspect(&k1).await.unwrap().owner,
        Some(held.owner()),
        "the refused batch released the lease before the foreign one"
    );
    assert!(theirs.acquire(&k1, TTL).await.unwrap().is_none());
    assert_eq!(mine.release(&held).await.unwrap(), Release::Released);
    assert_eq!(theirs.release(&foreign).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_renew_many_with_a_foreign_lease_asks_no_session() {
    let server = shared_server().await;
    let mine = builder(&server).build_advisory_backend().unwrap();
    let theirs = backend(&server, Kind::Advisory).await;
    let (k1, k2) = (key("batch:renew:mine"), key("batch:renew:theirs"));
    let held = mine.acquire(&k1, TTL).await.unwrap().expect("free");
    let foreign = theirs.acquire(&k2, TTL).await.unwrap().expect("free");
    let pid = holder_pid(&server, &mine, &k1).await;
    let before = state_change(&server, &pid).await;

    let err = mine
        .renew_many(&[held.clone(), foreign.clone()])
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::ForeignLease { .. }), "{err}");

    assert_eq!(
        state_change(&server, &pid).await,
        before,
        "the refused batch ran a statement on the first lease's session"
    );
    assert_eq!(mine.release(&held).await.unwrap(), Release::Released);
    assert_eq!(theirs.release(&foreign).await.unwrap(), Release::Released);
}
