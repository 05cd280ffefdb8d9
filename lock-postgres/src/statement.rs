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
//! # Cancel safety
//! A call dropped inside its transaction leaves it to be rolled back: sqlx queues the
//! `ROLLBACK` on the connection, and it is sent before the connection's next use.

use std::sync::Arc;

use sqlx::postgres::{PgConnection, PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Connection, Postgres};
use uuid::Uuid;

use crate::PgPooling;

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

    /// Every row.
    pub(crate) async fn fetch_all(
        self,
        pooling: PgPooling,
        conn: &mut PgConnection,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        match pooling {
            PgPooling::Transaction => {
                let mut tx = conn.begin().await?;
                let rows = self.unnamed().fetch_all(&mut *tx).await?;
                tx.commit().await?;
                Ok(rows)
            }
            _ => self.prepared().fetch_all(conn).await,
        }
    }

    /// The first row, if any.
    pub(crate) async fn fetch_optional(
        self,
        pooling: PgPooling,
        conn: &mut PgConnection,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        match pooling {
            PgPooling::Transaction => {
                let mut tx = conn.begin().await?;
                let row = self.unnamed().fetch_optional(&mut *tx).await?;
                tx.commit().await?;
                Ok(row)
            }
            _ => self.prepared().fetch_optional(conn).await,
        }
    }

    /// Runs it for the rows it changed.
    pub(crate) async fn execute(
        self,
        pooling: PgPooling,
        conn: &mut PgConnection,
    ) -> Result<PgQueryResult, sqlx::Error> {
        match pooling {
            PgPooling::Transaction => {
                let mut tx = conn.begin().await?;
                let done = self.unnamed().execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(done)
            }
            _ => self.prepared().execute(conn).await,
        }
    }

    fn prepared(self) -> sqlx::query::Query<'a, Postgres, sqlx::postgres::PgArguments> {
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
    fn unnamed(self) -> sqlx::query::Query<'a, Postgres, sqlx::postgres::PgArguments> {
        self.prepared().persistent(false)
    }
}
