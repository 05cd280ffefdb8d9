//! [`PgBuilder::from_url`] and [`PgBuilder::from_env`]: the query parameters distlock
//! reads from a `postgres://` URL (which backend, schema, pool size) are taken out, the
//! rest is PostgreSQL's own connection settings and goes to the driver untouched.
//!
//! A parameter that is neither is refused rather than ignored, so a typo such as
//! `?mdoe=advisory` cannot silently give the other backend. Messages name parameters,
//! never their values, because `password=` may be one of them.

use distlock_core::LockError;
use url::Url;

use crate::config::{PgBuilder, PgMode, URL_PARAMS, is_url_param};
use crate::pooling::PgPooling;

/// The query parameters [`PgBuilder::from_url`] reads (and removes) from a URL.
pub const PARAMS: &[&str] = &["mode", "schema", "pool_size", "pooling"];

/// The environment variable [`PgBuilder::from_env`] reads the URL from.
pub const POSTGRES_URL_ENV: &str = "DISTLOCK_POSTGRES_URL";

impl PgBuilder {
    /// Settings for the server a `postgres://` (or `postgresql://`) URL names:
    /// `postgres://user[:password]@host[:port]/db[?mode=lease|advisory&schema=NAME&pool_size=N&pooling=session|transaction]`.
    ///
    /// Four query parameters are distlock's and are removed before the URL reaches the
    /// driver:
    ///
    /// - `mode=lease` (the default) builds [`PgLeaseBackend`](crate::PgLeaseBackend),
    ///   `mode=advisory` [`PgAdvisoryBackend`](crate::PgAdvisoryBackend) (see
    ///   [`mode`](Self::mode));
    /// - `schema=NAME`: the schema of the tables (see [`schema`](Self::schema));
    /// - `pool_size=N`: the most connections (see [`pool_size`](Self::pool_size));
    /// - `pooling=session` (the default) or `pooling=transaction` behind a proxy that
    ///   pools server sessions per transaction, such as PgBouncer `pool_mode =
    ///   transaction` (see [`pooling`](Self::pooling)).
    ///
    /// PostgreSQL's own connection parameters ([`URL_PARAMS`]: `sslmode`,
    /// `sslrootcert`, `application_name`, `options`, ...) pass through; any other
    /// parameter is refused.
    ///
    /// ```
    /// let builder = distlock::postgres::PgBuilder::from_url(
    ///     "postgres://app:s3cret@db/jobs?mode=advisory&pool_size=4&sslmode=require",
    /// )?;
    /// assert!(!format!("{builder:?}").contains("s3cret"));
    /// # Ok::<(), distlock::LockError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for a malformed URL, another scheme, an unknown or repeated
    /// parameter or a bad value; the message names the parameter, never its value.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        let url = Url::parse(url.trim())
            .map_err(|e| LockError::Config(format!("malformed PostgreSQL URL: {e}")))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(LockError::Config(
                "a PostgreSQL URL starts with postgres:// or postgresql://".into(),
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(LockError::Config(
                "the postgres:// URL has no host: write postgres://user@host/db".into(),
            ));
        }
        let mut mode = None;
        let mut schema = None;
        let mut pool_size = None;
        let mut pooling = None;
        let mut driver = url.clone();
        driver.set_query(None);
        let mut passed = Vec::new();
        for (name, value) in url.query_pairs() {
            let slot = match &*name {
                "mode" => &mut mode,
                "schema" => &mut schema,
                "pool_size" => &mut pool_size,
                "pooling" => &mut pooling,
                other if is_url_param(other) => {
                    passed.push((name.clone(), value.clone()));
                    continue;
                }
                other => return Err(unknown_param(other, &url)),
            };
            if slot.replace(value.into_owned()).is_some() {
                return Err(LockError::Config(format!(
                    "the postgres URL sets `{name}` more than once"
                )));
            }
        }
        if !passed.is_empty() {
            driver.query_pairs_mut().extend_pairs(passed);
        }
        let mode = match mode.as_deref() {
            None | Some("lease") => PgMode::Lease,
            Some("advisory") => PgMode::Advisory,
            Some(_) => {
                return Err(LockError::Config(
                    "unknown postgres mode: expected mode=lease (the default) or mode=advisory"
                        .into(),
                ));
            }
        };
        let pooling = match pooling.as_deref() {
            None | Some("session") => PgPooling::Session,
            Some("transaction") => PgPooling::Transaction,
            Some(_) => {
                return Err(LockError::Config(
                    "unknown postgres pooling: expected pooling=session (the default) or \
                     pooling=transaction (behind PgBouncer pool_mode = transaction)"
                        .into(),
                ));
            }
        };
        let mut builder = PgBuilder::new(driver.as_str()).mode(mode).pooling(pooling);
        if let Some(schema) = schema {
            builder = builder.schema(schema);
        }
        if let Some(size) = pool_size {
            let size: u32 = size.parse().map_err(|_| {
                LockError::Config("pool_size is not a whole number of connections".into())
            })?;
            builder = builder.pool_size(size);
        }
        Ok(builder)
    }

