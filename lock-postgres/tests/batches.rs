//! Advisory batches: a batch holding a lease of another backend instance is refused
//! before any session is asked, and an item whose session fails is reported on its own
//! (`Unreachable`) while the other items get their real outcome.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Kind, backend, builder, shared_server, start_server};
use conformance::harness::postgres::PostgresServer;
use lock_api::{Lease, LockBackend, LockError, LockKey, Release, Renewal};
use lock_postgres::PgAdvisoryBackend;
use sqlx::Connection;
use tokio::time::Instant;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_renew_many_reports_a_failing_session_as_unreachable_and_renews_the_rest() {
    // A server of its own: the test changes a role setting and locks a system view.
    let server = start_server().await;
    let advisory = Arc::new(builder(&server).build_advisory_backend().unwrap());
    let (ka, kb) = (key("batch:unreachable:a"), key("batch:unreachable:b"));
    let a = advisory.acquire(&ka, TTL).await.unwrap().expect("free");
    // Sessions opened from now on give up on a lock wait after 50 ms; `b`'s session is
    // opened now (the pool has no idle connection), `a`'s keeps waiting.
    server
        .psql("ALTER ROLE distlock SET lock_timeout = '50ms'")
        .await
        .unwrap();
    let b = advisory.acquire(&kb, TTL).await.unwrap().expect("free");
    let pid_a = holder_pid(&server, &advisory, &ka).await;
    let pid_b = holder_pid(&server, &advisory, &kb).await;
    assert_ne!(pid_a, pid_b);

    // Renewal reads pg_locks; while this transaction holds the view, `b`'s check fails
    // after its lock timeout and `a`'s waits.
    let mut blocker = sqlx::PgConnection::connect(&server.superuser_url())
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let batch = {
        let (advisory, leases): (_, Vec<Lease>) = (advisory.clone(), vec![b.clone(), a.clone()]);
        tokio::spawn(async move { advisory.renew_many(&leases).await })
    };
    // Items run in order, so once `a`'s check waits, `b`'s has failed. (A batch that
    // stops at `b`'s failure ends here too, and its error shows below.)
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting = server
            .psql(&format!(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = {pid_a}"
            ))
            .await
            .unwrap();
        if waiting == "Lock" || batch.is_finished() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the check on a's session never waited for the view"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::raw_sql("COMMIT").execute(&mut blocker).await.unwrap();

    let renewals = batch
        .await
        .unwrap()
        .expect("one failing item does not fail the batch");
    assert_eq!(renewals.len(), 2);
    assert_eq!(renewals[0], Renewal::Unreachable, "{renewals:?}");
    assert!(
        matches!(renewals[1], Renewal::Renewed { .. }),
        "{renewals:?}"
    );
    // `b` is still held: only its check failed.
    assert!(matches!(
        advisory.renew(&b).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(
        advisory.release_many(&[a, b]).await.unwrap(),
        [Release::Released; 2]
    );
}
