//! Fencing and idempotency where the side effects happen: in the application's own
//! PostgreSQL transaction.
//!
//! - [`PgFencedResource`] keeps the highest admitted token per resource in
//!   `<schema>.distlock_fenced` and admits a write only when its token is at least that
//!   high. [`PgFencedResource::admit_in`] does it inside the caller's transaction, so the
//!   caller's own statements commit only together with the admission.
//! - [`IdempotencyKeys`] records a key such as `payment:{job_id}` in
//!   `<schema>.distlock_idempotency` in the same transaction as the side effect: a repeat
//!   reports [`Idempotency::AlreadyApplied`] and the caller applies nothing.
//!
//! # Equal tokens are admitted
//!
//! The guarded UPDATE of the classic recipe (`WHERE $token > COALESCE(last_fencing_token, 0)`)
//! rejects a second write by the *same* holder. Every fenced resource in distlock admits a
//! token equal to the highest seen (`>=`), as [`distlock_core::MemoryFencedResource`] does: the
//! holder of the newest lease may write many times, and only an older token is stale. The
//! same rule, written on an application table, reads:
//!
//! ```sql
//! UPDATE payouts SET status = 'processed', last_fencing_token = $2
//!  WHERE id = $1 AND $2 >= COALESCE(last_fencing_token, 0);  -- zero rows = stale
//! ```
//!
//! The admission row stays locked until the caller's transaction ends, so two holders'
//! transactions on one resource run one after the other and the older token is rejected
//! once the newer one has committed.
//!
//! # Behind a transaction-pooling proxy
//!
//! Both work on a pool whose connections go through PgBouncer in `pool_mode =
//! transaction` (the lease backend's [`pool`](crate::PgLeaseBackend::pool) with
//! `pooling=transaction`, say) as on a direct one. Their statements are unnamed (prepared
//! for the one call, never cached on the connection under a name that another server
//! session may know as another client's statement) and each runs inside a transaction,
//! the caller's or one of their own, so the pooler keeps one server session for it from
//! parse to execute. The price is a parse round trip per statement, and for
//! [`PgFencedResource::latest`] and [`FencedResource::read`] a `BEGIN` and a `COMMIT`.
//!
//! # The server bounds their own transactions
//!
//! The transactions [`PgFencedResource`] runs itself ([`FencedResource::write`],
//! [`FencedResource::check_only`], [`FencedResource::read`], [`PgFencedResource::latest`])
//! wait on the client between round trips, and from the admission to the `COMMIT` hold the
//! resource's row locked. Their `BEGIN` sets, for that transaction only,
//! `idle_in_transaction_session_timeout`, `statement_timeout` and `lock_timeout` to the resource's
//! [time limit](PgFencedResource::time_limit) (5 s by default), whatever the pool: a
//! client that stalls there loses the transaction, and the row, after the limit, and a
//! statement waiting on a row another transaction keeps locked fails after it instead of
//! waiting for ever. [`PgFencedResource::admit_in`] and [`IdempotencyKeys::record`] run in
//! the caller's transaction, which keeps the caller's limits (the lease backend's
//! [`pool`](crate::PgLeaseBackend::pool) sets them on its connections, see
//! [`PgPooling::Session`](crate::PgPooling::Session)).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    Admission, EnforcementMode, FencedResource, FencingToken, LockError, LockKey, WriteFence,
    decide,
};
use sqlx::{AssertSqlSafe, PgPool, PgTransaction, Postgres};

use crate::client::token_from;
use crate::error::{self, Operation};
use crate::schema::{self, Schema};
use crate::statement::bounded_begin;

const NAME: &str = "postgres-fence";

/// The default [time limit](PgFencedResource::time_limit) of a fenced resource's own
/// transactions.
pub const DEFAULT_FENCE_TIME_LIMIT: Duration = Duration::from_secs(5);

/// A [`FencedResource`] stored in PostgreSQL, in shadow or enforce mode.
///
/// Tables come from [`PgFencedResource::setup`] (the same tables as the backends' `setup`).
#[derive(Clone, Debug)]
pub struct PgFencedResource {
    pool: PgPool,
    schema: Schema,
    mode: EnforcementMode,
    /// The `BEGIN` of its own transactions, with their server-side limits.
    begin_sql: Arc<str>,
    admit_sql: Arc<str>,
    latest_sql: Arc<str>,
    write_sql: Arc<str>,
    read_sql: Arc<str>,
}

