//! The schema that holds the backends' tables: name validation, table names, and the
//! explicit, idempotent [`setup`].
//!
//! The schema name is the only part of any SQL text this crate builds at run time, so it
//! is validated strictly (`[a-z_][a-z0-9_]{0,62}`, no `pg_` prefix) before it is used, and
//! written as a quoted identifier, so reserved words (`user`, `select`) work too; every
//! value goes through bind parameters.

use std::fmt;
use std::sync::Arc;

use distlock_core::LockError;
use sqlx::{AssertSqlSafe, PgPool};

use crate::error::{self, Operation};

/// The schema used when none is configured.
pub const DEFAULT_SCHEMA: &str = "distlock";

/// A validated schema name.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Schema(Arc<str>);

impl Schema {
    /// Validates a schema name: 1 to 63 characters, a lowercase ASCII letter or `_` first,
    /// then lowercase ASCII letters, digits or `_`; not starting with `pg_` (reserved by
    /// PostgreSQL). Such a name holds no quote, so it is safe to put into SQL text as a
    /// quoted identifier, which it always is: a reserved word such as `user` is a valid
    /// schema name.
    pub fn new(name: &str) -> Result<Self, LockError> {
        let bytes = name.as_bytes();
        let valid_first = |b: u8| b.is_ascii_lowercase() || b == b'_';
        let valid_rest = |b: u8| valid_first(b) || b.is_ascii_digit();
        let ok = matches!(bytes.first(), Some(&b) if valid_first(b))
            && bytes.len() <= 63
            && bytes[1..].iter().all(|&b| valid_rest(b));
        if !ok {
            return Err(LockError::Config(format!(
                "invalid schema name {name:?}: expected 1 to 63 characters matching \
                 [a-z_][a-z0-9_]*"
            )));
        }
        if name.starts_with("pg_") {
            return Err(LockError::Config(format!(
                "invalid schema name {name:?}: names starting with pg_ are reserved by PostgreSQL"
            )));
        }
        Ok(Self(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// SQL text with every `{s}` replaced by the schema name as a quoted identifier.
    pub(crate) fn sql(&self, template: &str) -> Arc<str> {
        // Quoting keeps the name as it is (it is lower case already) and stops PostgreSQL
        // from reading a reserved word as a keyword.
        template.replace("{s}", &format!("\"{}\"", self.0)).into()
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// An arbitrary constant: the transaction-level advisory lock that serialises concurrent
/// `setup` calls, because concurrent `CREATE TABLE IF NOT EXISTS` can fail on a race.
const SETUP_LOCK: i64 = 0x6469_7374_6c6f_636b; // "distlock"

/// Creates the schema (if it does not exist) and every table of this crate, in one
/// transaction. Idempotent and safe to run concurrently.
///
/// The role needs `CREATE` on the database only when the schema does not exist yet.
pub(crate) async fn setup(
    pool: &PgPool,
    schema: &Schema,
    backend: &'static str,
) -> Result<(), LockError> {
    let fail = |e| error::from_sqlx(backend, Operation::Setup, schema, e);
    let mut tx = pool.begin().await.map_err(fail)?;
    // Unnamed statements, each parsed and run inside the transaction (so in one server
    // session, through a transaction pooler too), none kept on the connection.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .persistent(false)
        .bind(SETUP_LOCK)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .persistent(false)
            .bind(schema.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(fail)?;
    if !exists {
        // CREATE SCHEMA checks the CREATE privilege even with IF NOT EXISTS, so it only
        // runs when needed: a role without that privilege can use a schema made for it.
        sqlx::query(AssertSqlSafe(schema.sql("CREATE SCHEMA IF NOT EXISTS {s}")))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
    }
    for ddl in [
        "CREATE TABLE IF NOT EXISTS {s}.distlock_leases (
            name text PRIMARY KEY,
            owner uuid,
            token bigint NOT NULL,
            expires_at timestamptz,
            CHECK ((owner IS NULL) = (expires_at IS NULL))
        )",
        "CREATE TABLE IF NOT EXISTS {s}.distlock_advisory_tokens (
            name text PRIMARY KEY,
            token bigint NOT NULL,
            owner uuid NOT NULL,
            ttl_ms bigint NOT NULL
        )",
        "CREATE TABLE IF NOT EXISTS {s}.distlock_fenced (
            resource text PRIMARY KEY,
            last_fencing_token bigint,
            value bytea
        )",
        "CREATE TABLE IF NOT EXISTS {s}.distlock_idempotency (
            key text PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )",
    ] {
        sqlx::query(AssertSqlSafe(schema.sql(ddl)))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(fail)?;
    }
    // Tables made before the fenced write stored values lack the column. ALTER TABLE needs
    // the table's owner even with IF NOT EXISTS, so it only runs when the column is missing.
    let has_value: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
          WHERE table_schema = $1 AND table_name = 'distlock_fenced' AND column_name = 'value')",
    )
    .persistent(false)
    .bind(schema.as_str())
    .fetch_one(&mut *tx)
    .await
    .map_err(fail)?;
    if !has_value {
        sqlx::query(AssertSqlSafe(schema.sql(
            "ALTER TABLE {s}.distlock_fenced ADD COLUMN IF NOT EXISTS value bytea",
        )))
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    }
    tx.commit().await.map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        for good in ["distlock", "_x", "a1_b2", &"a".repeat(63)] {
            assert_eq!(Schema::new(good).unwrap().as_str(), good);
        }
        for bad in [
            "",
            "1abc",
            "Distlock",
            "dist-lock",
            "dist lock",
            "a;drop table x",
            "\"quoted\"",
            "pg_catalog",
            "ünï",
            &"a".repeat(64),
        ] {
            assert!(
                matches!(Schema::new(bad), Err(LockError::Config(_))),
                "{bad:?} must be refused"
            );
        }
    }

    #[test]
    fn sql_templates_name_the_schema() {
        let s = Schema::new("jobs").unwrap();
        assert_eq!(&*s.sql("SELECT 1 FROM {s}.t"), "SELECT 1 FROM \"jobs\".t");
    }
}
