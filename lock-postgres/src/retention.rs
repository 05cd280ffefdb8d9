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
//!
//! A sweep that stops before the end of the table (it found the lock taken by another
//! process's sweep, or a statement failed) leaves the name it reached, and the process's
//! next sweep goes on from there: started again from the first name each time, sweeps cut
//! off as often as not would only ever go over the table's first names. A sweep that
//! reached the end leaves the first name.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use distlock_core::chore::{Periodic, sweep_interval};
use sqlx::Row;
use sqlx::postgres::PgRow;
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

/// Names looked at per statement, at most.
const BATCH: i64 = 10_000;

/// The fewest names a statement looks at: a batch that ran out of time is halved down to
/// this.
const MIN_BATCH: i64 = 100;

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
/// Returns whether it had the sweep lock, the batch's last name, how many names it looked
/// at and how many rows it deleted.
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
    // The delete names its rows by a range of the primary key, not by a join with the
    // batch: joined, the planner hashed the whole table for every batch (a sequential
    // scan of a million rows, 0.6 s, per batch of ten thousand), which made a sweep
    // quadratic in the table and, on a loaded server, let no batch finish within the
    // request timeout. By range it is an index scan of the batch's rows alone.
    schema.sql(&with_clock(&format!(
        "WITH go AS (SELECT pg_try_advisory_xact_lock($3) AS ok), {held}\
         batch AS (SELECT max(name) AS last, count(*) AS scanned \
                     FROM (SELECT name FROM {{s}}.{name} \
                            WHERE (SELECT ok FROM go) AND name > $2 \
                            ORDER BY name LIMIT $4) names), \
         gone AS (DELETE FROM {{s}}.{name} t \
                   WHERE t.name > $2 AND t.name <= (SELECT last FROM batch) \
                     AND t.token < {{clock_us}} - $1 AND {free} \
                  RETURNING 1) \
         SELECT (SELECT ok FROM go) AS locked, (SELECT last FROM batch) AS last, \
                (SELECT scanned FROM batch) AS scanned, \
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
    /// Names looked at per statement: [`BATCH`], halved (down to [`MIN_BATCH`]) after a
    /// statement ran out of the request time, doubled back after one that took under an
    /// eighth of it.
    batch: AtomicI64,
    /// The last name the previous sweep looked at when it stopped before the end of the
    /// table; empty once one reached the end.
    resume: std::sync::Mutex<String>,
}

impl Inner {
    fn new(client: &PgClient, backend: &'static str, table: Table) -> Self {
        Self {
            backend,
            table,
            sql: statement(&client.schema, table),
            lock: sweep_lock(&client.schema, table),
            retention: client.token_retention,
            sweeps: Periodic::new(sweep_interval(client.token_retention)),
            batch: AtomicI64::new(BATCH),
            resume: std::sync::Mutex::new(String::new()),
        }
    }

    fn resume(&self) -> std::sync::MutexGuard<'_, String> {
        self.resume
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What one batch of a sweep did.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Another process's sweep held the lock: nothing was looked at.
    CutOff,
    /// A batch looked at `scanned` names and deleted `deleted` rows; `more` when names
    /// may follow.
    Swept {
        scanned: u64,
        deleted: u64,
        more: bool,
    },
}

impl Sweeper {
    pub(crate) fn new(client: &PgClient, backend: &'static str, table: Table) -> Self {
        Self {
            inner: Arc::new(Inner::new(client, backend, table)),
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
            match sweep(&client, &inner).await.map(|swept| swept.deleted) {
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

/// What a sweep did: names looked at, rows deleted.
#[derive(Debug, Default, PartialEq, Eq)]
struct Swept {
    scanned: u64,
    deleted: u64,
}

/// One sweep: batch after batch from where the previous one stopped until the end of the
/// table (or another process's sweep holds the lock).
async fn sweep(client: &PgClient, inner: &Inner) -> Result<Swept, distlock_core::LockError> {
    let mut swept = Swept::default();
    loop {
        match step(client, inner).await? {
            Step::CutOff => return Ok(swept),
            Step::Swept {
                scanned,
                deleted,
                more,
            } => {
                swept.scanned += scanned;
                swept.deleted += deleted;
                if !more {
                    return Ok(swept);
                }
            }
        }
    }
}

/// One batch, from the name the sweep reached; moves that name on (back to the first one
/// at the end of the table). A failed statement leaves it where it was.
///
/// A statement that runs out of the request time (the server cancels it too: see
/// `PgPooling`) halves the batch for the next: with a fixed batch, a server too slow to
/// delete one batch within that time would have been sent the same batch for ever, and
/// the table would only grow.
async fn step(client: &PgClient, inner: &Inner) -> Result<Step, distlock_core::LockError> {
    let retention_us = i64::try_from(inner.retention.as_micros()).unwrap_or(i64::MAX);
    let after = inner.resume().clone();
    let batch = inner.batch.load(Ordering::Relaxed);
    let mut conn = client.conn(inner.backend).await?;
    let mut query = Statement::new(&inner.sql)
        .bind(Value::Int8(retention_us))
        .bind(Value::Text(after.as_str()))
        .bind(Value::Int8(inner.lock))
        .bind(Value::Int8(batch));
    if let Table::AdvisoryTokens = inner.table {
        query = query.bind(Value::Text(client.schema.as_str()));
    }
    let sent = tokio::time::Instant::now();
    let row = client
        .timed(
            inner.backend,
            Operation::Purge,
            query.send::<Option<PgRow>>(client.sending(), &mut conn),
        )
        .await;
    let took = sent.elapsed();
    let row = match row {
        Ok(Some(row)) => row,
        // The statement always returns one row.
        Ok(None) => return Ok(Step::CutOff),
        Err(failed) => {
            if failed.broken {
                conn.close_on_drop();
            }
            if took >= client.request_timeout && batch > MIN_BATCH {
                let smaller = (batch / 2).max(MIN_BATCH);
                inner.batch.store(smaller, Ordering::Relaxed);
                warn!(
                    backend = inner.backend,
                    batch,
                    next = smaller,
                    "a sweep's batch ran out of the request time; the next looks at fewer names"
                );
            }
            return Err(failed.error);
        }
    };
    if batch < BATCH && took < client.request_timeout / 8 {
        inner.batch.store((batch * 2).min(BATCH), Ordering::Relaxed);
    }
    let decode = |e| crate::error::from_sqlx(inner.backend, Operation::Purge, &client.schema, e);
    let locked: bool = row.try_get("locked").map_err(decode)?;
    if !locked {
        return Ok(Step::CutOff);
    }
    let last: Option<String> = row.try_get("last").map_err(decode)?;
    let scanned: i64 = row.try_get("scanned").map_err(decode)?;
    let gone: i64 = row.try_get("deleted").map_err(decode)?;
    let more = scanned == batch && last.is_some();
    *inner.resume() = if more {
        last.unwrap_or_default()
    } else {
        String::new()
    };
    Ok(Step::Swept {
        scanned: u64::try_from(scanned).unwrap_or(0),
        deleted: u64::try_from(gone).unwrap_or(0),
        more,
    })
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

    /// A server of its own whose login role may create schemas, and a builder of
    /// `schema` on it (tokens kept for [`RETENTION`], then `configure`d) whose tables
    /// `setup()` made.
    async fn set_up(
        schema: &str,
        configure: impl FnOnce(PgBuilder) -> PgBuilder,
    ) -> (PostgresServer, PgBuilder) {
        let server = harness::require(PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        let builder = configure(
            PgBuilder::new(server.url())
                .schema(schema)
                .token_retention(RETENTION),
        );
        builder
            .build_lease_backend()
            .unwrap()
            .setup()
            .await
            .unwrap();
        (server, builder)
    }

    /// A sweep of one schema's lease table runs while another session holds the sweep
    /// lock of another schema's (as a long sweep there would, statement after statement),
    /// and of its own advisory token table: the free row past its retention goes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweep_is_not_stopped_by_the_sweep_of_another_schema_or_table() {
        let (server, builder) = set_up("swept", |b| b).await;
        let backend = builder.build_lease_backend().unwrap();
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

    /// A sweep that looked at one batch and was then cut off by another process's sweep
    /// (which holds the lock of the table and schema) leaves the name it reached: the
    /// next sweep goes on from there, not from the first name, and one that reached the
    /// end of the table leaves the first name for the next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweep_cut_off_is_taken_up_where_it_stopped() {
        const KEPT: u64 = 100;
        const PAST: u64 = 150;
        let (server, builder) = set_up("resumed", |b| b).await;
        let client = builder.client(2).unwrap();
        // KEPT names first whose tokens are an hour ahead (kept), then PAST names whose
        // tokens are long past the retention.
        harness::require(
            server
                .psql(&format!(
                    "INSERT INTO resumed.distlock_leases (name, owner, token, expires_at) \
                     SELECT 'a' || lpad(i::text, 4, '0'), NULL, \
                            (extract(epoch FROM clock_timestamp()) * 1000000)::bigint \
                            + 3600000000, NULL FROM generate_series(1, {KEPT}) i; \
                     INSERT INTO resumed.distlock_leases (name, owner, token, expires_at) \
                     SELECT 'b' || lpad(i::text, 4, '0'), NULL, 1, NULL \
                       FROM generate_series(1, {PAST}) i"
                ))
                .await,
        );
        let inner = Inner::new(&client, "postgres-lease", Table::Leases);
        inner.batch.store(KEPT as i64, Ordering::Relaxed);

        // A sweep's first batch: the kept names.
        assert_eq!(
            step(&client, &inner).await.unwrap(),
            Step::Swept {
                scanned: KEPT,
                deleted: 0,
                more: true
            }
        );
        // Another process's sweep holds the lock: this one is cut off.
        let mut other = <sqlx::PgConnection as Connection>::connect(&server.url())
            .await
            .unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(inner.lock)
            .execute(&mut other)
            .await
            .unwrap();
        assert_eq!(step(&client, &inner).await.unwrap(), Step::CutOff);
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(inner.lock)
            .execute(&mut other)
            .await
            .unwrap();

        // The next sweep looks only at the names after the first batch.
        assert_eq!(
            sweep(&client, &inner).await.unwrap(),
            Swept {
                scanned: PAST,
                deleted: PAST
            },
            "the sweep after the cut-off did not go on from where it stopped"
        );
        // That one reached the end: the next starts from the first name.
        assert_eq!(
            sweep(&client, &inner).await.unwrap(),
            Swept {
                scanned: KEPT,
                deleted: 0
            }
        );
        other.close().await.unwrap();
    }

    /// A server too slow to delete a batch within the request time (here a trigger that
    /// sleeps 3 ms per deleted row, with a 2 s request time: 1,000 free rows past their
    /// retention take 3 s, 312 take 0.94 s, the smallest batch 0.3 s) still gets swept:
    /// each batch that runs out of time halves the next, until they fit. With a fixed
    /// batch every sweep sent the same batch again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_runs_out_of_time_is_halved_until_the_sweep_goes_on() {
        const ROWS: u64 = 1_000;
        let (server, builder) = set_up("slow", |b| b.request_timeout(Duration::from_secs(2))).await;
        harness::require(
            server
                .psql(&format!(
                    "INSERT INTO slow.distlock_leases (name, owner, token, expires_at) \
                     SELECT 'job:' || lpad(i::text, 4, '0'), NULL, 1, NULL \
                       FROM generate_series(1, {ROWS}) i; \
                     CREATE FUNCTION slow.slow_delete() RETURNS trigger LANGUAGE plpgsql AS \
                       $$ BEGIN PERFORM pg_sleep(0.003); RETURN OLD; END $$; \
                     CREATE TRIGGER slow_delete BEFORE DELETE ON slow.distlock_leases \
                       FOR EACH ROW EXECUTE FUNCTION slow.slow_delete()"
                ))
                .await,
        );
        let client = builder.client(2).unwrap();
        let inner = Inner::new(&client, "postgres-lease", Table::Leases);
        // Each sweep that runs out of time halves the batch (10,000 → 100 is seven
        // halvings) and the next goes on from where it stopped: a sweep that returns has
        // reached the end of the table. The smallest batch runs out of time only on a
        // machine six times slower than its 0.3 s.
        let mut timed_out = 0;
        loop {
            let batch = inner.batch.load(Ordering::Relaxed);
            match sweep(&client, &inner).await {
                Ok(_) => break,
                Err(e) => {
                    timed_out += 1;
                    assert!(
                        batch > MIN_BATCH,
                        "sweep {timed_out} failed with the smallest batch, {batch}: {e}"
                    );
                    assert!(
                        inner.batch.load(Ordering::Relaxed) < batch,
                        "a batch of {batch} ran out of time and the next is no smaller: {e}"
                    );
                    // The statement that ran out of time may still be ending on the
                    // server, holding the sweep lock: a sweep sent now would find it
                    // taken and stop at once (as the next one in a process does, a
                    // sweep interval later). So the next is sent once it has ended.
                    let ended = server
                        .until_no_session(
                            "state = 'active' AND query LIKE '%pg_try_advisory_xact_lock%'",
                            Duration::from_millis(20),
                            Duration::from_secs(30),
                        )
                        .await
                        .unwrap();
                    if let Err(running) = ended {
                        panic!(
                            "the sweep's statement still ran 30 s after it ran out of time: {running}"
                        );
                    }
                }
            }
        }
        assert!(
            timed_out > 0,
            "no batch ran out of time: the case shows nothing"
        );
        let left = server
            .psql("SELECT count(*) FROM slow.distlock_leases")
            .await
            .unwrap();
        assert_eq!(left, "0");
    }

    /// Rows of `table` the plan's scans read, from `EXPLAIN (ANALYZE, FORMAT JSON)`.
    fn rows_scanned(plan: &serde_json::Value, table: &str) -> u64 {
        let here = if plan["Relation Name"] == table
            && plan["Node Type"]
                .as_str()
                .is_some_and(|t| t.ends_with("Scan"))
        {
            plan["Actual Rows"].as_u64().unwrap() * plan["Actual Loops"].as_u64().unwrap()
        } else {
            0
        };
        let below = plan["Plans"].as_array().map_or(0, |plans| {
            plans.iter().map(|p| rows_scanned(p, table)).sum()
        });
        here + below
    }

    /// A batch of a sweep reads its own rows of the table and no others, however large
    /// the table: one that read the whole table (as a join of the batch with it did,
    /// hashing every row) made each sweep quadratic in the table's size.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_reads_only_its_own_rows_of_a_large_table() {
        // Twenty batches of the size sweeps use.
        const ROWS: u64 = 200_000;
        let (server, _) = set_up("planned", |b| b).await;
        let schema = Schema::new("planned").unwrap();
        harness::require(
            server
                .psql_within(
                    &format!(
                        "INSERT INTO planned.distlock_leases (name, owner, token, expires_at) \
                         SELECT 'job:' || g, NULL, g, NULL FROM generate_series(1, {ROWS}) g; \
                         INSERT INTO planned.distlock_advisory_tokens (name, token, owner, ttl_ms) \
                         SELECT 'job:' || g, g, gen_random_uuid(), 30000 \
                           FROM generate_series(1, {ROWS}) g; \
                         ANALYZE planned.distlock_leases; \
                         ANALYZE planned.distlock_advisory_tokens"
                    ),
                    Duration::from_secs(120),
                )
                .await,
        );
        let mut conn = <sqlx::PgConnection as Connection>::connect(&server.url())
            .await
            .unwrap();
        let mut too_many = Vec::new();
        for table in [Table::Leases, Table::AdvisoryTokens] {
            // From the start of the table and from its middle.
            for after in ["", "job:5"] {
                let mut tx = conn.begin().await.unwrap();
                let sql = format!(
                    "EXPLAIN (ANALYZE, FORMAT JSON) {}",
                    statement(&schema, table)
                );
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(1_000_000_i64)
                    .bind(after)
                    .bind(sweep_lock(&schema, table))
                    .bind(BATCH);
                if let Table::AdvisoryTokens = table {
                    query = query.bind(schema.as_str());
                }
                let row = query.fetch_one(&mut *tx).await.unwrap();
                let plan: serde_json::Value =
                    serde_json::from_str(&row.try_get_unchecked::<String, _>(0).unwrap()).unwrap();
                tx.rollback().await.unwrap();
                let read = rows_scanned(&plan[0]["Plan"], table.name());
                // The batch's names, once to bound the batch and once to delete them.
                if read > 2 * BATCH as u64 {
                    too_many.push(format!(
                        "{table:?} after {after:?}: a batch of {BATCH} read {read} of the \
                         table's {ROWS} rows: {plan:#}"
                    ));
                }
            }
        }
        assert!(too_many.is_empty(), "{}", too_many.join("\n"));
        conn.close().await.unwrap();
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
