//! Faults on a real PostgreSQL: a holder's session killed server-side, a server restart,
//! and a lease-table holder paused past its TTL. Each test starts its own server, because
//! each one kills sessions or the server itself.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Kind, backend, start_server};
use distlock_core::{
    Admission, EnforcementMode, Fence, FencedResource, LockBackend, LockKey, Locker, Release,
    Renewal,
};
use harness::postgres::PostgresServer;
use lock_postgres::PgFencedResource;

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Terminates every session that holds an advisory lock; exactly one must.
async fn terminate_the_advisory_holder(server: &PostgresServer) {
    let killed = server
        .psql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks \
             WHERE locktype = 'advisory' AND granted",
        )
        .await
        .unwrap();
    assert_eq!(killed, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_holder_whose_session_is_terminated_is_told_and_replaced_with_a_higher_token() {
    let server = start_server().await;
    let holder = backend(&server, Kind::Advisory).await;
    let other = backend(&server, Kind::Advisory).await;
    let locker = Locker::builder(holder.clone())
        .ttl(Duration::from_secs(3))
        .build()
        .unwrap();
    let k = key("payout:terminated");
    let guard = locker.try_lock(&k).await.unwrap().expect("a free key");
    assert!(
        other
            .acquire(&k, Duration::from_secs(3))
            .await
            .unwrap()
            .is_none()
    );

    // Kill every session that holds an advisory lock: only the holder's does.
    terminate_the_advisory_holder(&server).await;

    // The watchdog's next renewal finds the session gone: the guard reports the loss
    // well before its TTL would have run out.
    tokio::time::timeout(Duration::from_secs(3), guard.lost())
        .await
        .expect("the guard reports the lost lease");
    assert!(!guard.is_held());
    let next = other
        .acquire(&k, Duration::from_secs(3))
        .await
        .unwrap()
        .expect("the key is free once the holder's session died");
    assert!(
        next.token() > guard.token(),
        "{} > {}",
        next.token(),
        guard.token()
    );
    assert_eq!(guard.release().await.unwrap(), Release::NotHeld);
    // The new holder was untouched by the old guard's release.
    assert!(matches!(
        other.renew(&next).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(other.release(&next).await.unwrap(), Release::Released);
}

async fn tokens_grow_across_a_restart(kind: Kind) {
    let server = start_server().await;
    let k = key("payout:restart");
    let ttl = Duration::from_secs(2);
    let before = {
        let b = backend(&server, kind).await;
        let lease = b.acquire(&k, ttl).await.unwrap().expect("free");
        let again = {
            assert_eq!(b.release(&lease).await.unwrap(), Release::Released);
            b.acquire(&k, ttl)
                .await
                .unwrap()
                .expect("free after release")
        };
        assert!(again.token() > lease.token());
        again.token()
    };
    server.kill().unwrap();
    server.restart().await.unwrap();

    let b = backend(&server, kind).await;
    // A lease-table holder's row outlives the restart; wait for its TTL to run out.
    let deadline = tokio::time::Instant::now() + ttl * 3;
    let after = loop {
        if let Some(lease) = b.acquire(&k, ttl).await.unwrap() {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the key never freed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(after.token() > before, "{} > {before}", after.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_tokens_after_a_server_restart_are_higher() {
    tokens_grow_across_a_restart(Kind::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_tokens_after_a_server_restart_are_higher() {
    tokens_grow_across_a_restart(Kind::Advisory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_holder_paused_past_its_ttl_is_fenced() {
    let server = start_server().await;
    let paused = backend(&server, Kind::Lease).await;
    let fresh = backend(&server, Kind::Lease).await;
    let fenced = PgFencedResource::new(
        common::builder(&server)
            .build_lease_backend()
            .unwrap()
            .pool()
            .clone(),
        "distlock",
        EnforcementMode::Enforce,
    )
    .unwrap();
    let k = key("payout:paused");
    let ttl = Duration::from_millis(300);

    let old = paused.acquire(&k, ttl).await.unwrap().expect("free");
    assert_eq!(
        fenced
            .check_only("payout:paused", old.token())
            .await
            .unwrap(),
        Admission::Admitted
    );
    // The holder stalls past its TTL without renewing (a GC pause, a frozen VM).
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let new = fresh
        .acquire(&k, ttl)
        .await
        .unwrap()
        .expect("expired, so free");
    assert!(new.token() > old.token());
    assert_eq!(
        fenced
            .check_only("payout:paused", new.token())
            .await
            .unwrap(),
        Admission::Admitted
    );

    // The paused holder wakes up: its renewal is refused, its fence is stale, and its
    // late write is rejected downstream.
    assert_eq!(paused.renew(&old).await.unwrap(), Renewal::Lost);
    assert_eq!(
        paused.fence(&old).await.unwrap(),
        Fence::Stale {
            current: new.token()
        }
    );
    assert_eq!(
        fenced
            .check_only("payout:paused", old.token())
            .await
            .unwrap(),
        Admission::Stale {
            latest: new.token()
        }
    );
    assert_eq!(paused.release(&old).await.unwrap(), Release::NotHeld);
    assert_eq!(fresh.fence(&new).await.unwrap(), Fence::Current);
    let _: Arc<dyn LockBackend> = fresh;
}

/// A killed session ends the lock at once, but the guard hears of it only at its next
/// renewal (the driver sees an idle connection's death no sooner): with a 30 s TTL and a
/// renewal every second, the guard reports the loss within a few seconds, long before the
/// default renewal at TTL / 3 (10 s) would have looked, and while it says held the key is
/// already another holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_killed_session_reaches_the_guard_at_the_next_renewal_of_a_short_interval() {
    let server = start_server().await;
    let holder = backend(&server, Kind::Advisory).await;
    let other = backend(&server, Kind::Advisory).await;
    let ttl = Duration::from_secs(30);
    let locker = Locker::builder(holder)
        .ttl(ttl)
        .renew_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let k = key("payout:killed-early");
    let guard = locker.try_lock(&k).await.unwrap().expect("a free key");
    terminate_the_advisory_holder(&server).await;
    let killed_at = tokio::time::Instant::now();
    // The server already freed the key: another client takes it with a higher token.
    let next = loop {
        if let Some(lease) = other.acquire(&k, ttl).await.unwrap() {
            break lease;
        }
        assert!(killed_at.elapsed() < Duration::from_secs(5), "never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(next.token() > guard.token());
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the next renewal reports the killed session");
    assert!(!guard.is_held());
    assert_eq!(other.release(&next).await.unwrap(), Release::Released);
}
