//! The row each lock name has in a backend's table (the lease table's row, or the advisory
//! backend's token row), and the two calls both backends make on it alone: `purge`
//! deletes it, `inspect` reads it.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockError, LockInfo, LockKey};
use sqlx::Row;
use sqlx::postgres::{PgQueryResult, PgRow};
use uuid::Uuid;

use crate::client::{PgClient, on_conn, owner_from, token_from};
use crate::error::Operation;
use crate::statement::{Statement, Value};

/// Deletes `key`'s row with `sql`, a `DELETE` whose `$1` is the name.
pub(crate) async fn purge(
    client: &PgClient,
    backend: &'static str,
    sql: &Arc<str>,
    key: &LockKey,
) -> Result<(), LockError> {
    let mut conn = client.conn(backend).await?;
    on_conn!(
        client,
        backend,
        Operation::Purge,
        conn,
        Statement::new(sql)
            .bind(Value::Text(key.as_str()))
            .send::<PgQueryResult>(client.sending(), &mut conn)
    )?;
    Ok(())
}

/// Runs `query`, which reads at most one row of a name with the columns `owner`, `token`
/// and `remaining_us` (the holder's time left, NULL when nobody holds it), as a
/// [`LockInfo`]. No row: the name was never taken (or was purged).
pub(crate) async fn inspect(
    client: &PgClient,
    backend: &'static str,
    query: Statement<'_>,
) -> Result<LockInfo, LockError> {
    let mut conn = client.conn(backend).await?;
    let row = on_conn!(
        client,
        backend,
        Operation::Inspect,
        conn,
        query.send::<Option<PgRow>>(client.sending(), &mut conn)
    )?;
    let Some(row) = row else {
        return Ok(LockInfo {
            owner: None,
            token: None,
            remaining: None,
        });
    };
    let decode = |e| crate::error::from_sqlx(backend, Operation::Inspect, &client.schema, e);
    let owner: Option<Uuid> = row.try_get("owner").map_err(decode)?;
    let token: i64 = row.try_get("token").map_err(decode)?;
    let remaining: Option<i64> = row.try_get("remaining_us").map_err(decode)?;
    Ok(LockInfo {
        // The owner only while the lock is held (time is left): the advisory token row
        // keeps its last owner after the session ended; the lease query has none by then.
        owner: remaining.and(owner).and_then(owner_from),
        token: Some(token_from(token)),
        remaining: remaining.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))),
    })
}
