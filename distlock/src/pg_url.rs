//! `postgres://` and `postgresql://` URLs: the query parameters distlock reads (which
//! backend, schema, pool size) are taken out, the rest is PostgreSQL's own connection
//! settings and goes to the driver untouched.
//!
//! A parameter that is neither is refused rather than ignored, so a typo such as
//! `?mdoe=advisory` cannot silently give the other backend. Messages name parameters,
//! never their values, because `password=` may be one of them.

use std::sync::Arc;

use lock_api::{LockBackend, LockError};
use lock_postgres::{PgBuilder, URL_PARAMS, is_url_param};
use url::Url;

/// The query parameters distlock reads from a PostgreSQL URL.
pub(crate) const DISTLOCK_PARAMS: &[&str] = &["mode", "schema", "pool_size"];

/// Which PostgreSQL backend a URL asks for (`?mode=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `mode=lease` (the default): [`lock_postgres::PgLeaseBackend`].
    Lease,
    /// `mode=advisory`: [`lock_postgres::PgAdvisoryBackend`].
    Advisory,
}

/// A PostgreSQL URL split into the backend it asks for and the builder for it.
#[derive(Debug)]
pub(crate) struct PgUrl {
    pub(crate) mode: Mode,
    pub(crate) builder: PgBuilder,
}

impl PgUrl {
    /// Reads distlock's parameters out of `url` and checks the rest.
    pub(crate) fn parse(url: &Url) -> Result<Self, LockError> {
        let mut mode = None;
        let mut schema = None;
        let mut pool_size = None;
        let mut driver = url.clone();
        driver.set_query(None);
        let mut passed = Vec::new();
        for (name, value) in url.query_pairs() {
            let slot = match &*name {
                "mode" => &mut mode,
                "schema" => &mut schema,
                "pool_size" => &mut pool_size,
                other if is_url_param(other) => {
                    passed.push((name.clone(), value.clone()));
                    continue;
                }
                other => return Err(unknown_param(other, url)),
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
            None | Some("lease") => Mode::Lease,
            Some("advisory") => Mode::Advisory,
            Some(_) => {
                return Err(LockError::Config(
                    "unknown postgres mode: expected mode=lease (the default) or mode=advisory"
                        .into(),
                ));
            }
        };
        let mut builder = PgBuilder::new(driver.as_str());
        if let Some(schema) = schema {
            builder = builder.schema(schema);
        }
        if let Some(size) = pool_size {
            let size: u32 = size.parse().map_err(|_| {
                LockError::Config("pool_size is not a whole number of connections".into())
            })?;
            builder = builder.pool_size(size);
        }
        Ok(Self { mode, builder })
    }

    /// Builds the backend, opens its connections and checks its tables exist.
    pub(crate) async fn open(self) -> Result<Arc<dyn LockBackend>, LockError> {
        match self.mode {
            Mode::Lease => {
                let backend = self.builder.build_lease_backend()?;
                backend.connect().await?;
                Ok(Arc::new(backend))
            }
            Mode::Advisory => {
                let backend = self.builder.build_advisory_backend()?;
                backend.connect().await?;
                Ok(Arc::new(backend))
            }
        }
    }

    /// Creates the schema and tables (both backends' tables, and those of the SQL
    /// fencing and idempotency helpers). Idempotent.
    pub(crate) async fn setup(self) -> Result<(), LockError> {
        self.builder.build_lease_backend()?.setup().await
    }
}

/// The error for an unknown parameter, naming it unless it may be a piece of the password
/// (an unescaped `?` in the password makes what follows read as the query).
fn unknown_param(name: &str, url: &Url) -> LockError {
    let which = if lock_api::url_userinfo_is_ambiguous(url.as_str()) {
        "in the postgres URL (not named: an `@` after the host may mean the password holds \
         an unescaped `/`, `?` or `#`; escape them and `@` as %2F, %3F, %23, %40)"
            .to_owned()
    } else {
        format!("`{name}` in the postgres URL")
    };
    LockError::Config(format!(
        "unknown parameter {which}: distlock reads {}; \
         PostgreSQL connection parameters passed on are {}",
        DISTLOCK_PARAMS.join(", "),
        URL_PARAMS.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<PgUrl, LockError> {
        PgUrl::parse(&Url::parse(url).unwrap())
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
        assert_eq!(parse("postgres://u@h/db").unwrap().mode, Mode::Lease);
        assert_eq!(
            parse("postgres://u@h/db?mode=lease").unwrap().mode,
            Mode::Lease
        );
        assert_eq!(
            parse("postgresql://u@h/db?mode=advisory").unwrap().mode,
            Mode::Advisory
        );
    }

    #[test]
    fn distlock_params_are_stripped_and_driver_params_kept() {
        let parsed =
            parse("postgres://u:pw@h:5432/db?mode=advisory&sslmode=disable&schema=jobs&pool_size=3&options[statement_timeout]=5s")
                .unwrap();
        let shown = format!("{:?}", parsed.builder);
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
        for name in DISTLOCK_PARAMS {
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
            parsed.builder.build_lease_backend(),
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
}