impl PgFencedResource {
    /// A resource gate on `pool` with its table in `schema`.
    pub fn new(pool: PgPool, schema: &str, mode: EnforcementMode) -> Result<Self, LockError> {
        let schema = Schema::new(schema)?;
        Ok(Self {
            admit_sql: schema.sql(
                "INSERT INTO {s}.distlock_fenced AS f (resource, last_fencing_token) \
                 VALUES ($1, $2) \
                 ON CONFLICT (resource) DO UPDATE \
                    SET last_fencing_token = EXCLUDED.last_fencing_token \
                  WHERE EXCLUDED.last_fencing_token >= COALESCE(f.last_fencing_token, 0) \
                 RETURNING last_fencing_token",
            ),
            latest_sql: schema
                .sql("SELECT last_fencing_token FROM {s}.distlock_fenced WHERE resource = $1"),
            write_sql: schema.sql("UPDATE {s}.distlock_fenced SET value = $2 WHERE resource = $1"),
            read_sql: schema.sql("SELECT value FROM {s}.distlock_fenced WHERE resource = $1"),
            begin_sql: bounded_begin(DEFAULT_FENCE_TIME_LIMIT).into(),
            pool,
            schema,
            mode,
        })
    }

    /// The limit the server puts on the resource's own transactions (see the module's
    /// documentation): how long one may wait on the client, and how long one of its
    /// statements may run or wait for a lock. Default [`DEFAULT_FENCE_TIME_LIMIT`].
    /// Fails with [`LockError::Config`] when it is not between 1 ms and `i32::MAX` ms
    /// (PostgreSQL's range for both settings).
    pub fn time_limit(mut self, limit: Duration) -> Result<Self, LockError> {
        let max = Duration::from_millis(i32::MAX as u64);
        if limit < Duration::from_millis(1) || limit > max {
            return Err(LockError::Config(format!(
                "fenced resource time limit {limit:?} is out of range 1ms..={max:?}"
            )));
        }
        self.begin_sql = bounded_begin(limit).into();
        Ok(self)
    }

