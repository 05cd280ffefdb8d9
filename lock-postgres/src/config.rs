//! [`PgBuilder`]: the connection settings both backends share, validated in one place.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{LockBackend, LockError, redact_url, trusted_for};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::advisory::PgAdvisoryBackend;
use crate::client::PgClient;
use crate::lease_table::PgLeaseBackend;
use crate::pooling::PgPooling;
use crate::retention::{DEFAULT_TOKEN_RETENTION, MAX_TOKEN_RETENTION, MIN_TOKEN_RETENTION};
use crate::schema::{DEFAULT_SCHEMA, Schema};
use crate::statement::{SESSION_LIMITS, bound_session};

/// A pooled connection idle for longer than this is pinged before a call uses it.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// The largest pool a builder accepts.
pub const MAX_POOL_SIZE: u32 = 1_000;

/// The query parameters of a URL that the driver reads: libpq's names and the driver's
/// spellings of the TLS ones; `options[NAME]` as well (see [`is_url_param`]). The driver
/// would log any other parameter with its value, so the builder refuses them.
pub const URL_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// True for a query parameter the driver reads: one of [`URL_PARAMS`] or `options[NAME]`.
pub fn is_url_param(name: &str) -> bool {
    URL_PARAMS.contains(&name) || (name.starts_with("options[") && name.ends_with(']'))
}

/// Which of the two backends [`PgBuilder::build`] opens (`?mode=` in a URL).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PgMode {
    /// [`PgLeaseBackend`], the default (`mode=lease`).
    #[default]
    Lease,
    /// [`PgAdvisoryBackend`] (`mode=advisory`).
    Advisory,
}

impl PgLeaseBackend {
    /// Settings for the server at `url`; see [`PgBuilder`].
    pub fn builder(url: impl Into<String>) -> PgBuilder {
        PgBuilder::new(url)
    }
}

impl PgAdvisoryBackend {
    /// Settings for the server at `url`; see [`PgBuilder`].
    pub fn builder(url: impl Into<String>) -> PgBuilder {
        PgBuilder::new(url)
    }
}

/// Settings for [`PgLeaseBackend`] and [`PgAdvisoryBackend`]: URL, backend, pool size,
/// schema, TTL bounds and time limits. `Debug` hides the password.
///
/// [`build`](Self::build) validates everything (a [`LockError::Config`] before anything
/// is sent), opens the backend the [mode](Self::mode) names, and connects: it opens the
/// pool's connections and checks that the tables exist, so a server that is down is a
/// [`LockError::Unavailable`] there, not at the first lock.
///
/// [`build_lease_backend`](Self::build_lease_backend) and
/// [`build_advisory_backend`](Self::build_advisory_backend) validate the same way but
/// open no connection (the pool connects on first use) and give the backend's own type:
/// for `setup()`, which must run before the tables exist, and for the backend's pool or
/// lock ids. Call the backend's `connect()` to open the connections then.
///
/// ```
/// use std::time::Duration;
/// use distlock::postgres::PgBuilder;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let backend = PgBuilder::new("postgres://app:secret@127.0.0.1:5432/app")
///     .schema("locks")
///     .pool_size(8)
///     .ttl_bounds(Duration::from_millis(100), Duration::from_secs(600))
///     .build_lease_backend()
///     .unwrap();
/// assert!(!format!("{backend:?}").contains("secret"));
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until `build().await`"]
pub struct PgBuilder {
    url: String,
    pub(crate) mode: PgMode,
    schema: String,
    pool_size: u32,
    min_ttl: Duration,
    max_ttl: Duration,
    connect_timeout: Duration,
    request_timeout: Duration,
    token_retention: Duration,
    pooling: PgPooling,
}

