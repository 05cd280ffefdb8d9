//! Whether client connections keep their server sessions: the check a backend runs to
//! find out.
//!
//! Behind a proxy that pools server sessions per transaction (PgBouncer `pool_mode =
//! transaction` or `statement`), consecutive statements of one client connection may run
//! in different server sessions, and a server session runs the statements of many client
//! connections. Whatever a session keeps between statements is then shared or lost: named
//! prepared statements, session settings, `LISTEN`, session-level advisory locks.

use distlock_core::LockError;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};

use crate::client::PgClient;
use crate::error::{self, Operation};

/// The session setting the check marks a server session with.
const PROBE_SETTING: &str = "distlock.pooling_probe";

/// Whether client connections share server sessions, checked with two connections of
/// their own, opened outside the pool. The first marks its server session with a random
/// value; the second reads the setting in its session, and the first reads it again.
/// Behind a pooler that hands server sessions out per transaction (PgBouncer `pool_mode
/// = transaction` or `statement`), the second is given the session the first just let go
/// (PgBouncer reuses the last one first), or the first gets another one: either shows.
/// Directly or through a session-mode pool, each keeps its own session. Statements carry
/// no values (the marker is made on the server) and use the simple protocol, so nothing
/// is prepared on a pooled session.
///
/// True when the pooler shares sessions; an error when the check could not run (nothing
/// is concluded then). A check that ran alongside other clients of a busy pooler may miss
/// the sharing (both connections given sessions nobody marked): it is a safety net for
/// settings that are wrong, not a way to choose them.
pub(crate) async fn sessions_shared(
    client: &PgClient,
    backend: &'static str,
) -> Result<bool, LockError> {
    let options = client.pool.connect_options();
    let connect = || async {
        match tokio::time::timeout(client.connect_timeout, PgConnection::connect_with(&options))
            .await
        {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(error::from_connect(
                backend,
                &client.schema,
                client.pool_size,
                client.connect_timeout,
                e,
            )),
            Err(_) => Err(LockError::unavailable(
                backend,
                format!("no connection within {:?}", client.connect_timeout),
            )),
        }
    };
    let current = format!("SELECT current_setting('{PROBE_SETTING}', true)");
    let mut first = connect().await?;
    let marker = probe_read(
        client,
        backend,
        &mut first,
        format!("SELECT set_config('{PROBE_SETTING}', gen_random_uuid()::text, false)"),
    )
    .await?;
    let mut second = connect().await?;
    let seen_by_second = probe_read(client, backend, &mut second, current.clone()).await?;
    let seen_by_first = probe_read(client, backend, &mut first, current).await?;
    // Closing them tells a session-mode pooler to reset their sessions.
    let _ = second.close().await;
    let _ = first.close().await;
    Ok(seen_by_second == marker || seen_by_first != marker)
}

/// One text value read by a statement without parameters (simple protocol: nothing is
/// prepared) under the request time limit.
async fn probe_read(
    client: &PgClient,
    backend: &'static str,
    conn: &mut PgConnection,
    sql: String,
) -> Result<Option<String>, LockError> {
    client
        .timed(
            backend,
            Operation::CheckPooling,
            sqlx::raw_sql(AssertSqlSafe(sql)).fetch_one(conn),
        )
        .await
        .map_err(|failed| failed.error)?
        .try_get::<Option<String>, _>(0)
        .map_err(|e| error::from_sqlx(backend, Operation::CheckPooling, &client.schema, e))
}
