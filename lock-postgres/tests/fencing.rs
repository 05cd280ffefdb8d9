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
        fenced.check_only(r, FencingToken(5)).await.unwrap(),
        Admission::Admitted
    );
    // The same holder may write twice.
    assert_eq!(
        fenced.check_only(r, FencingToken(5)).await.unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        fenced.check_only(r, FencingToken(4)).await.unwrap(),
        Admission::Stale {
            latest: FencingToken(5)
        }
    );
    assert_eq!(
        fenced.check_only(r, FencingToken(9)).await.unwrap(),
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
    fenced.check_only(r, FencingToken(7)).await.unwrap();
    let stale = fenced.check_only(r, FencingToken(3)).await.unwrap();
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
    fenced.check_only(r, FencingToken(2)).await.unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_stores_the_value_of_an_admitted_token_only() {
    let (_server, pool) = pool().await;
    let enforce =
        PgFencedResource::new(pool.clone(), "distlock", EnforcementMode::Enforce).unwrap();
    let r = "fence:write";
    assert_eq!(enforce.read(r).await.unwrap(), None);
    let write = |token, value: &'static [u8]| enforce.write(r, FencingToken(token), value);
    assert_eq!(write(5, b"five").await.unwrap(), Admission::Admitted);
    assert_eq!(
        write(4, b"four").await.unwrap(),
        Admission::Stale {
            latest: FencingToken(5)
        }
    );
    assert_eq!(
        enforce.read(r).await.unwrap().as_deref(),
        Some(&b"five"[..])
    );
    assert_eq!(write(5, b"five again").await.unwrap(), Admission::Admitted);
    assert_eq!(
        enforce.read(r).await.unwrap().as_deref(),
        Some(&b"five again"[..])
    );

    let shadow = PgFencedResource::new(pool, "distlock", EnforcementMode::Shadow).unwrap();
    assert!(
        shadow
            .write(r, FencingToken(3), b"three")
            .await
            .unwrap()
            .was_stale()
    );
    assert_eq!(
        shadow.read(r).await.unwrap().as_deref(),
        Some(&b"three"[..])
    );
    assert_eq!(shadow.latest(r).await.unwrap(), Some(FencingToken(5)));
}

/// Many writers at once, in any order: the value left is the highest token's, since each
/// write's check and value are one transaction on a row locked until its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_leave_the_highest_tokens_value() {
    let (_server, pool) = pool().await;
    let fenced = PgFencedResource::new(pool, "distlock", EnforcementMode::Enforce).unwrap();
    let r = "fence:concurrent";
    // Lowest first, so that many are admitted and their transactions overlap.
    let writes = (1..=40u64).map(|t| {
        let fenced = fenced.clone();
        tokio::spawn(async move {
            let value = t.to_string();
            fenced
                .write(r, FencingToken(t), value.as_bytes())
                .await
                .unwrap()
        })
    });
    for write in futures::future::join_all(writes).await {
        write.unwrap();
    }
    assert_eq!(fenced.read(r).await.unwrap().as_deref(), Some(&b"40"[..]));
}

/// A schema whose `distlock_fenced` was made before values were stored gets the column
/// from `setup`, and keeps its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_adds_the_value_column_to_an_older_fenced_table() {
    let (_server, pool) = pool().await;
    let schema = "fenced_older";
    for ddl in [
        format!("CREATE SCHEMA IF NOT EXISTS {schema}"),
        format!(
            "CREATE TABLE IF NOT EXISTS {schema}.distlock_fenced \
             (resource text PRIMARY KEY, last_fencing_token bigint)"
        ),
        format!("INSERT INTO {schema}.distlock_fenced VALUES ('old', 7) ON CONFLICT DO NOTHING"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .unwrap();
    }
    let fenced = PgFencedResource::new(pool, schema, EnforcementMode::Enforce).unwrap();
    fenced.setup().await.unwrap();
    assert!(
        !fenced
            .write("old", FencingToken(6), b"six")
            .await
            .unwrap()
            .is_admitted()
    );
    assert_eq!(
        fenced
            .write("old", FencingToken(7), b"seven")
            .await
            .unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        fenced.read("old").await.unwrap().as_deref(),
        Some(&b"seven"[..])
    );
}
