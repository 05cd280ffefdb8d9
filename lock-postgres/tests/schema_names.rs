//! A schema named with a reserved word (`user`, `select`, `order`) works like any other:
//! setup, both backends, the fenced resource and idempotency keys.

mod common;

use std::time::Duration;

use common::{builder, shared_server};
use distlock_core::{
    Admission, EnforcementMode, Fence, FencedResource, LockBackend, LockKey, Release, Renewal,
};
use lock_postgres::{Idempotency, IdempotencyKeys, PgFencedResource};

const TTL: Duration = Duration::from_secs(30);

async fn locks_work(backend: &dyn LockBackend, schema: &str) {
    let k = LockKey::new("reserved:schema").unwrap();
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free");
    assert!(
        backend.acquire(&k, TTL).await.unwrap().is_none(),
        "{schema}"
    );
    assert!(matches!(
        backend.renew(&lease).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(backend.fence(&lease).await.unwrap(), Fence::Current);
    let info = backend.inspect(&k).await.unwrap();
    assert_eq!(
        (info.owner, info.token),
        (Some(lease.owner()), Some(lease.token()))
    );
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
    backend.purge(&k).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_word_is_a_working_schema_name() {
    let server = shared_server().await;
    for schema in ["user", "select", "order"] {
        let settings = builder(&server).schema(schema);
        let lease_backend = settings.build_lease_backend().unwrap();
        lease_backend.setup().await.unwrap();
        lease_backend.connect().await.unwrap();
        let advisory = settings.build_advisory_backend().unwrap();
        advisory.connect().await.unwrap();
        locks_work(&lease_backend, schema).await;
        locks_work(&advisory, schema).await;

        let pool = lease_backend.pool().clone();
        let fenced = PgFencedResource::new(pool.clone(), schema, EnforcementMode::Enforce).unwrap();
        let keys = IdempotencyKeys::new(schema).unwrap();
        let lease = lease_backend
            .acquire(&LockKey::new("reserved:fenced").unwrap(), TTL)
            .await
            .unwrap()
            .expect("free");
        let mut tx = pool.begin().await.unwrap();
        assert_eq!(
            fenced
                .admit_in(&mut tx, "payout:1", lease.token())
                .await
                .unwrap(),
            Admission::Admitted
        );
        assert_eq!(
            keys.record(&mut tx, "payment:1").await.unwrap(),
            Idempotency::Applied
        );
        tx.commit().await.unwrap();
        assert_eq!(
            fenced.latest("payout:1").await.unwrap(),
            Some(lease.token())
        );
        assert_eq!(
            fenced.check_only("payout:1", lease.token()).await.unwrap(),
            Admission::Admitted
        );
        assert_eq!(
            lease_backend.release(&lease).await.unwrap(),
            Release::Released
        );

        let tables = server
            .psql(&format!(
                "SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}'"
            ))
            .await
            .unwrap();
        assert_eq!(tables, "4", "setup made the tables in schema {schema}");
    }
}