    /// A transaction of the resource's own, bounded on the server.
    async fn begin(&self) -> Result<PgTransaction<'static>, sqlx::Error> {
        self.pool
            .begin_with(AssertSqlSafe(Arc::clone(&self.begin_sql)))
            .await
    }

    /// Creates the schema and tables if they do not exist. Idempotent.
    pub async fn setup(&self) -> Result<(), LockError> {
        schema::setup(&self.pool, &self.schema, NAME).await
    }

    /// The enforcement mode.
    pub fn mode(&self) -> EnforcementMode {
        self.mode
    }

    /// Admits a write to `resource` carrying `token`, inside the caller's transaction.
    ///
    /// On [`Admission::Admitted`] the token is recorded as the newest; run the side effect
    /// in the same transaction and commit. On [`Admission::Stale`] nothing was recorded:
    /// do not write, this worker's lease is gone. [`Admission::ShadowStale`] (shadow mode)
    /// is counted in `distlock_fence_rejected_total{mode="shadow"}` and lets the write
    /// through, never lowering the recorded token.
    ///
    /// ```no_run
    /// use distlock::postgres::{PgFencedResource, sqlx};
    /// use distlock::FencingToken;
    ///
    /// # async fn demo(fenced: PgFencedResource, pool: sqlx::PgPool, token: FencingToken)
    /// #     -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// if fenced.admit_in(&mut tx, "payout:42", token).await?.is_admitted() {
    ///     sqlx::query("UPDATE payouts SET status = 'processed' WHERE id = $1")
    ///         .bind(42_i64)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     tx.commit().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Cancel safe as far as the store goes: nothing is committed until the caller commits.
    pub async fn admit_in(
        &self,
        tx: &mut PgTransaction<'_>,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, LockError> {
        check_name(resource, "resource")?;
        let fail = |e| error::from_sqlx(NAME, Operation::Admit, &self.schema, e);
        let value = i64::try_from(token.get()).map_err(|_| LockError::InvalidKey {
            reason: format!("fencing token {token} does not fit a bigint"),
        })?;
        let admitted: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.admit_sql.clone()))
            .bind(resource)
            .bind(value)
            .persistent(false)
            .fetch_optional(&mut **tx)
            .await
            .map_err(fail)?;
        if admitted.is_some() {
            return Ok(decide(self.mode, resource, token, None));
        }
        // Rejected: read the newer token that caused it (committed by another holder).
        let latest: Option<Option<i64>> =
            sqlx::query_scalar(AssertSqlSafe(self.latest_sql.clone()))
                .bind(resource)
                .persistent(false)
                .fetch_optional(&mut **tx)
                .await
                .map_err(fail)?;
        let latest = latest.flatten().map_or(token, token_from);
        Ok(decide(self.mode, resource, token, Some(latest)))
    }

    /// [`Self::admit_in`] under `fence`: the write's resource is the fence's key and its
    /// token the fence's, taken together from the lease (a permit's
    /// [`fence`](distlock_core::Permit::fence), a guard's [`WriteFence::of`], a job's
    /// `fence()`), so a permit's token cannot be checked against the semaphore's name, where
    /// the tokens of different slots are not ordered.
    ///
    /// # Cancel safety
    /// As [`Self::admit_in`].
    pub async fn admit_under(
        &self,
        tx: &mut PgTransaction<'_>,
        fence: &WriteFence,
    ) -> Result<Admission, LockError> {
        self.admit_in(tx, fence.key().as_str(), fence.token()).await
    }

    /// The highest token admitted for `resource`.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads (a call dropped mid-way leaves its read-only transaction
    /// to be rolled back when the connection is next used).
    pub async fn latest(&self, resource: &str) -> Result<Option<FencingToken>, LockError> {
        let latest: Option<i64> = self
            .read_column(Operation::Fence, &self.latest_sql, resource)
            .await?;
        Ok(latest.map(token_from))
    }

    /// The one column `sql` reads from the row of `resource`, in a transaction of its own;
    /// `None` when there is no row or the column is NULL.
    async fn read_column<T>(
        &self,
        op: Operation,
        sql: &Arc<str>,
        resource: &str,
    ) -> Result<Option<T>, LockError>
    where
        T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres> + Send + Unpin,
    {
        check_name(resource, "resource")?;
        let fail = |e| error::from_sqlx(NAME, op, &self.schema, e);
        let mut tx = self.begin().await.map_err(fail)?;
        let value: Option<Option<T>> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .bind(resource)
            .persistent(false)
            .fetch_optional(&mut *tx)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(value.flatten())
    }
}