impl PgBuilder {
    /// Settings for the server at `url` (`postgres://user:password@host:port/database`,
    /// with PostgreSQL's own connection parameters only; [`from_url`](Self::from_url)
    /// also reads distlock's), for the lease-table backend, with schema
    /// [`DEFAULT_SCHEMA`], 10 connections, TTLs from 10 ms to 24 h, 5 s connect and
    /// request time limits, and free token rows kept for [`DEFAULT_TOKEN_RETENTION`].
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            mode: PgMode::Lease,
            schema: DEFAULT_SCHEMA.to_owned(),
            pool_size: 10,
            min_ttl: Duration::from_millis(10),
            max_ttl: Duration::from_secs(24 * 3600),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            token_retention: DEFAULT_TOKEN_RETENTION,
            pooling: PgPooling::Session,
        }
    }

    /// Which backend [`build`](Self::build) opens (default [`PgMode::Lease`]).
    pub fn mode(mut self, mode: PgMode) -> Self {
        self.mode = mode;
        self
    }

    /// The schema holding the tables (validated by [`Schema::new`]).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The most connections the backend opens. For the advisory backend this is also the
    /// most locks it can hold at once (each held lock pins a connection); it opens one more
    /// connection for `setup` and `inspect`.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// The shortest and longest TTL the backend accepts, in whole milliseconds.
    pub fn ttl_bounds(mut self, min: Duration, max: Duration) -> Self {
        self.min_ttl = min;
        self.max_ttl = max;
        self
    }

    /// How long getting a connection may take before a call fails with `Unavailable`.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a sent request may wait for its reply before the call fails with
    /// `OutcomeUnknown` (writes) or `Unavailable` (reads).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How long the row of a lock name nobody holds is kept after its last grant
    /// (default [`DEFAULT_TOKEN_RETENTION`], 24 h; from [`MIN_TOKEN_RETENTION`] to
    /// [`MAX_TOKEN_RETENTION`]). With a lock per job id, each name leaves a row behind;
    /// acquires start a sweep in the background, at most once per a 24th of the
    /// retention (between 1 s and 1 h), that deletes free rows whose token is older than
    /// the retention. Tokens still never go back: a name's next token is at least the
    /// server's clock in microseconds, past a deleted token by the retention, so only a
    /// server clock stepped back by more than the retention could repeat one.
    pub fn token_retention(mut self, retention: Duration) -> Self {
        self.token_retention = retention;
        self
    }

    /// Whether client connections keep their server sessions (default
    /// [`PgPooling::Session`]): [`PgPooling::Transaction`] behind a proxy that pools server
    /// sessions per transaction (PgBouncer `pool_mode = transaction`), for the lease table
    /// only. With the default, both backends check before their first call that sessions
    /// are kept, and fail with [`LockError::Config`] naming this setting when they are not.
    pub fn pooling(mut self, pooling: PgPooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// Validates the settings, opens the backend of the [mode](Self::mode), opens its
    /// pool's connections and checks that its tables exist.
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for invalid settings, a refused login or a database without
    /// `setup()`; [`LockError::Unavailable`] when the server cannot be reached.
    pub async fn build(self) -> Result<Arc<dyn LockBackend>, LockError> {
        match self.mode {
            PgMode::Lease => {
                let backend = self.build_lease_backend()?;
                backend.connect().await?;
                Ok(Arc::new(backend))
            }
            PgMode::Advisory => {
                let backend = self.build_advisory_backend()?;
                backend.connect().await?;
                Ok(Arc::new(backend))
            }
        }
    }

    /// Builds the lease-table backend without connecting (whatever the mode).
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for invalid settings.
    pub fn build_lease_backend(&self) -> Result<PgLeaseBackend, LockError> {
        Ok(PgLeaseBackend::from_client(self.client(self.pool_size)?))
    }

    /// Builds the advisory-lock backend without connecting (whatever the mode).
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for invalid settings, and for [`PgPooling::Transaction`]: an
    /// advisory lock lives in its server session, which a transaction pooler shares.
    pub fn build_advisory_backend(&self) -> Result<PgAdvisoryBackend, LockError> {
        if self.pooling == PgPooling::Transaction {
            return Err(LockError::Config(
                "the advisory backend cannot work behind a transaction-pooling proxy \
                 (pooling=transaction): an advisory lock lives in its server session. Use \
                 the lease table (mode=lease), or connect directly or through a \
                 session-mode pool (pool_mode = session)"
                    .into(),
            ));
        }
        // One connection more than the lock capacity, so setup and inspect still work
        // when every lock slot is pinned.
        let client = self.client(self.pool_size.saturating_add(1))?;
        Ok(PgAdvisoryBackend::from_client(client, self.pool_size))
    }

    pub(crate) fn client(&self, max_connections: u32) -> Result<PgClient, LockError> {
        let schema = Schema::new(&self.schema)?;
        if self.pool_size == 0 || self.pool_size > MAX_POOL_SIZE {
            return Err(LockError::Config(format!(
                "pool size {} is out of range 1..={MAX_POOL_SIZE}",
                self.pool_size
            )));
        }
        self.check_ttl_bounds()?;
        for (what, t) in [
            ("connect timeout", self.connect_timeout),
            ("request timeout", self.request_timeout),
        ] {
            if t.is_zero() {
                return Err(LockError::Config(format!(
                    "the {what} must be greater than zero"
                )));
            }
        }
        if !(MIN_TOKEN_RETENTION..=MAX_TOKEN_RETENTION).contains(&self.token_retention) {
            return Err(LockError::Config(format!(
                "token retention {:?} is out of range {MIN_TOKEN_RETENTION:?}..={MAX_TOKEN_RETENTION:?}",
                self.token_retention
            )));
        }
        let options = connect_options(&self.url)?;
        // No ping on every checkout: it would double every call's round trips. Only a
        // connection idle for longer than `PING_IF_IDLE_FOR` is pinged first, as the server
        // (`idle_session_timeout`) or the network may have ended it meanwhile; under load
        // none is.
        let mut pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(self.connect_timeout)
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > PING_IF_IDLE_FOR {
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            });
        if self.pooling == PgPooling::Session {
            // The server bounds every statement and transaction of the session by the
            // request time limit (see `PgPooling::Session`). Session settings only where
            // the session is the connection's own: behind a transaction pooler they would
            // stay on a server session other clients are given.
            let limit = self.request_timeout;
            let startup: Option<Arc<str>> = options.get_options().map(Into::into);
            pool = pool.after_connect(move |conn, _meta| {
                let startup = startup.clone();
                Box::pin(async move {
                    bound_session(conn, limit, startup.as_deref(), SESSION_LIMITS).await
                })
            });
        }
        let pool = pool.connect_lazy_with(options);
        Ok(PgClient {
            pool,
            schema,
            pool_size: max_connections,
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
            min_ttl: self.min_ttl,
            max_ttl: self.max_ttl,
            token_retention: self.token_retention,
            pooling: self.pooling,
            url: redact_url(&self.url),
        })
    }

    fn check_ttl_bounds(&self) -> Result<(), LockError> {
        let whole_ms = |d: Duration| d.as_nanos() % 1_000_000 == 0;
        // The advisory backend hands the TTL to `idle_session_timeout`, a 32-bit count of ms.
        let limit = Duration::from_millis(i32::MAX as u64);
        if trusted_for(self.min_ttl).is_zero()
            || self.min_ttl > self.max_ttl
            || self.max_ttl > limit
            || !whole_ms(self.min_ttl)
            || !whole_ms(self.max_ttl)
        {
            return Err(LockError::Config(format!(
                "TTL bounds {:?}..={:?} are invalid: both must be whole milliseconds, \
                 min <= max <= {limit:?}, and min a TTL a lease is trusted for at all \
                 (3 ms or more)",
                self.min_ttl, self.max_ttl
            )));
        }
        Ok(())
    }
}