    /// [`from_url`](Self::from_url) with the URL in the environment variable
    /// `DISTLOCK_POSTGRES_URL` ([`POSTGRES_URL_ENV`]).
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] naming the variable when it is unset, empty or not UTF-8;
    /// otherwise those of [`from_url`](Self::from_url).
    pub fn from_env() -> Result<Self, LockError> {
        Self::from_env_with(|name| std::env::var(name))
    }

    /// [`from_env`](Self::from_env) with the variable read by `lookup`.
    pub(crate) fn from_env_with(
        lookup: impl FnOnce(&str) -> Result<String, std::env::VarError>,
    ) -> Result<Self, LockError> {
        distlock_core::builder_from_env(
            POSTGRES_URL_ENV,
            "a postgres:// URL",
            lookup,
            Self::from_url,
        )
    }
}

/// The error for an unknown parameter, naming it unless it may be a piece of the password
/// (an unescaped `?` in the password makes what follows read as the query).
fn unknown_param(name: &str, url: &Url) -> LockError {
    let which = if distlock_core::url_userinfo_is_ambiguous(url.as_str()) {
        "in the postgres URL (not named: an `@` after the host may mean the password holds \
         an unescaped `/`, `?` or `#`; escape them and `@` as %2F, %3F, %23, %40)"
            .to_owned()
    } else {
        format!("`{name}` in the postgres URL")
    };
    LockError::Config(format!(
        "unknown parameter {which}: distlock reads {}; \
         PostgreSQL connection parameters passed on are {}",
        PARAMS.join(", "),
        URL_PARAMS.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<PgBuilder, LockError> {
        PgBuilder::from_url(url)
    }

    fn config_error(url: &str) -> String {
        match parse(url) {
            Ok(parsed) => panic!("{url} parsed as {parsed:?}"),
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("{url}: expected a configuration error, got {other}"),
        }
    }

    #[test]
    fn the_mode_defaults_to_the_lease_table() {
        assert_eq!(parse("postgres://u@h/db").unwrap().mode, PgMode::Lease);
        assert_eq!(
            parse("postgres://u@h/db?mode=lease").unwrap().mode,
            PgMode::Lease
        );
        assert_eq!(
            parse("postgresql://u@h/db?mode=advisory").unwrap().mode,
            PgMode::Advisory
        );
    }

    #[test]
    fn pooling_defaults_to_session_and_transaction_is_read() {
        let shown = |url: &str| format!("{:?}", parse(url).unwrap());
        assert!(shown("postgres://u@h/db").contains("pooling: Session"));
        assert!(shown("postgres://u@h/db?pooling=session").contains("pooling: Session"));
        let transaction = shown("postgres://u@h/db?pooling=transaction&sslmode=disable");
        assert!(
            transaction.contains("pooling: Transaction"),
            "{transaction}"
        );
        assert!(
            !transaction.contains("pooling=transaction"),
            "{transaction}"
        );
        assert!(
            config_error("postgres://u@h/db?pooling=statement").contains("pooling=transaction")
        );
        assert!(
            config_error("postgres://u@h/db?pooling=session&pooling=transaction")
                .contains("`pooling`")
        );
        assert!(config_error("postgres://u@h/db?pool_mode=transaction").contains("`pool_mode`"));
        // The advisory backend needs sessions: refused before anything is opened.
        let Err(LockError::Config(message)) =
            parse("postgres://u@h/db?mode=advisory&pooling=transaction")
                .unwrap()
                .build_advisory_backend()
        else {
            panic!("the advisory backend was built for a transaction pooler");
        };
        assert!(message.contains("pooling=transaction"), "{message}");
    }

    #[test]
    fn distlock_params_are_stripped_and_driver_params_kept() {
        let parsed =
            parse("postgres://u:pw@h:5432/db?mode=advisory&sslmode=disable&schema=jobs&pool_size=3&options[statement_timeout]=5s")
                .unwrap();
        let shown = format!("{parsed:?}");
        assert!(shown.contains("sslmode=disable"), "{shown}");
        assert!(
            shown.contains("options%5Bstatement_timeout%5D=5s"),
            "{shown}"
        );
        assert!(!shown.contains("mode=advisory"), "{shown}");
        assert!(!shown.contains("pool_size=3&"), "{shown}");
        assert!(shown.contains("schema: \"jobs\""), "{shown}");
        assert!(shown.contains("pool_size: 3"), "{shown}");
        assert!(!shown.contains(":pw@"), "{shown}");
    }

    #[test]
    fn an_unknown_param_is_refused_and_the_known_ones_are_listed() {
        let message = config_error("postgres://u@h/db?mdoe=advisory");
        assert!(message.contains("`mdoe`"), "{message}");
        for name in PARAMS {
            assert!(message.contains(name), "{message}");
        }
        assert!(message.contains("sslmode"), "{message}");
    }

    #[test]
    fn bad_values_are_config_errors() {
        assert!(config_error("postgres://u@h/db?mode=session").contains("mode=advisory"));
        assert!(config_error("postgres://u@h/db?pool_size=lots").contains("pool_size"));
        assert!(config_error("postgres://u@h/db?mode=lease&mode=advisory").contains("`mode`"));
        let parsed = parse("postgres://u@h/db?schema=Bad-Name").unwrap();
        assert!(matches!(
            parsed.build_lease_backend(),
            Err(LockError::Config(_))
        ));
    }

    #[test]
    fn debug_never_shows_a_password_given_as_a_parameter() {
        for url in [
            "postgres://app@h/db?password=hunter2",
            "postgres://app@h/db?mode=advisory&password=hunter2&sslmode=disable",
            "postgres://app:hun@ter2@h/db?sslmode=disable",
            "postgres://app:hun,ter2@h/db",
        ] {
            let shown = format!("{:?}", parse(url).unwrap());
            assert!(!shown.contains("ter2"), "{url}: {shown}");
            assert!(shown.contains("@h/db"), "{url}: {shown}");
        }
    }

    #[test]
    fn a_parameter_that_may_be_part_of_the_password_is_not_named() {
        let message = config_error("postgres://app:12?hunter2=x@h/db");
        assert!(
            message.contains("unknown parameter in the postgres URL (not named"),
            "{message}"
        );
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn errors_name_the_parameter_never_its_value() {
        for url in [
            "postgres://u@h/db?secretive=hunter2",
            "postgres://u@h/db?password=hunter2&mode=hunter2",
            "postgres://u@h/db?pool_size=hunter2",
        ] {
            let message = config_error(url);
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
    }

    #[test]
    fn from_env_reads_the_url_and_names_a_missing_variable() {
        use std::env::VarError;
        let builder = PgBuilder::from_env_with(|name| {
            assert_eq!(name, POSTGRES_URL_ENV);
            Ok("postgres://app:hunter2@h/db?mode=advisory".into())
        })
        .unwrap();
        assert_eq!(builder.mode, PgMode::Advisory);
        for found in [
            Err(VarError::NotPresent),
            Err(VarError::NotUnicode("x".into())),
            Ok(String::new()),
        ] {
            let Err(LockError::Config(message)) = PgBuilder::from_env_with(|_| found) else {
                panic!("a missing URL was accepted");
            };
            assert!(message.contains("DISTLOCK_POSTGRES_URL"), "{message}");
        }
        let Err(LockError::Config(message)) =
            PgBuilder::from_env_with(|_| Ok("postgres://app:hunter2@h/db?mdoe=x".into()))
        else {
            panic!("a bad URL was accepted");
        };
        assert!(!message.contains("hunter2"), "{message}");
    }

    #[test]
    fn a_url_of_another_store_or_without_a_host_is_refused() {
        assert!(config_error("redis://127.0.0.1:6379").contains("postgres://"));
        assert!(config_error("postgres:///db").contains("no host"));
    }
}
