//! The connection pool and time limits both backends share, and the one helper that runs
//! a statement under the request time limit.

use std::future::Future;
use std::time::Duration;

use distlock_core::{Capabilities, FencingToken, LockError, OwnerId};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use uuid::Uuid;

use crate::error::{self, Operation};
use crate::pooling::PgPooling;
use crate::schema::{self, Schema};
use crate::statement::{Answer, Sending, Statement};

/// A validated pool plus settings, made by [`crate::PgBuilder`].
#[derive(Clone)]
pub(crate) struct PgClient {
    pub(crate) pool: PgPool,
    pub(crate) schema: Schema,
    pub(crate) pool_size: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) min_ttl: Duration,
    pub(crate) max_ttl: Duration,
    /// How long a free token row is kept (`crate::retention`).
    pub(crate) token_retention: Duration,
    /// Whether connections keep their server sessions: how statements are sent.
    pub(crate) pooling: PgPooling,
    /// The URL with the password redacted.
    pub(crate) url: String,
}

/// A failed statement: the error to return, and whether its connection must be closed
/// instead of going back to the pool (broken, or left mid-request by a time-out).
pub(crate) struct Failed {
    pub(crate) error: LockError,
    pub(crate) broken: bool,
    /// The server ended the session before the statement ran.
    pub(crate) session_ended: bool,
}

impl PgClient {
    /// TTLs in whole milliseconds between the configured bounds.
    pub(crate) fn capabilities(&self) -> Capabilities {
        Capabilities::new(Duration::from_millis(1), self.min_ttl, self.max_ttl)
    }

    /// How statements are sent: the pooling, bounded by the request time limit.
    pub(crate) fn sending(&self) -> Sending {
        Sending {
            pooling: self.pooling,
            limit: self.request_timeout,
        }
    }

    /// A pooled connection; failing here means nothing was sent.
    pub(crate) async fn conn(
        &self,
        backend: &'static str,
    ) -> Result<PoolConnection<Postgres>, LockError> {
        self.pool.acquire().await.map_err(|e| {
            error::from_connect(
                backend,
                &self.schema,
                self.pool_size,
                self.connect_timeout,
                e,
            )
        })
    }

    /// A connection of its own, outside the pool, with the pool's settings. Unlike the
    /// pool, which takes a refused connection for a server starting up and tries again
    /// until its timeout (then reporting only that it timed out), it fails at once with
    /// the operating system's reason.
    pub(crate) async fn connect_direct(
        &self,
        backend: &'static str,
    ) -> Result<PgConnection, LockError> {
        let options = self.pool.connect_options();
        match tokio::time::timeout(self.connect_timeout, PgConnection::connect_with(&options)).await
        {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(error::from_connect(
                backend,
                &self.schema,
                self.pool_size,
                self.connect_timeout,
                e,
            )),
            Err(_) => Err(LockError::unavailable(
                backend,
                format!("no connection within {:?}", self.connect_timeout),
            )),
        }
    }

