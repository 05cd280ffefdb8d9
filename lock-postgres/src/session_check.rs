//! The check both backends run, once before their first call, that client connections
//! keep their server sessions when the settings say they do ([`PgPooling::Session`]).
//!
//! [`PgPooling::Session`]: crate::pooling::PgPooling::Session

use distlock_core::LockError;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};

use crate::client::PgClient;
use crate::error::{self, Operation};

/// The session setting the check marks a server session with.
const PROBE_SETTING: &str = "distlock.pooling_probe";

/// The first half of a backend's refusal when the pooling check found that client
/// connections do not keep their server sessions; the backend says the rest (what it needs
/// the session for, and how to connect).
const SESSIONS_SHARED: &str = "client connections do not keep their server sessions: a \
     setting one connection made was seen by another, or was gone at its own next \
     statement. A transaction-pooling proxy (PgBouncer pool_mode = transaction or \
     statement) is between client and server, ";

/// A backend's pooling check: [`sessions_shared`], run once, before its first call.
#[derive(Debug, Default)]
pub(crate) struct SessionCheck(tokio::sync::OnceCell<bool>);

impl SessionCheck {
    /// Fails with [`LockError::Config`] ([`SESSIONS_SHARED`] and then `then`, the
    /// backend's part) when client connections do not keep their server sessions. Runs
    /// the check once; a check that could not run is an error and is tried again next
    /// time.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled check concludes nothing and runs again next time.
    pub(crate) async fn require_own_sessions(
        &self,
        client: &PgClient,
        backend: &'static str,
        then: &str,
    ) -> Result<(), LockError> {
        let shared = self
            .0
            .get_or_try_init(|| sessions_shared(client, backend))
            .await?;
        if *shared {
            return Err(LockError::Config(format!("{SESSIONS_SHARED}{then}")));
        }
        Ok(())
    }
}

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
    let connect = || client.connect_direct(backend);
    let current = format!("SELECT current_setting('{PROBE_SETTING}', true)");
    let mut first = connect().await?;
    let marker = probe_read(
        client,
        backend,
        &mut first,
        // md5 of a random number and the clock, not gen_random_uuid(): the lease table
        // runs this check too, and needs no PostgreSQL 13.
        format!(
            "SELECT set_config('{PROBE_SETTING}', \
             md5(random()::text || clock_timestamp()::text), false)"
        ),
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
