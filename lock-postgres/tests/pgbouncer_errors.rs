//! PgBouncer's own errors (SQLSTATE 08P01, sent by the pooler, not the server) after a
//! client logged in: PgBouncer closes the client's connection after each. A request the
//! pooler never handed to a server (`query_wait_timeout`: every server session stayed
//! busy) changed nothing and is `Unavailable` (it was `Backend`), and the next call, on
//! the pool's one connection slot, gets a working connection.

mod common;

use std::time::Duration;

use common::start_server;
use distlock_core::{LockBackend, LockError, LockKey};
use harness::pgbouncer::{PgBouncerServer, PoolMode, SERVER_POOL_SIZE};
use lock_postgres::PgPooling;
use lock_postgres::sqlx::{self, Connection, PgConnection};

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_wait_timeout_is_unavailable_and_its_connection_is_not_reused() {
    let server = start_server().await;
    let bouncer = harness::require(
        PgBouncerServer::start_with(
            &server,
            PoolMode::Transaction,
            &[("query_wait_timeout", "1")],
        )
        .await,
    );
    // One connection, so the call after the failed one runs on it if it went back.
    let backend = common::builder_at(&bouncer.url())
        .pool_size(1)
        .request_timeout(Duration::from_secs(10))
        .pooling(PgPooling::Transaction)
        .build_lease_backend()
        .unwrap();
    backend.connect().await.unwrap();

    // Every server session PgBouncer may open is kept by a client's open transaction
    // (clients with the backend's settings, which PgBouncer accepts as it ships).
    let options = backend.pool().connect_options();
    let mut busy = Vec::new();
    for _ in 0..SERVER_POOL_SIZE {
        let mut conn = PgConnection::connect_with(&options).await.unwrap();
        sqlx::raw_sql("BEGIN; SELECT 1")
            .execute(&mut conn)
            .await
            .unwrap();
        busy.push(conn);
    }
    let k = LockKey::new("pgbouncer:wait").unwrap();
    let err = backend.acquire(&k, TTL).await.unwrap_err();
    assert!(
        matches!(&err, LockError::Unavailable { message, .. } if message.contains("query_wait_timeout")),
        "{err:?}"
    );

    for mut conn in busy {
        sqlx::raw_sql("COMMIT").execute(&mut conn).await.unwrap();
        conn.close().await.unwrap();
    }
    // A fresh connection takes the key.
    let lease = backend.acquire(&k, TTL).await.unwrap();
    assert!(lease.is_some(), "free");
}