    /// Awaits a statement's future under the request time limit.
    pub(crate) async fn timed<T>(
        &self,
        backend: &'static str,
        op: Operation,
        statement: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, Failed> {
        match tokio::time::timeout(self.request_timeout, statement).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failed {
                broken: error::connection_broken(&e),
                session_ended: error::session_ended(&e),
                error: error::from_sqlx(backend, op, &self.schema, e),
            }),
            Err(_) => Err(Failed {
                error: error::timed_out(backend, op, self.request_timeout),
                broken: true,
                session_ended: false,
            }),
        }
    }

    /// Opens every connection of the pool now and checks that `table` exists, so a
    /// missing server, a refused login or a missing `setup()` shows at start-up, and no
    /// later call waits for a new connection to open. One connection outside the pool
    /// comes first, so a server that refuses connections is reported at once, with the
    /// reason, rather than after the pool's connect timeout.
    pub(crate) async fn warm_up(
        &self,
        backend: &'static str,
        table: &str,
    ) -> Result<(), LockError> {
        let _ = self.connect_direct(backend).await?.close().await;
        let mut conns = Vec::new();
        for _ in 0..self.pool_size {
            conns.push(self.conn(backend).await?);
        }
        if let Some(conn) = conns.first_mut() {
            let sql = self
                .schema
                .sql(&format!("SELECT 1 FROM {{s}}.{table} LIMIT 0"));
            let checked = self
                .timed(
                    backend,
                    Operation::Inspect,
                    // Simple protocol: nothing is prepared, whatever the pooling.
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut **conn),
                )
                .await;
            if let Err(failed) = checked {
                if failed.broken {
                    conn.close_on_drop();
                }
                return Err(failed.error);
            }
        }
        Ok(())
    }

    pub(crate) async fn setup(&self, backend: &'static str) -> Result<(), LockError> {
        let run = schema::setup(&self.pool, &self.schema, backend);
        match tokio::time::timeout(self.connect_timeout + self.request_timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(error::timed_out(
                backend,
                Operation::Setup,
                self.connect_timeout + self.request_timeout,
            )),
        }
    }
}

/// The server's clock in microseconds since the Unix epoch, as SQL. Every token is at
/// least this (`greatest(counter + 1, clock)`), as in the Redis backend: when a counter
/// row loses its last increments (asynchronous commit, failover to a replica that lagged)
/// or is purged, the clock has moved past the tokens that were lost, so none is reissued.
const CLOCK_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// SQL text with every `{clock_us}` replaced by the server clock in microseconds.
pub(crate) fn with_clock(template: &str) -> String {
    template.replace("{clock_us}", CLOCK_US)
}

pub(crate) fn ttl_ms(ttl: Duration) -> i64 {
    // `check_ttl` bounded it by `max_ttl`, which fits in an i32 count of milliseconds.
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn owner_uuid(owner: OwnerId) -> Uuid {
    Uuid::from_u128(owner.as_u128())
}

/// The owner id stored as `owner`; `OwnerId` has no constructor from bits, only its
/// 32-hex-digit form, which a UUID's simple form always is.
pub(crate) fn owner_from(owner: Uuid) -> Option<OwnerId> {
    OwnerId::parse(&owner.simple().to_string()).ok()
}

pub(crate) fn token_i64(token: FencingToken) -> i64 {
    // Tokens come from a bigint column, so they always fit.
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

/// A token read from a bigint column that only ever counts up (from the clock, at least 1).
pub(crate) fn token_from(v: i64) -> FencingToken {
    FencingToken(u64::try_from(v).unwrap_or(0))
}

/// Runs `statement` on `conn` under the time limit; on failure marks `conn` to be closed
/// when it is broken, so a half-used connection never goes back to the pool.
macro_rules! on_conn {
    ($client:expr, $backend:expr, $op:expr, $conn:ident, $statement:expr) => {{
        let result = $client.timed($backend, $op, $statement).await;
        match result {
            Ok(v) => Ok(v),
            Err(failed) => {
                if failed.broken {
                    $conn.close_on_drop();
                }
                Err(failed.error)
            }
        }
    }};
}
pub(crate) use on_conn;

/// One statement on a connection of the pool: what most backend calls send.
impl PgClient {
    /// `statement`'s answer `T` (its rows, its first row, or the rows it changed), sent as
    /// `op` on a connection of the pool (failing to get one sends nothing) under the time
    /// limit; a connection the failure broke is closed, not pooled again.
    pub(crate) async fn send<T: Answer>(
        &self,
        backend: &'static str,
        op: Operation,
        statement: Statement<'_>,
    ) -> Result<T, LockError> {
        let mut conn = self.conn(backend).await?;
        on_conn!(
            self,
            backend,
            op,
            conn,
            statement.send(self.sending(), &mut conn)
        )
    }
}
