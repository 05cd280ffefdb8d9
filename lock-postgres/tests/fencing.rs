//! SQL fencing and idempotency keys on a real PostgreSQL.

mod common;

use common::shared_server;
use distlock_core::{Admission, EnforcementMode, FencedResource, FencingToken, LockError};
use lock_postgres::{Idempotency, IdempotencyKeys, PgFencedResource};
use sqlx::PgPool;

async fn pool() -> (std::sync::Arc<harness::postgres::PostgresServer>, PgPool) {
    let server = shared_server().await;
    let pool = common::builder(&server)
        .build_lease_backend()
        .unwrap()
        .pool()
        .clone();
    (server, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_admits_equal_and_higher_tokens_and_rejects_lower_ones() {
    let (_server, pool) = pool().await;
    let fenced = PgFencedResource::new(pool, "distlock", EnforcementMode::Enforce).unwrap();
    let r = "fence:enforce";
    assert_eq!(
        fenced.admit(r, FencingToken(5)).await.unwrap(),
        Admission::Admitted
    );
    // The same holder may write twice.
    assert_eq!(
        fenced.admit(r, FencingToken(5)).await.unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        fenced.admit(r, FencingToken(4)).await.unwrap(),
        Admission::Stale {
            latest: FencingToken(5)
        }
    );
    assert_eq!(
        fenced.admit(r, FencingToken(9)).await.unwrap(),
        Admission::Admitted
    );
    assert_eq!(fenced.latest(r).await.unwrap(), Some(FencingToken(9)));
    assert_eq!(fenced.latest("fence:unused").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_lets_a_stale_write_through_without_lowering_the_token() {
    let (_server, pool) = pool().await;
    let fenced = PgFencedResource::new(pool, "distlock", EnforcementMode::Shadow).unwrap();
    let r = "fence:shadow";
    fenced.admit(r, FencingToken(7)).await.unwrap();
    let stale = fenced.admit(r, FencingToken(3)).await.unwrap();
    assert_eq!(
        stale,
        Admission::ShadowStale {
            latest: FencingToken(7)
        }
    );
    assert!(stale.is_admitted() && stale.was_stale());
    assert_eq!(fenced.latest(r).await.unwrap(), Some(FencingToken(7)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_rolled_back_with_its_transaction_is_not_recorded() {
    let (_server, pool) = pool().await;
    let fenced = PgFencedResource::new(pool.clone(), "distlock", EnforcementMode::Enforce).unwrap();
    let r = "fence:rollback";
    fenced.admit(r, FencingToken(2)).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        fenced.admit_in(&mut tx, r, FencingToken(8)).await.unwrap(),
        Admission::Admitted
    );
    tx.rollback().await.unwrap();
    assert_eq!(fenced.latest(r).await.unwrap(), Some(FencingToken(2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_applies_once_and_only_when_committed() {
    let (_server, pool) = pool().await;
    let keys = IdempotencyKeys::new("distlock").unwrap();
    let key = "payment:idem-1";
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        keys.record(&mut tx, key).await.unwrap(),
        Idempotency::Applied
    );
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        keys.record(&mut tx, key).await.unwrap(),
        Idempotency::Applied
    );
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        keys.record(&mut tx, key).await.unwrap(),
        Idempotency::AlreadyApplied
    );
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert!(matches!(
        keys.record(&mut tx, "").await,
        Err(LockError::InvalidKey { .. })
    ));
}
