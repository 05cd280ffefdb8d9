//! The payout ledger of the problem statement: one payout job delivered many times to
//! many workers, some of which stall past their TTL, ends with exactly one side effect,
//! and the stale workers' writes are counted, not applied.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Kind, backend, shared_server};
use distlock_core::{Admission, EnforcementMode, Lease, LockBackend, LockKey};
use lock_postgres::{Idempotency, IdempotencyKeys, PgFencedResource};
use sqlx::PgPool;
use tokio::time::Instant;

const TTL: Duration = Duration::from_millis(300);
const PAYOUT: i64 = 42;
const RESOURCE: &str = "payout:42";

#[derive(Default)]
struct Counts {
    applied: AtomicUsize,
    duplicates: AtomicUsize,
    stale: AtomicUsize,
}

/// Takes the payout's lock, waiting (up to a generous deadline) while someone holds it.
async fn take(backend: &Arc<dyn LockBackend>) -> Lease {
    let key = LockKey::new(RESOURCE).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(lease) = backend.acquire(&key, TTL).await.unwrap() {
            return lease;
        }
        assert!(Instant::now() < deadline, "the payout lock never came free");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One delivery's side effect: in one transaction, admit the token, record the
/// idempotency key, write the ledger entry and mark the payout processed (with the guarded
/// UPDATE of the problem statement).
async fn pay(pool: &PgPool, fenced: &PgFencedResource, lease: &Lease, counts: &Counts) {
    let keys = IdempotencyKeys::new("distlock").unwrap();
    let mut tx = pool.begin().await.unwrap();
    match fenced
        .admit_in(&mut tx, RESOURCE, lease.token())
        .await
        .unwrap()
    {
        Admission::Admitted => {}
        Admission::Stale { .. } | Admission::ShadowStale { .. } => {
            counts.stale.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
    if keys.record(&mut tx, "payment:42").await.unwrap() == Idempotency::AlreadyApplied {
        counts.duplicates.fetch_add(1, Ordering::SeqCst);
        return;
    }
    sqlx::query(
        "INSERT INTO ledger (payout_id, amount_cents, fencing_token) VALUES ($1, 5000, $2)",
    )
    .bind(PAYOUT)
    .bind(i64::try_from(lease.token().get()).unwrap())
    .execute(&mut *tx)
    .await
    .unwrap();
    let updated = sqlx::query(
        "UPDATE payouts SET status = 'processed', last_fencing_token = $2 \
          WHERE id = $1 AND $2 >= COALESCE(last_fencing_token, 0)",
    )
    .bind(PAYOUT)
    .bind(i64::try_from(lease.token().get()).unwrap())
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(
        updated.rows_affected(),
        1,
        "admitted tokens pass the guarded UPDATE"
    );
    tx.commit().await.unwrap();
    counts.applied.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payout_delivered_many_times_is_paid_once_and_stale_writes_are_counted() {
    let server = shared_server().await;
    let first = backend(&server, Kind::Lease).await;
    let pool = common::builder(&server)
        .build_lease_backend()
        .unwrap()
        .pool()
        .clone();
    for ddl in [
        "CREATE TABLE payouts (id bigint PRIMARY KEY, status text NOT NULL, \
                               last_fencing_token bigint)",
        "CREATE TABLE ledger (id bigserial PRIMARY KEY, payout_id bigint NOT NULL, \
                              amount_cents bigint NOT NULL, fencing_token bigint NOT NULL)",
        "INSERT INTO payouts (id, status) VALUES (42, 'pending')",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    let fenced = Arc::new(
        PgFencedResource::new(pool.clone(), "distlock", EnforcementMode::Enforce).unwrap(),
    );
    let counts = Arc::new(Counts::default());

    // Delivery 0 takes the lock first, then stalls past its TTL before paying.
    let stalled = take(&first).await;

    // Eleven more deliveries of the same job on six workers, two of which also stall.
    let mut workers = Vec::new();
    for worker in 0..6 {
        let client = backend(&server, Kind::Lease).await;
        let (pool, fenced, counts) = (pool.clone(), fenced.clone(), counts.clone());
        workers.push(tokio::spawn(async move {
            for delivery in 0..2 {
                let lease = take(&client).await;
                if worker < 2 && delivery == 0 {
                    tokio::time::sleep(TTL * 2).await;
                }
                pay(&pool, &fenced, &lease, &counts).await;
                client.release(&lease).await.unwrap();
            }
        }));
    }
    // Delivery 0 wakes up only once a newer holder has written.
    let deadline = Instant::now() + Duration::from_secs(30);
    while fenced.latest(RESOURCE).await.unwrap() <= Some(stalled.token()) {
        assert!(Instant::now() < deadline, "no newer holder wrote");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pay(&pool, &fenced, &stalled, &counts).await;
    for w in workers {
        w.await.unwrap();
    }

    let entries: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&pool)
        .await
        .unwrap();
    let status: String = sqlx::query_scalar("SELECT status FROM payouts WHERE id = 42")
        .fetch_one(&pool)
        .await
        .unwrap();
    let applied = counts.applied.load(Ordering::SeqCst);
    let duplicates = counts.duplicates.load(Ordering::SeqCst);
    let stale = counts.stale.load(Ordering::SeqCst);
    assert_eq!(entries, 1, "exactly one ledger entry");
    assert_eq!(applied, 1);
    assert_eq!(status, "processed");
    assert!(
        stale >= 1,
        "the stalled delivery's write was counted as stale"
    );
    assert_eq!(
        applied + duplicates + stale,
        13,
        "every delivery was accounted for"
    );
}
