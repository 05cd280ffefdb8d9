//! [`Statement`]: one of the lease table's statements with its values, sent the way the
//! [pooling](crate::PgPooling) allows. The values are bind parameters either way; only
//! how the statement is prepared differs.
//!
//! - [`PgPooling::Session`]: prepared once per connection (sqlx names it and keeps it on
//!   the connection). One round trip per call once prepared.
//! - [`PgPooling::Transaction`]: an unnamed statement inside an explicit transaction of
//!   its own (`BEGIN`, parse, bind and execute, `COMMIT`: four round trips). A named
//!   statement would be prepared on one server session and used on another; an unnamed
//!   one outside a transaction is no way out either, because sqlx sends `Parse` and `Bind`
//!   in two syncs, and between them a transaction pooler may hand the server session to
//!   another client, whose own unnamed statement the `Bind` would then run when its
//!   parameter types match. Inside a transaction the pooler keeps the server session for
//!   this client until the `COMMIT`. The transaction changes nothing else: each of these
//!   statements runs in a transaction of its own in either mode.
//!
//! # The server bounds the transaction
//!
//! Such a transaction waits on the client between its round trips, and from the
//! statement's execution to the `COMMIT` it holds the rows the statement changed or
//! locked. A client that stalls there (paused, partitioned, its call dropped with the
//! connection still open) would keep them locked until something noticed, on a default
//! server never (and every later statement on those rows would wait behind it). So the
//! `BEGIN` sets, for its transaction only (`SET LOCAL`, in the same message),
//! `idle_in_transaction_session_timeout`, `statement_timeout` and `lock_timeout` to the
//! request time limit: the server ends a session that waits on its client in the
//! transaction for longer than the client itself waits for the reply, and cancels a
//! statement (one waiting on another's row lock, say) the client has given up on, instead
//! of keeping a backend waiting for nobody. `lock_timeout` also bounds what the commit
//! waits for after `statement_timeout` stopped counting (the notify lock of the
//! announcer's `pg_notify`). Past that limit the call has failed on the client anyway.
//!
//! # Cancel safety
//! A call dropped inside its transaction leaves it to be rolled back: sqlx queues the
//! `ROLLBACK` on the connection, and it is sent before the connection's next use; a
//! connection never used again is ended by the server after the request time limit.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::postgres::{PgArguments, PgConnection, PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Connection, PgTransaction, Postgres};
use uuid::Uuid;

use crate::pooling::PgPooling;

/// How statements are sent: the pooling, and with [`PgPooling::Transaction`] the limit the
/// server puts on each statement's transaction (the request time limit).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sending {
    pub(crate) pooling: PgPooling,
    pub(crate) limit: Duration,
}

impl Sending {
    /// A transaction of its own on `conn`, bounded on the server by [`Self::limit`] (see
    /// the module's documentation): one round trip, as a plain `BEGIN` is.
    async fn begin(self, conn: &mut PgConnection) -> Result<PgTransaction<'_>, sqlx::Error> {
        conn.begin_with(AssertSqlSafe(bounded_begin(self.limit)))
            .await
    }
}

/// `BEGIN` with the transaction's server-side limits, as one simple-protocol message.
pub(crate) fn bounded_begin(limit: Duration) -> String {
    let ms = whole_ms(limit);
    format!(
        "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
         SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
    )
}

/// The limits a pool in [`PgPooling::Session`] sets on each connection it opens (see
/// `PgPooling::Session`), for the whole session: [`bounded_begin`]'s but `lock_timeout`
/// (a statement waiting on a lock is bounded by `statement_timeout`; only the announcer,
/// whose commit waits for the notify lock, adds it).
pub(crate) const SESSION_LIMITS: &[&str] =
    &["idle_in_transaction_session_timeout", "statement_timeout"];

