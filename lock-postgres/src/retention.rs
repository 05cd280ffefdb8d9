//! Token-row retention: a row of a lock name nobody holds is deleted once its token is
//! older than the retention, so a lock per job id does not grow a table by a row per job
//! for ever.
//!
//! Deleting a free row is safe because every token is at least the server's clock in
//! microseconds when it is granted: a row goes only when its token is `retention` behind
//! the clock, so the next grant on that name (at least the clock again) is past it, even
//! after the clock was stepped back by less than the retention.
//!
//! Sweeps run in the background, started by an acquire at most once per
//! [`sweep_interval`] (a [`Periodic`] chore), one batch of names after another in key order (each batch its own
//! statement, so concurrent acquires on a name wait for at most one batch), and one at a
//! time across every process sharing the schema (a transaction-level advisory lock, which
//! a sweep that finds it taken skips).

use std::sync::Arc;
use std::time::Duration;

use distlock_core::chore::{Periodic, sweep_interval};
use sqlx::Row;
use tracing::{debug, warn};

use crate::client::{PgClient, with_clock};
use crate::error::Operation;
use crate::schema::Schema;
use crate::statement::{Statement, Value};

/// How long a free token row is kept by default.
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The shortest retention the builder accepts.
pub const MIN_TOKEN_RETENTION: Duration = Duration::from_secs(1);

/// The longest retention the builder accepts (ten years).
pub const MAX_TOKEN_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);

/// Names looked at per statement.
const BATCH: i64 = 10_000;

/// The transaction-level advisory lock one sweep at a time holds per statement; apart
/// from `schema::SETUP_LOCK` and from the advisory backend's hashed keys.
const SWEEP_LOCK: i64 = 0x6469_7374_7377_6570; // "distswep"

/// Which table a sweeper clears.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Table {
    /// `distlock_leases`: a row is free when it has no owner or its lease ran out.
    Leases,
    /// `distlock_advisory_tokens`: a row is free when no session holds its advisory lock.
    AdvisoryTokens,
}

/// The statement for one batch: `$1` retention in µs, `$2` the last name of the previous
/// batch (`''` at first), `$3` the sweep lock, `$4` the batch size, and for the advisory
/// table `$5` the schema.
/// Returns the batch's last name, how many names it looked at and how many rows it deleted.
fn statement(schema: &Schema, table: Table) -> Arc<str> {
    let (name, held, free) = match table {
        Table::Leases => (
            "distlock_leases",
            "",
            "(t.owner IS NULL OR t.expires_at <= now())",
        ),
        // A lock is held when any session of this database has its key in `pg_locks`
        // (the key is the first 8 bytes of SHA-256 of `distlock:<schema>:<name>`, as
        // `advisory::keys::lock_id` computes it; a test keeps the two the same).
        Table::AdvisoryTokens => (
            "distlock_advisory_tokens",
            "held AS (SELECT (k.classid::bigint << 32) | k.objid::bigint AS id \
                        FROM pg_locks k \
                       WHERE k.locktype = 'advisory' AND k.objsubid = 1 \
                         AND k.database = (SELECT oid FROM pg_database \
                                            WHERE datname = current_database())), ",
            "NOT EXISTS (SELECT 1 FROM held WHERE held.id = \
                ('x' || encode(substring(sha256(convert_to('distlock:' || $5::text || ':' \
                                                           || t.name, 'UTF8')) \
                                         FROM 1 FOR 8), 'hex'))::bit(64)::bigint)",
        ),
    };
    schema.sql(&with_clock(&format!(
        "WITH go AS (SELECT pg_try_advisory_xact_lock($3) AS ok), {held}\
         batch AS (SELECT name FROM {{s}}.{name} \
                    WHERE (SELECT ok FROM go) AND name > $2 ORDER BY name LIMIT $4), \
         gone AS (DELETE FROM {{s}}.{name} t USING batch b \
                   WHERE t.name = b.name AND t.token < {{clock_us}} - $1 AND {free} \
                  RETURNING 1) \
         SELECT (SELECT max(name) FROM batch) AS last, \
                (SELECT count(*) FROM batch) AS scanned, \
                (SELECT count(*) FROM gone) AS deleted"
    )))
}

/// Starts a background sweep of one backend's table when one is due.
pub(crate) struct Sweeper {
    inner: Arc<Inner>,
}

struct Inner {
    backend: &'static str,
    table: Table,
    sql: Arc<str>,
    retention: Duration,
    sweeps: Periodic,
}

impl Sweeper {
    pub(crate) fn new(client: &PgClient, backend: &'static str, table: Table) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend,
                table,
                sql: statement(&client.schema, table),
                retention: client.token_retention,
                sweeps: Periodic::new(sweep_interval(client.token_retention)),
            }),
        }
    }

    /// Starts a sweep on `client` in the background if one is due and none is running
    /// in this process. Costs an atomic load when none is due; does nothing outside a
    /// tokio runtime.
    pub(crate) fn poke(&self, client: &PgClient) {
        let Some(turn) = self.inner.sweeps.due() else {
            return;
        };
        let (inner, client) = (Arc::clone(&self.inner), client.clone());
        turn.spawn(async move {
            match sweep(&client, &inner).await {
                Ok(0) => {}
                Ok(deleted) => debug!(
                    backend = inner.backend,
                    deleted, "deleted free token rows past their retention"
                ),
                Err(e) => warn!(
                    backend = inner.backend,
                    error = %e,
                    "sweeping free token rows failed; the next acquire after {:?} tries again",
                    inner.sweeps.every()
                ),
            }
        });
    }
}

/// One sweep: batch after batch until the end of the table (or another process's sweep
/// holds the lock). The number of rows deleted.
async fn sweep(client: &PgClient, inner: &Inner) -> Result<u64, distlock_core::LockError> {
    let retention_us = i64::try_from(inner.retention.as_micros()).unwrap_or(i64::MAX);
    let mut after = String::new();
    let mut deleted = 0u64;
    loop {
        let mut conn = client.conn(inner.backend).await?;
        let mut query = Statement::new(&inner.sql)
            .bind(Value::Int8(retention_us))
            .bind(Value::Text(after.as_str()))
            .bind(Value::Int8(SWEEP_LOCK))
            .bind(Value::Int8(BATCH));
        if let Table::AdvisoryTokens = inner.table {
            query = query.bind(Value::Text(client.schema.as_str()));
        }
        let row = client
            .timed(
                inner.backend,
                Operation::Purge,
                query.fetch_optional(client.sending(), &mut conn),
            )
            .await;
        let row = match row {
            Ok(Some(row)) => row,
            // The statement always returns one row.
            Ok(None) => return Ok(deleted),
            Err(failed) => {
                if failed.broken {
                    conn.close_on_drop();
                }
                return Err(failed.error);
            }
        };
        let decode =
            |e| crate::error::from_sqlx(inner.backend, Operation::Purge, &client.schema, e);
        let last: Option<String> = row.try_get("last").map_err(decode)?;
        let scanned: i64 = row.try_get("scanned").map_err(decode)?;
        let gone: i64 = row.try_get("deleted").map_err(decode)?;
        deleted += u64::try_from(gone).unwrap_or(0);
        match last {
            Some(last) if scanned == BATCH => after = last,
            _ => return Ok(deleted),
        }
    }
}
