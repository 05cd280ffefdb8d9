//! `PgFencedResource` and `IdempotencyKeys` on the lease backend's shared pool through a
//! default PgBouncer in `pool_mode = transaction`, where consecutive transactions of one
//! client connection run in different server sessions and a server session serves many
//! client connections: every admission, write, read and recorded key acts on what it
//! names, from more clients at once than the pooler has server sessions.

mod common;

use std::sync::Arc;

use common::start_server;
use distlock_core::{Admission, EnforcementMode, FencedResource, FencingToken};
use harness::pgbouncer::{PgBouncerServer, PoolMode, SERVER_POOL_SIZE};
use lock_postgres::{Idempotency, IdempotencyKeys, PgFencedResource, PgPooling};

/// More clients than the pooler has server sessions, so they share them.
const TASKS: usize = 4 * SERVER_POOL_SIZE as usize;
const ROUNDS: u64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_and_idempotency_keys_work_through_transaction_pooling() {
    let server = start_server().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Transaction).await);
    let backend = common::builder_at(&bouncer.url())
        .pool_size(TASKS as u32)
        .pooling(PgPooling::Transaction)
        .build_lease_backend()
        .unwrap();
    let pool = backend.pool().clone();
    let fenced = Arc::new(
        PgFencedResource::new(pool.clone(), "distlock", EnforcementMode::Enforce).unwrap(),
    );
    let keys = Arc::new(IdempotencyKeys::new("distlock").unwrap());

    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (fenced, keys, pool) = (fenced.clone(), keys.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            let resource = format!("fenced:{t}");
            // Clients start each round with different statements, so the statement a
            // client connection prepared first is not the one the next prepared first.
            let (mut previous, mut previous_value) = (None, None);
            for round in 0..ROUNDS {
                let token = FencingToken(1 + round * 10 + t as u64);
                let value = format!("{t}:{round}").into_bytes();
                if (round + t as u64) % 2 == 0 {
                    assert_eq!(fenced.latest(&resource).await.unwrap(), previous);
                } else {
                    assert_eq!(fenced.read(&resource).await.unwrap(), previous_value);
                }
                assert_eq!(
                    fenced.write(&resource, token, &value).await.unwrap(),
                    Admission::Admitted,
                    "client {t}, round {round}"
                );
                assert_eq!(fenced.read(&resource).await.unwrap(), Some(value.clone()));
                assert_eq!(fenced.latest(&resource).await.unwrap(), Some(token));
                assert_eq!(
                    fenced
                        .check_only(&resource, FencingToken(token.get() - 1))
                        .await
                        .unwrap(),
                    Admission::Stale { latest: token },
                    "client {t}, round {round}"
                );
                let key = format!("payment:{t}:{round}");
                for expected in [Idempotency::Applied, Idempotency::AlreadyApplied] {
                    let mut tx = pool.begin().await.unwrap();
                    assert_eq!(keys.record(&mut tx, &key).await.unwrap(), expected, "{key}");
                    tx.commit().await.unwrap();
                }
                (previous, previous_value) = (Some(token), Some(value));
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}