impl fmt::Debug for PgBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgBuilder")
            .field("url", &redact_url(&self.url))
            .field("mode", &self.mode)
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("min_ttl", &self.min_ttl)
            .field("max_ttl", &self.max_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("token_retention", &self.token_retention)
            .field("pooling", &self.pooling)
            .finish()
    }
}

/// Parses a `postgres://` URL without ever echoing it (it may hold a password).
fn connect_options(url: &str) -> Result<PgConnectOptions, LockError> {
    let parsed = url::Url::parse(url)
        .map_err(|e| LockError::Config(format!("malformed PostgreSQL URL: {e}")))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(LockError::Config(format!(
            "unsupported URL scheme {:?}: expected postgres:// or postgresql://",
            parsed.scheme()
        )));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(LockError::Config(
            "malformed PostgreSQL URL: no host".into(),
        ));
    }
    if let Some((name, _)) = parsed.query_pairs().find(|(name, _)| !is_url_param(name)) {
        // Named unless it may be a piece of the password: an unescaped `?` in the password
        // makes what follows read as the query.
        let which = if distlock_core::url_userinfo_is_ambiguous(url) {
            "a parameter (not named: an `@` after the host may mean the password holds an \
             unescaped `/`, `?` or `#`; escape them and `@` as %2F, %3F, %23, %40)"
                .to_owned()
        } else {
            format!("parameter `{name}`")
        };
        return Err(LockError::Config(format!(
            "the PostgreSQL URL has {which} the driver does not read; it reads {}",
            URL_PARAMS.join(", ")
        )));
    }
    let options = PgConnectOptions::from_str(url).map_err(|e| {
        // sqlx's parse errors describe the offending part, never the whole URL.
        LockError::Config(format!("malformed PostgreSQL URL: {e}"))
    })?;
    // No `extra_float_digits` startup parameter (sqlx sends one by default): PgBouncer
    // tracks only a few parameters and, unless its `ignore_startup_parameters` lists it,
    // refuses a connection that sends any other. The backends read no floating-point
    // value, so the server's default precision changes nothing.
    Ok(options
        .application_name("distlock")
        .extra_float_digits(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// URLs whose password is in the userinfo, holding each character that ends a URL part,
    /// or in a password-like query parameter.
    fn urls_with_a_password() -> Vec<String> {
        let mut urls: Vec<String> = ['@', '#', '?', '/', ',', '%', ':', '&']
            .iter()
            .map(|c| format!("postgres://app:hun{c}ter2@db:5432/jobs?sslmode=disable"))
            .collect();
        for name in ["password", "sslpassword", "Password"] {
            urls.push(format!(
                "postgres://app@db:5432/jobs?{name}=hunter2&sslmode=disable"
            ));
        }
        urls
    }

    #[tokio::test]
    async fn debug_of_the_builder_and_backends_never_shows_the_password() {
        for url in urls_with_a_password() {
            let builder = PgBuilder::new(&url);
            assert!(
                format!("{builder:?}").contains("@db:5432/jobs"),
                "{builder:?}"
            );
            let lease = builder.build_lease_backend();
            let advisory = builder.build_advisory_backend();
            for shown in [
                format!("{builder:?}"),
                format!("{lease:?}"),
                format!("{advisory:?}"),
            ] {
                assert!(!shown.contains("ter2"), "{url}: {shown}");
            }
        }
    }

    #[test]
    fn bad_settings_are_config_errors_that_never_show_the_password() {
        let cases = [
            PgBuilder::new("not a url :s3cret"),
            PgBuilder::new("mysql://u:s3cret@h/db"),
            PgBuilder::new("postgres://u:s3cret@h/db").schema("Bad-Name"),
            PgBuilder::new("postgres://u:s3cret@h/db").pool_size(0),
            PgBuilder::new("postgres://u:s3cret@h/db")
                .ttl_bounds(Duration::from_secs(2), Duration::from_secs(1)),
            PgBuilder::new("postgres://u:s3cret@h/db")
                .ttl_bounds(Duration::from_micros(1500), Duration::from_secs(1)),
            PgBuilder::new("postgres://u:s3cret@h/db").request_timeout(Duration::ZERO),
            PgBuilder::new("postgres://u:s3cret@h/db").token_retention(Duration::ZERO),
            PgBuilder::new("postgres://u:s3cret@h/db")
                .token_retention(MIN_TOKEN_RETENTION - Duration::from_millis(1)),
            PgBuilder::new("postgres://u:s3cret@h/db")
                .token_retention(MAX_TOKEN_RETENTION + Duration::from_secs(1)),
            PgBuilder::new("postgres://u@h/db?password=s3cret").pool_size(0),
            // The driver would log a parameter it does not read, value and all.
            PgBuilder::new("postgres://u@h/db?sslpassword=s3cret"),
            PgBuilder::new("postgres://u:12?s3cret=x@h/db"),
        ];
        for b in cases {
            for built in [
                b.build_lease_backend().map(drop),
                b.build_advisory_backend().map(drop),
            ] {
                let err = built.unwrap_err();
                assert!(matches!(err, LockError::Config(_)), "{b:?}: {err}");
                assert!(!err.to_string().contains("s3cret"), "{err}");
            }
            assert!(!format!("{b:?}").contains("s3cret"));
        }
    }

    #[tokio::test]
    async fn a_parameter_the_driver_does_not_read_is_refused_by_name() {
        let err = PgBuilder::new("postgres://u@h/db?sslmode=disable&sslpassword=hunter2")
            .build_lease_backend()
            .unwrap_err();
        assert!(err.to_string().contains("`sslpassword`"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        PgBuilder::new("postgres://u@h/db?sslmode=disable&options[statement_timeout]=5s")
            .build_lease_backend()
            .unwrap();
    }
}