/// `settings` (time limits) set to `limit` for a whole session, as one simple-protocol
/// message. A setting the connection's startup `options` already give (the URL's
/// `options[statement_timeout]=…`) is left as the user set it.
pub(crate) fn session_bounds(
    limit: Duration,
    startup_options: Option<&str>,
    settings: &[&str],
) -> String {
    let ms = whole_ms(limit);
    settings
        .iter()
        .filter(|name| !startup_setting_names(startup_options.unwrap_or("")).any(|n| n == **name))
        .map(|name| format!("SET {name} = {ms}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The names of the settings startup `options` give (`-c name=value`, `-cname=value` or
/// `--name=value`, separated by spaces), `-` in a name read as `_` as the server reads it.
fn startup_setting_names(options: &str) -> impl Iterator<Item = String> + '_ {
    options.split_whitespace().filter_map(|word| {
        let (name, _) = word.split_once('=')?;
        let name = name
            .strip_prefix("--")
            .or_else(|| name.strip_prefix("-c"))
            .unwrap_or(name);
        Some(name.replace('-', "_"))
    })
}

/// Sets [`session_bounds`] on `conn`, a connection of its own to the server (pooling
/// [`PgPooling::Session`]): the pool's connections and the announcer's.
pub(crate) async fn bound_session(
    conn: &mut PgConnection,
    limit: Duration,
    startup_options: Option<&str>,
    settings: &[&str],
) -> Result<(), sqlx::Error> {
    let bounds = session_bounds(limit, startup_options, settings);
    if !bounds.is_empty() {
        sqlx::raw_sql(AssertSqlSafe(bounds)).execute(conn).await?;
    }
    Ok(())
}

/// A time limit as PostgreSQL's settings take it: whole milliseconds, at least 1 (0 would
/// turn the limit off), at most `i32::MAX`.
fn whole_ms(limit: Duration) -> u128 {
    limit.as_millis().clamp(1, i32::MAX as u128)
}

/// A value of a statement; `$N` in the text is the N-th.
pub(crate) enum Value<'a> {
    Text(&'a str),
    Texts(Vec<&'a str>),
    Uuid(Uuid),
    Uuids(Vec<Uuid>),
    Int8(i64),
    Int8s(Vec<i64>),
    Int4(i32),
    Int4s(Vec<i32>),
}

/// What a statement is sent for: every row (`Vec<PgRow>`), the first row if any
/// (`Option<PgRow>`), or the count of rows it changed (`PgQueryResult`).
pub(crate) trait Answer: Sized + Send {
    /// `query`'s answer of this kind, from `conn`.
    fn of<'e, 'q: 'e>(query: Query<'q>, conn: &'e mut PgConnection) -> Sent<'e, Self>;
}

/// A bound statement as sqlx holds it.
type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// An [`Answer`] on its way.
type Sent<'e, T> = BoxFuture<'e, Result<T, sqlx::Error>>;

impl Answer for Vec<PgRow> {
    fn of<'e, 'q: 'e>(query: Query<'q>, conn: &'e mut PgConnection) -> Sent<'e, Self> {
        Box::pin(query.fetch_all(conn))
    }
}

impl Answer for Option<PgRow> {
    fn of<'e, 'q: 'e>(query: Query<'q>, conn: &'e mut PgConnection) -> Sent<'e, Self> {
        Box::pin(query.fetch_optional(conn))
    }
}

impl Answer for PgQueryResult {
    fn of<'e, 'q: 'e>(query: Query<'q>, conn: &'e mut PgConnection) -> Sent<'e, Self> {
        Box::pin(query.execute(conn))
    }
}

/// A statement's text (`$1`, `$2`, ... for its values) and its values.
pub(crate) struct Statement<'a> {
    sql: &'a Arc<str>,
    values: Vec<Value<'a>>,
}

impl<'a> Statement<'a> {
    pub(crate) fn new(sql: &'a Arc<str>) -> Self {
        Self {
            sql,
            values: Vec::new(),
        }
    }

    /// Adds the next value.
    pub(crate) fn bind(mut self, value: Value<'a>) -> Self {
        self.values.push(value);
        self
    }

    /// The statement's answer `T` (its rows, its first row, or the rows it changed).
    pub(crate) async fn send<T: Answer>(
        self,
        sending: Sending,
        conn: &mut PgConnection,
    ) -> Result<T, sqlx::Error> {
        match sending.pooling {
            PgPooling::Transaction => {
                let mut tx = sending.begin(conn).await?;
                let answer = T::of(self.unnamed(), &mut tx).await?;
                tx.commit().await?;
                Ok(answer)
            }
            _ => T::of(self.prepared(), conn).await,
        }
    }

    fn prepared(self) -> Query<'a> {
        let mut query = sqlx::query(AssertSqlSafe(self.sql.clone()));
        for value in self.values {
            query = match value {
                Value::Text(v) => query.bind(v),
                Value::Texts(v) => query.bind(v),
                Value::Uuid(v) => query.bind(v),
                Value::Uuids(v) => query.bind(v),
                Value::Int8(v) => query.bind(v),
                Value::Int8s(v) => query.bind(v),
                Value::Int4(v) => query.bind(v),
                Value::Int4s(v) => query.bind(v),
            };
        }
        query
    }

    /// The statement unnamed: prepared for this one call only.
    fn unnamed(self) -> Query<'a> {
        self.prepared().persistent(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &[&str] = &["statement_timeout", "lock_timeout"];

    #[test]
    fn a_limit_the_startup_options_give_is_kept_and_only_that_one() {
        let limit = Duration::from_secs(2);
        assert_eq!(
            session_bounds(limit, None, LIMITS),
            "SET statement_timeout = 2000; SET lock_timeout = 2000"
        );
        // `deadlock_timeout` ends in `lock_timeout=`, and is another setting.
        assert_eq!(
            session_bounds(limit, Some("-c deadlock_timeout=5s"), LIMITS),
            "SET statement_timeout = 2000; SET lock_timeout = 2000"
        );
        for given in [
            "-c lock_timeout=45s",
            "-clock_timeout=45s",
            "--lock-timeout=45s",
            "-c search_path=x -c lock_timeout=45s",
        ] {
            assert_eq!(
                session_bounds(limit, Some(given), LIMITS),
                "SET statement_timeout = 2000",
                "{given}"
            );
        }
    }
}
