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
//! time across every process sharing the schema and table (a transaction-level advisory
//! lock of that table and schema, which a sweep that finds it taken skips).

use std::sync::Arc;
use std::time::Duration;

use distlock_core::chore::{Periodic, sweep_interval};
use sqlx::Row;
use tracing::{debug, warn};

use crate::client::{PgClient, with_clock};
use crate::error::Operation;
use crate::schema::Schema;
use crate::statement::{Statement, Value};
use sha2::{Digest, Sha256};

/// How long a free token row is kept by default.
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The shortest retention the builder accepts.
pub const MIN_TOKEN_RETENTION: Duration = Duration::from_secs(1);

/// The longest retention the builder accepts (ten years).
pub const MAX_TOKEN_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);

/// Names looked at per statement.
const BATCH: i64 = 10_000;

/// Which table a sweeper clears.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Table {
    /// `distlock_leases`: a row is free when it has no owner or its lease ran out.
    Leases,
    /// `distlock_advisory_tokens`: a row is free when no session holds its advisory lock.
    AdvisoryTokens,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Self::Leases => "distlock_leases",
            Self::AdvisoryTokens => "distlock_advisory_tokens",
        }
    }
}

/// The transaction-level advisory lock one sweep of `table` in `schema` at a time holds
/// per statement: the first 8 bytes of SHA-256 of `distlock-sweep:<table>:<schema>`.
/// One per table and schema, so sweeps of other schemas (or of the other table) never
/// find it taken and stop: with one lock for all, they cut each other off, each starting
/// again from the first name at its next turn. A hash, as the advisory backend's keys
/// are (of `distlock:<schema>:<name>`): apart from them and from `schema::SETUP_LOCK`
/// but for a 2^-64 chance.
fn sweep_lock(schema: &Schema, table: Table) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"distlock-sweep:")
        .chain_update(table.name().as_bytes())
        .chain_update(b":")
        .chain_update(schema.as_str().as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The statement for one batch: `$1` retention in µs, `$2` the last name of the previous
/// batch (`''` at first), `$3` the sweep lock, `$4` the batch size, and for the advisory
/// table `$5` the schema.
/// Returns the batch's last name, how many names it looked at and how many rows it deleted.
fn statement(schema: &Schema, table: Table) -> Arc<str> {
    let name = table.name();
    let (held, free) = match table {
        Table::Leases => ("", "(t.owner IS NULL OR t.expires_at <= now())"),
        // A lock is held when any session of this database has its key in `pg_locks`
        // (the key is the first 8 bytes of SHA-256 of `distlock:<schema>:<name>`, as
        // `advisory::keys::lock_id` computes it; a test keeps the two the same).
        Table::AdvisoryTokens => (
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
    /// [`sweep_lock`] of the table and schema.
    lock: i64,
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
                lock: sweep_lock(&client.schema, table),
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
            .bind(Value::Int8(inner.lock))
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use distlock_core::{LockBackend, LockKey};
    use harness::postgres::PostgresServer;
    use sqlx::Connection;
    use tokio::time::Instant;

    use super::*;
    use crate::PgBuilder;

    const RETENTION: Duration = Duration::from_secs(1);

    /// A sweep of one schema's lease table runs while another session holds the sweep
    /// lock of another schema's (as a long sweep there would, statement after statement),
    /// and of its own advisory token table: the free row past its retention goes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweep_is_not_stopped_by_the_sweep_of_another_schema_or_table() {
        let server = harness::require(PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        let backend = PgBuilder::new(server.url())
            .schema("swept")
            .token_retention(RETENTION)
            .build_lease_backend()
            .unwrap();
        backend.setup().await.unwrap();
        let k = LockKey::new("sweep:released").unwrap();
        let lease = backend
            .acquire(&k, Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        backend.release(&lease).await.unwrap();

        let mut other = <sqlx::PgConnection as Connection>::connect(&server.url())
            .await
            .unwrap();
        for (schema, table) in [("other", Table::Leases), ("swept", Table::AdvisoryTokens)] {
            sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(sweep_lock(&Schema::new(schema).unwrap(), table))
                .execute(&mut other)
                .await
                .unwrap();
        }
        tokio::time::sleep(RETENTION).await;

        // Each acquire starts a sweep once one is due (a second apart).
        let busy = LockKey::new("sweep:busy").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let rows = server
                .psql("SELECT count(*) FROM swept.distlock_leases WHERE name = 'sweep:released'")
                .await
                .unwrap();
            if rows == "0" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the free row past its retention is still there: the sweep found its lock \
                 taken"
            );
            if let Some(held) = backend
                .acquire(&busy, Duration::from_secs(30))
                .await
                .unwrap()
            {
                backend.release(&held).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        other.close().await.unwrap();
    }

    #[test]
    fn sweep_locks_differ_per_schema_and_table() {
        let (a, b) = (Schema::new("a").unwrap(), Schema::new("b").unwrap());
        assert_ne!(sweep_lock(&a, Table::Leases), sweep_lock(&b, Table::Leases));
        assert_ne!(
            sweep_lock(&a, Table::Leases),
            sweep_lock(&a, Table::AdvisoryTokens)
        );
        assert_eq!(sweep_lock(&a, Table::Leases), sweep_lock(&a, Table::Leases));
    }
}
