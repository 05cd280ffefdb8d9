//! [`Statement`]: one of the lease table's statements with its values, sent the way the
//! [pooling](crate::PgPooling) allows.
//!
//! - [`PgPooling::Session`]: prepared once per connection (sqlx names it and keeps it on
//!   the connection), the values sent as bind parameters. One round trip per call once
//!   prepared.
//! - [`PgPooling::Transaction`]: one simple-protocol query, the values written into the
//!   text. Also one round trip, and self-contained, so a pooler may run it on any server
//!   session. Unnamed prepared statements are no way out with sqlx: it sends `Parse` and
//!   `Bind` in two syncs, and between them a transaction pooler may hand the server
//!   session to another client, whose own unnamed statement the `Bind` would then run
//!   when its parameter types match.
//!
//! # Literals
//!
//! A value never reaches the text as it is: a text is written as the hex digits of its
//! UTF-8 bytes (`convert_from(decode('6a6f62', 'hex'), 'UTF8')`), a UUID as its hyphenated
//! hex form, an integer as its decimal digits, each with its type cast. So the text holds
//! no quote, backslash or letter a value chose, whatever `standard_conforming_strings`
//! says, and the statement is the template's.

use std::fmt::Write;
use std::sync::Arc;

use sqlx::postgres::{PgConnection, PgQueryResult, PgRow};
use sqlx::{AssertSqlSafe, Postgres};
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
            PgPooling::Transaction => self.inline()?.fetch_all(conn).await,
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
            PgPooling::Transaction => self.inline()?.fetch_optional(conn).await,
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
            PgPooling::Transaction => self.inline()?.execute(conn).await,
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

    fn inline(self) -> Result<sqlx::RawSql, sqlx::Error> {
        Ok(sqlx::raw_sql(AssertSqlSafe(render(
            self.sql,
            &self.values,
        )?)))
    }
}

/// `sql` with every `$N` replaced by the literal of the N-th value. A `$N` without a value
/// is an error (a bug in the caller), never sent.
fn render(sql: &str, values: &[Value<'_>]) -> Result<String, sqlx::Error> {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        let value = after[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|n| values.get(n.checked_sub(1)?));
        match value {
            Some(value) => {
                out.push('(');
                literal(&mut out, value);
                out.push(')');
            }
            None if digits == 0 => out.push('$'),
            None => {
                return Err(sqlx::Error::Encode(
                    format!("statement parameter ${} has no value", &after[..digits]).into(),
                ));
            }
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Writes `value` as a typed literal made of hex digits, digits and SQL of our own only.
fn literal(out: &mut String, value: &Value<'_>) {
    match value {
        Value::Text(v) => text(out, v),
        Value::Texts(vs) => array(out, vs, "text", |out, v| text(out, v)),
        Value::Uuid(v) => uuid(out, v),
        Value::Uuids(vs) => array(out, vs, "uuid", uuid),
        Value::Int8(v) => {
            let _ = write!(out, "({v})::int8");
        }
        Value::Int8s(vs) => array(out, vs, "int8", |out, v| {
            let _ = write!(out, "{v}");
        }),
        Value::Int4(v) => {
            let _ = write!(out, "({v})::int4");
        }
        Value::Int4s(vs) => array(out, vs, "int4", |out, v| {
            let _ = write!(out, "{v}");
        }),
    }
}

fn text(out: &mut String, v: &str) {
    out.push_str("convert_from(decode('");
    for b in v.bytes() {
        let _ = write!(out, "{b:02x}");
    }
    out.push_str("', 'hex'), 'UTF8')");
}

fn uuid(out: &mut String, v: &Uuid) {
    let _ = write!(out, "'{}'::uuid", v.hyphenated());
}

fn array<T>(out: &mut String, vs: &[T], ty: &str, mut each: impl FnMut(&mut String, &T)) {
    out.push_str("ARRAY[");
    for (i, v) in vs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        each(out, v);
    }
    let _ = write!(out, "]::{ty}[]");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_become_literals_of_hex_digits_and_numbers() {
        let owner = Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
        let sql = render(
            "SELECT $1, $2, $3, $4 WHERE x = $1 AND y = $10",
            &[
                Value::Text("a'b\\c"),
                Value::Uuid(owner),
                Value::Int8(-5),
                Value::Int4s(vec![1, -2]),
                Value::Texts(vec![]),
                Value::Int8s(vec![]),
                Value::Uuids(vec![owner]),
                Value::Int4(7),
                Value::Texts(vec!["x", "é"]),
                Value::Int8s(vec![9]),
            ],
        )
        .unwrap();
        assert_eq!(
            sql,
            "SELECT (convert_from(decode('6127625c63', 'hex'), 'UTF8')), \
             ('01234567-89ab-cdef-0123-456789abcdef'::uuid), ((-5)::int8), \
             (ARRAY[1, -2]::int4[]) WHERE x = (convert_from(decode('6127625c63', 'hex'), 'UTF8')) \
             AND y = (ARRAY[9]::int8[])"
        );
    }

    #[test]
    fn a_parameter_without_a_value_is_an_error_and_a_lone_dollar_stays() {
        assert!(render("SELECT $2", &[Value::Int4(1)]).is_err());
        assert!(render("SELECT $0", &[Value::Int4(1)]).is_err());
        assert_eq!(render("SELECT '$'", &[]).unwrap(), "SELECT '$'");
        // The most negative value is one literal, not the negation of one out of range.
        assert_eq!(
            render("$1", &[Value::Int4(i32::MIN)]).unwrap(),
            "((-2147483648)::int4)"
        );
    }

    #[test]
    fn no_character_of_a_text_value_reaches_the_statement() {
        let nasty = "'); DROP TABLE x; --\u{2028}$1 \\' \"";
        let sql = render("SELECT $1", &[Value::Text(nasty)]).unwrap();
        let inner = sql
            .strip_prefix("SELECT (convert_from(decode('")
            .and_then(|s| s.strip_suffix("', 'hex'), 'UTF8'))"))
            .expect("one hex literal");
        assert!(inner.bytes().all(|b| b.is_ascii_hexdigit()), "{sql}");
    }
}
