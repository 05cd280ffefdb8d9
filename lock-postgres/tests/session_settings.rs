//! The advisory backend sets session time limits while a lock is held and, on release,
//! gives the pooled session back with the limits a DBA configured for the role or the
//! database, not with the limits turned off.

mod common;

use std::time::Duration;

use common::{builder, start_server};
use distlock_core::{LockBackend, LockKey, Release};
use tokio::time::Instant;

/// The role's own idle-session limit, much shorter than the lock's TTL.
const ROLE_IDLE_TIMEOUT: &str = "1s";
const TTL: Duration = Duration::from_secs(120);
/// How long the released, idle session may live on: the role's limit with a wide margin.
const ENDED_WITHIN: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_default_idle_session_timeout_survives_an_advisory_acquire_and_release() {
    // A server of its own: the role setting would end other tests' idle sessions.
    let server = start_server().await;
    server
        .psql(&format!(
            "ALTER ROLE distlock SET idle_session_timeout = '{ROLE_IDLE_TIMEOUT}'"
        ))
        .await
        .unwrap();
    // One lock slot, so the lock and the release run on one pooled session.
    let advisory = builder(&server)
        .pool_size(1)
        .build_advisory_backend()
        .unwrap();
    let k = LockKey::new("settings:idle").unwrap();

    let lease = advisory.acquire(&k, TTL).await.unwrap().expect("free");
    let pid = server
        .psql("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted")
        .await
        .unwrap();
    assert!(!pid.is_empty(), "the holder's session holds the lock");
    assert_eq!(advisory.release(&lease).await.unwrap(), Release::Released);

    // Back in the pool, idle: the role's one-second limit applies again and the server
    // ends the session. With the limit left at 0 (off) it would idle on forever.
    let deadline = Instant::now() + ENDED_WITHIN;
    loop {
        let alive = server
            .psql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
            ))
            .await
            .unwrap();
        if alive == "0" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "session {pid} still idles {ENDED_WITHIN:?} after release: the role's \
             idle_session_timeout of {ROLE_IDLE_TIMEOUT} was not restored"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The pool replaces the ended session, and the key can be taken again.
    let again = advisory.acquire(&k, TTL).await.unwrap().expect("free");
    assert_eq!(advisory.release(&again).await.unwrap(), Release::Released);
}
