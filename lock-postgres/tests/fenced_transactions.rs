//! `PgFencedResource`'s own transactions, on a pool of the application's (no session
//! limits of its own), are bounded by the server with the resource's time limit.
//!
//! - A write whose client stalls after the admission, before its `COMMIT` (a fault proxy
//!   holds its bytes), does not keep the resource's row locked: the server ends the
//!   transaction after the limit, and a newer token's write is admitted.
//! - A check waiting on the row another transaction keeps locked fails after the limit
//!   instead of waiting for as long as that transaction stays open.

mod common;

use std::time::Duration;

use common::{observer, sessions, start_server, until_no_session};
use distlock_core::{Admission, EnforcementMode, FencedResource, FencingToken, LockError};
use harness::postgres::{PASSWORD, USER};
use harness::proxy::FaultProxy;
use lock_postgres::PgFencedResource;
use lock_postgres::sqlx::PgPool;
use lock_postgres::sqlx::postgres::PgPoolOptions;
use tokio::time::Instant;

/// The resources' time limit here.
const LIMIT: Duration = Duration::from_secs(2);
/// How long past the limit a stalled transaction may still be seen, or a call take,
/// before the test calls it unbounded (scheduling on a loaded machine).
const MARGIN: Duration = Duration::from_secs(5);

/// Sessions in a transaction that waits on its client after it wrote the fence table.
const IDLE_ON_FENCES: &str = "state = 'idle in transaction' AND backend_xid IS NOT NULL \
     AND query LIKE '%distlock_fenced%'";

/// An application's pool at `url`, with none of the lease backend's session settings.
fn application_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect_lazy(url)
        .unwrap()
}

fn resource(pool: PgPool) -> PgFencedResource {
    PgFencedResource::new(pool, "distlock", EnforcementMode::Enforce)
        .unwrap()
        .time_limit(LIMIT)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_client_stalls_before_its_commit_does_not_keep_the_row_locked() {
    let server = start_server().await;
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let direct = resource(application_pool(&server.url()));
    let stalled = resource(application_pool(&format!(
        "postgres://{USER}:{PASSWORD}@{}/postgres",
        proxy.addr()
    )));
    let mut observer = observer(&server).await;
    let r = "fenced:stalled";
    assert!(
        stalled
            .write(r, FencingToken(1), b"first")
            .await
            .unwrap()
            .is_admitted()
    );

    // Each round trip through the proxy now takes 600 ms: the write's transaction waits
    // that long on the client after its admission, long enough to see it and stall the
    // client before its COMMIT leaves the proxy.
    proxy.delay(Duration::from_millis(300));
    let write = tokio::spawn(async move { stalled.write(r, FencingToken(2), b"second").await });
    let deadline = Instant::now() + MARGIN;
    while sessions(&mut observer, IDLE_ON_FENCES).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the write's transaction was never seen waiting on its client"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.blackhole();
    let stalled_at = Instant::now();

    let left = until_no_session(&mut observer, IDLE_ON_FENCES, stalled_at + LIMIT + MARGIN).await;
    assert_eq!(
        left,
        0,
        "the stalled write's transaction still holds the resource's row {:?} after its \
         client stalled",
        stalled_at.elapsed()
    );
    // The row is free: a newer holder's write is admitted, and the stalled one never
    // committed.
    let newer = tokio::time::timeout(MARGIN, direct.write(r, FencingToken(3), b"third"))
        .await
        .expect("the newer write waited on the row")
        .unwrap();
    assert_eq!(newer, Admission::Admitted);
    assert_eq!(
        direct.read(r).await.unwrap().as_deref(),
        Some(&b"third"[..])
    );
    write.abort();
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_behind_a_locked_row_fails_after_the_time_limit() {
    let server = start_server().await;
    let pool = application_pool(&server.url());
    let fenced = resource(pool.clone());
    let r = "fenced:locked";
    assert!(
        fenced
            .check_only(r, FencingToken(1))
            .await
            .unwrap()
            .is_admitted()
    );

    // The application admits a newer token in its own transaction and keeps it open.
    let mut tx = pool.begin().await.unwrap();
    assert!(
        fenced
            .admit_in(&mut tx, r, FencingToken(2))
            .await
            .unwrap()
            .is_admitted()
    );

    let started = Instant::now();
    let checked = tokio::time::timeout(LIMIT + MARGIN, fenced.check_only(r, FencingToken(3)))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the check still waits on the locked row {:?} after it was sent",
                started.elapsed()
            )
        });
    assert!(
        matches!(
            checked,
            Err(LockError::Unavailable { .. } | LockError::Backend { .. })
        ),
        "{checked:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        fenced.check_only(r, FencingToken(3)).await.unwrap(),
        Admission::Admitted
    );
}