/// [`FencedResource::write`] is [`PgFencedResource::admit_in`] and the value's `UPDATE` in
/// one transaction of its own (the value is `<schema>.distlock_fenced.value`);
/// [`FencedResource::check_only`] is `admit_in` alone.
///
/// # Cancel safety
/// A call dropped before its commit is rolled back when the connection returns to the
/// pool; one dropped during the commit may or may not have been applied.
#[async_trait]
impl FencedResource for PgFencedResource {
    async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<Admission, LockError> {
        let fail = |e| error::from_sqlx(NAME, Operation::Write, &self.schema, e);
        let mut tx = self.begin().await.map_err(fail)?;
        let admission = self.admit_in(&mut tx, resource, token).await?;
        if admission.is_admitted() {
            sqlx::query(AssertSqlSafe(self.write_sql.clone()))
                .bind(resource)
                .bind(value)
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        Ok(admission)
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, LockError> {
        self.read_column(Operation::Read, &self.read_sql, resource)
            .await
    }

    async fn check_only(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, LockError> {
        let fail = |e| error::from_sqlx(NAME, Operation::Admit, &self.schema, e);
        let mut tx = self.begin().await.map_err(fail)?;
        let admission = self.admit_in(&mut tx, resource, token).await?;
        tx.commit().await.map_err(fail)?;
        Ok(admission)
    }
}

/// Whether a side effect's idempotency key was new.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Idempotency {
    /// The key is new: apply the side effect in this transaction, then commit.
    Applied,
    /// The key was recorded before: the side effect already happened; apply nothing.
    AlreadyApplied,
}

/// Idempotency keys in `<schema>.distlock_idempotency`, recorded in the caller's
/// transaction together with the side effect they stand for.
#[derive(Clone, Debug)]
pub struct IdempotencyKeys {
    schema: Schema,
    record_sql: Arc<str>,
}

impl IdempotencyKeys {
    /// Keys stored in `schema` (created by any `setup()` of this crate).
    pub fn new(schema: &str) -> Result<Self, LockError> {
        let schema = Schema::new(schema)?;
        Ok(Self {
            record_sql: schema.sql(
                "INSERT INTO {s}.distlock_idempotency (key) VALUES ($1) \
                 ON CONFLICT (key) DO NOTHING",
            ),
            schema,
        })
    }

    /// Records `key` (for example `payment:{job_id}`) in the caller's transaction.
    ///
    /// [`Idempotency::Applied`]: apply the side effect in the same transaction and commit;
    /// if the transaction rolls back, the key is not recorded either.
    /// [`Idempotency::AlreadyApplied`]: a committed transaction recorded it before.
    /// A concurrent transaction recording the same key makes this call wait for it.
    ///
    /// The key follows the rules of [`LockKey`] (1 to 512 bytes, no control characters).
    ///
    /// ```no_run
    /// use distlock::postgres::{Idempotency, IdempotencyKeys, sqlx};
    ///
    /// # async fn demo(pool: sqlx::PgPool, job_id: i64) -> Result<(), Box<dyn std::error::Error>> {
    /// let keys = IdempotencyKeys::new("distlock")?;
    /// let mut tx = pool.begin().await?;
    /// if keys.record(&mut tx, &format!("payment:{job_id}")).await? == Idempotency::Applied {
    ///     sqlx::query("INSERT INTO payments (job_id) VALUES ($1)")
    ///         .bind(job_id)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     tx.commit().await?;
    /// } // AlreadyApplied: a run before this one paid; the transaction rolls back.
    /// # Ok(()) }
    /// ```
    pub async fn record(
        &self,
        tx: &mut PgTransaction<'_>,
        key: &str,
    ) -> Result<Idempotency, LockError> {
        check_name(key, "idempotency key")?;
        let done = sqlx::query(AssertSqlSafe(self.record_sql.clone()))
            .bind(key)
            .persistent(false)
            .execute(&mut **tx)
            .await
            .map_err(|e| error::from_sqlx(NAME, Operation::RecordKey, &self.schema, e))?;
        Ok(if done.rows_affected() == 1 {
            Idempotency::Applied
        } else {
            Idempotency::AlreadyApplied
        })
    }
}

/// Resource names and idempotency keys follow the lock-key rules.
fn check_name(name: &str, what: &str) -> Result<(), LockError> {
    LockKey::new(name).map(drop).map_err(|e| match e {
        LockError::InvalidKey { reason } => LockError::InvalidKey {
            reason: format!("{what}: {reason}"),
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_key_rules() {
        assert!(check_name("payment:42", "resource").is_ok());
        let err = check_name("", "idempotency key").unwrap_err();
        assert!(err.to_string().contains("idempotency key"), "{err}");
        assert!(check_name("a\u{0}b", "resource").is_err());
    }

    #[tokio::test]
    async fn a_time_limit_postgresql_cannot_take_is_refused() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://u@127.0.0.1:1/db")
            .unwrap();
        let fenced = PgFencedResource::new(pool, "distlock", EnforcementMode::Enforce).unwrap();
        for bad in [
            Duration::ZERO,
            Duration::from_micros(999),
            Duration::from_millis(i32::MAX as u64 + 1),
        ] {
            assert!(
                matches!(fenced.clone().time_limit(bad), Err(LockError::Config(_))),
                "{bad:?}"
            );
        }
        assert!(fenced.time_limit(Duration::from_millis(1)).is_ok());
    }

    #[test]
    fn schema_names_are_checked_before_any_sql_is_built() {
        assert!(matches!(
            IdempotencyKeys::new("x; drop table y"),
            Err(LockError::Config(_))
        ));
    }
}
