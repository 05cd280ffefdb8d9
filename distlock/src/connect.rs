//! Opening a backend from a URL: [`connect`] reads the scheme, checks that the cargo
//! feature for that store is enabled, and hands the URL to the store's builder
//! (`from_url`), which reads the rest.
//!
//! Errors name what is wrong with the URL but never repeat it whole, so a password in
//! it cannot leak into a log; use [`redact_url`](crate::redact_url) to show a URL to a
//! person.

use std::fmt;
use std::sync::Arc;

use distlock_core::memory::MemoryBackend;
use distlock_core::{LockBackend, LockError};
use url::Url;

/// A store [`connect`] can open, named by the scheme of its URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `memory://`: a new in-process [`MemoryBackend`]; every call opens a separate store.
    Memory,
    /// `redis://`: one Redis server.
    Redis,
    /// `rediss://`: one Redis server over TLS.
    RedisTls,
    /// `redis+cluster://`: a Redis Cluster.
    RedisCluster,
    /// `redis+sentinel://` or `rediss+sentinel://`: the master Redis Sentinel monitors.
    RedisSentinel,
    /// `etcd://`: an etcd v3 cluster.
    Etcd,
    /// `etcds://`: an etcd v3 cluster over TLS (`?ca=` names the CA file).
    EtcdTls,
    /// `postgres://` or `postgresql://`: a PostgreSQL server.
    Postgres,
}

/// Every URL scheme [`connect`] knows, with the store it opens, in the order error
/// messages list them.
pub const SCHEMES: &[(&str, Scheme)] = &[
    ("memory", Scheme::Memory),
    ("redis", Scheme::Redis),
    ("rediss", Scheme::RedisTls),
    ("redis+cluster", Scheme::RedisCluster),
    ("redis+sentinel", Scheme::RedisSentinel),
    ("rediss+sentinel", Scheme::RedisSentinel),
    ("etcd", Scheme::Etcd),
    ("etcds", Scheme::EtcdTls),
    ("postgres", Scheme::Postgres),
    ("postgresql", Scheme::Postgres),
];

impl Scheme {
    /// The store for a URL scheme (`"redis"`, `"postgresql"`, ...), if it is a known one.
    pub fn from_name(name: &str) -> Option<Self> {
        SCHEMES
            .iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(name))
            .map(|&(_, scheme)| scheme)
    }

    /// The cargo feature of `distlock` that brings this store's backend, if one is needed.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            Self::Memory => None,
            Self::Redis | Self::RedisTls | Self::RedisCluster | Self::RedisSentinel => {
                Some("redis")
            }
            Self::Etcd | Self::EtcdTls => Some("etcd"),
            Self::Postgres => Some("postgres"),
        }
    }

    /// True when this build of `distlock` was compiled with the store's feature.
    pub fn is_enabled(self) -> bool {
        match self.feature() {
            None => true,
            Some("redis") => cfg!(feature = "redis"),
            Some("etcd") => cfg!(feature = "etcd"),
            Some("postgres") => cfg!(feature = "postgres"),
            Some(_) => false,
        }
    }

    /// The scheme's main name as written in a URL.
    pub fn name(self) -> &'static str {
        SCHEMES
            .iter()
            .find(|&&(_, scheme)| scheme == self)
            .map_or("unknown", |&(name, _)| name)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://", self.name())
    }
}

/// Opens the lock backend a URL names.
///
/// | URL | needs feature | store |
/// |---|---|---|
/// | `memory://` | — | a new in-process [`MemoryBackend`] (nothing is shared between calls) |
/// | `redis://[:password@]host[:port][/db]`, `rediss://…` | `redis` | one Redis server |
/// | `redis+cluster://[:password@]host:port` | `redis` | a Redis Cluster, from one seed node |
/// | `redis+sentinel://[:password@]host:port[,host:port…]/master_name[/db]`, `rediss+sentinel://…` | `redis` | the master Redis Sentinel monitors, found by asking the Sentinels |
/// | `etcd://[user:password@]host:port[,host:port…][?key_prefix=…]` | `etcd` | an etcd v3 cluster |
/// | `etcds://host:port[,host:port…]?ca=/path/ca.pem[&key_prefix=…]` | `etcd` | an etcd v3 cluster over TLS |
/// | `postgres://user[:password]@host[:port]/db[?mode=…&schema=…&pool_size=…&pooling=…]` | `postgres` | PostgreSQL |
///
/// # PostgreSQL
///
/// `postgresql://` is the same as `postgres://`. distlock reads four query parameters
/// and removes them before the URL reaches the driver:
///
/// - `mode=lease` (the default) opens the lease-table backend, `mode=advisory` the
///   advisory-lock backend (which pins a connection per held lock and does not work
///   behind a transaction-pooling proxy);
/// - `schema=NAME`: the schema of the tables (default `distlock`);
/// - `pool_size=N`: the most connections (for `advisory`, the most locks held at once);
/// - `pooling=session` (the default) or `pooling=transaction`: the lease table behind a
///   proxy that pools server sessions per transaction (PgBouncer `pool_mode =
///   transaction`), where its waiters poll instead of being woken; the advisory backend
///   refuses it.
///
/// PostgreSQL's own connection parameters (`sslmode`, `sslrootcert`, `application_name`,
/// `options`, ...) pass through; any other parameter is a [`LockError::Config`], so a
/// misspelt one is never silently ignored. `connect` opens the pool's connections and
/// checks that the tables exist, but never creates them: run [`setup`] (or
/// `lockctl setup URL`) once per database, as part of deploying, with a role allowed to
/// create them.
///
/// # Errors
///
/// [`LockError::Config`] when the URL is malformed (the message says what is wrong),
/// its scheme is unknown (the message lists the known ones), or the store's cargo
/// feature is not enabled. The errors of the
/// store's backend (for example [`LockError::Unavailable`] when the server is down) pass
/// through. No error contains the URL's password.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let err = distlock::connect("carrier-pigeon://coop").await.unwrap_err();
/// assert!(err.to_string().contains("redis://"), "{err}");
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    let scheme = checked(url)?;
    open(scheme, url).await
}

/// The environment variable [`connect_from_env`] reads the URL from.
pub const URL_ENV: &str = "DISTLOCK_URL";

/// [`connect`] to the URL in the environment variable `DISTLOCK_URL` ([`URL_ENV`]).
///
/// # Errors
///
/// [`LockError::Config`] naming the variable when it is unset, empty or not UTF-8;
/// otherwise those of [`connect`].
pub async fn connect_from_env() -> Result<Arc<dyn LockBackend>, LockError> {
    connect(&url_from_env(URL_ENV, |name| std::env::var(name))?).await
}

/// The URL `lookup` finds under `name`, or an error naming the variable.
fn url_from_env(
    name: &str,
    lookup: impl FnOnce(&str) -> Result<String, std::env::VarError>,
) -> Result<String, LockError> {
    distlock_core::url_from_env(name, "a lock URL such as redis://host:6379", lookup)
}

/// Prepares the store a URL names for [`connect`]: for PostgreSQL, creates the schema and
/// every table distlock uses (both backends', and those of the SQL fencing and
/// idempotency helpers), idempotently; the role needs `CREATE` on the database unless the
/// schema exists already. Stores that need no preparation (memory, Redis, etcd) are left
/// untouched and `Ok(())` is returned without connecting.
///
/// # Errors
///
/// The same configuration errors as [`connect`]; for PostgreSQL, the server's errors
/// (unreachable, login refused, not permitted to create the schema).
pub async fn setup(url: &str) -> Result<(), LockError> {
    match checked(url)? {
        Scheme::Memory => memory(url).map(drop),
        #[cfg(feature = "redis")]
        Scheme::Redis | Scheme::RedisTls | Scheme::RedisCluster | Scheme::RedisSentinel => {
            lock_redis::RedisBackendBuilder::from_url(url).map(drop)
        }
        #[cfg(feature = "etcd")]
        Scheme::Etcd | Scheme::EtcdTls => lock_etcd::EtcdBuilder::from_url(url).map(drop),
        #[cfg(feature = "postgres")]
        Scheme::Postgres => {
            lock_postgres::PgBuilder::from_url(url)?
                .build_lease_backend()?
                .setup()
                .await
        }
        // Reached only for a store whose feature is off, which `checked` refused already.
        #[allow(unreachable_patterns)]
        scheme => Err(feature_off(scheme)),
    }
}

/// The store `url` names, once its scheme is known, its store's feature is enabled and
/// the checks every URL shares pass: it parses, and has a host where one is needed. An
/// etcd URL lists the cluster's members (`etcd://h1:2379,h2:2379`), and a Redis Sentinel
/// URL its Sentinels, which no URL parser reads as one authority: their backends check
/// them whole.
pub(crate) fn checked(url: &str) -> Result<Scheme, LockError> {
    let written = url.trim().split_once("://").map(|(name, _)| name);
    let scheme = match written.and_then(Scheme::from_name) {
        Some(scheme @ (Scheme::Etcd | Scheme::EtcdTls | Scheme::RedisSentinel)) => scheme,
        _ => {
            let parsed = parse(url)?;
            let scheme =
                Scheme::from_name(parsed.scheme()).ok_or_else(|| unknown_scheme(&parsed))?;
            if scheme != Scheme::Memory && parsed.host_str().is_none_or(str::is_empty) {
                return Err(LockError::Config(format!(
                    "the {scheme} URL has no host: write {scheme}host:port"
                )));
            }
            scheme
        }
    };
    if !scheme.is_enabled() {
        return Err(feature_off(scheme));
    }
    Ok(scheme)
}

/// Hands a checked URL to the store's builder. Plugging a backend in is one arm here
/// (and the backend crate in the feature's list in Cargo.toml).
async fn open(scheme: Scheme, url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    match scheme {
        Scheme::Memory => memory(url),
        #[cfg(feature = "redis")]
        Scheme::Redis | Scheme::RedisTls | Scheme::RedisCluster | Scheme::RedisSentinel => {
            Ok(Arc::new(
                lock_redis::RedisBackendBuilder::from_url(url)?
                    .build()
                    .await?,
            ))
        }
        #[cfg(feature = "etcd")]
        Scheme::Etcd | Scheme::EtcdTls => Ok(Arc::new(
            lock_etcd::EtcdBuilder::from_url(url)?.build().await?,
        )),
        #[cfg(feature = "postgres")]
        Scheme::Postgres => lock_postgres::PgBuilder::from_url(url)?.build().await,
        // Reached only for a store whose feature is off, which `connect` refused already.
        #[allow(unreachable_patterns)]
        _ => Err(feature_off(scheme)),
    }
}

pub(crate) fn memory(url: &str) -> Result<Arc<dyn LockBackend>, LockError> {
    let url = parse(url)?;
    let bare = url.host_str().is_none_or(str::is_empty)
        && url.username().is_empty()
        && url.password().is_none()
        && url.port().is_none()
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none();
    if !bare {
        return Err(LockError::Config(
            "a memory URL takes no host, port, path or query: write memory://".into(),
        ));
    }
    Ok(Arc::new(MemoryBackend::new()))
}

fn parse(url: &str) -> Result<Url, LockError> {
    Url::parse(url.trim()).map_err(|e| {
        // The url crate's messages never repeat the input, so they are safe to show.
        let hint = match e {
            url::ParseError::RelativeUrlWithoutBase | url::ParseError::EmptyHost => {
                format!(
                    "; a lock URL starts with a scheme, one of {}",
                    known_schemes()
                )
            }
            _ => String::new(),
        };
        LockError::Config(format!("malformed URL: {e}{hint}"))
    })
}

fn unknown_scheme(url: &Url) -> LockError {
    LockError::Config(format!(
        "unknown URL scheme `{}`: expected one of {}",
        url.scheme(),
        known_schemes()
    ))
}

pub(crate) fn feature_off(scheme: Scheme) -> LockError {
    let feature = scheme.feature().unwrap_or("none");
    LockError::Config(format!(
        "feature `{feature}` is not enabled: to open {scheme} URLs, enable distlock's \
         `{feature}` feature (`distlock = {{ version = \"0.1\", features = [\"{feature}\"] }}` \
         in Cargo.toml)"
    ))
}

fn known_schemes() -> String {
    SCHEMES
        .iter()
        .map(|(name, _)| format!("{name}://"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::{LockKey, redact_url};
    use std::time::Duration;

    async fn error_of(url: &str) -> String {
        match connect(url).await {
            Ok(backend) => panic!("{url} opened {backend:?}"),
            Err(LockError::Config(message)) => message,
            Err(other) => panic!("{url}: expected a configuration error, got {other}"),
        }
    }

    #[tokio::test]
    async fn memory_urls_open_a_working_backend() {
        let backend = connect("memory://").await.unwrap();
        assert_eq!(backend.name(), "memory");
        let key = LockKey::new("k").unwrap();
        let lease = backend.acquire(&key, Duration::from_secs(5)).await.unwrap();
        assert!(lease.is_some());
        assert!(
            backend
                .acquire(&key, Duration::from_secs(5))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn every_memory_url_is_a_separate_store() {
        let key = LockKey::new("k").unwrap();
        let a = connect("memory://").await.unwrap();
        let b = connect("MEMORY://").await.unwrap();
        assert!(
            a.acquire(&key, Duration::from_secs(5))
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            b.acquire(&key, Duration::from_secs(5))
                .await
                .unwrap()
                .is_some()
        );
    }

    #[tokio::test]
    async fn a_memory_url_with_more_than_the_scheme_is_refused() {
        for url in ["memory://somewhere", "memory:///path", "memory://?x=1"] {
            assert!(error_of(url).await.contains("memory://"), "{url}");
        }
    }

    #[tokio::test]
    async fn a_malformed_url_says_what_is_wrong() {
        let no_scheme = error_of("127.0.0.1:6379").await;
        assert!(no_scheme.starts_with("malformed URL"), "{no_scheme}");
        assert!(no_scheme.contains("redis://"), "{no_scheme}");
        let bad_port = error_of("redis://127.0.0.1:99999").await;
        assert!(bad_port.contains("invalid port"), "{bad_port}");
        let no_host = error_of("redis://").await;
        assert!(no_host.contains("no host"), "{no_host}");
    }

    #[tokio::test]
    async fn an_unknown_scheme_lists_the_known_ones() {
        let message = error_of("mysql://db:3306").await;
        assert!(message.contains("`mysql`"), "{message}");
        for (name, _) in SCHEMES {
            assert!(message.contains(&format!("{name}://")), "{message}");
        }
    }

    #[cfg(not(feature = "etcd"))]
    #[tokio::test]
    async fn a_scheme_whose_feature_is_off_names_the_feature() {
        let message = error_of("etcd://127.0.0.1:2379").await;
        assert!(
            message.contains("feature `etcd` is not enabled"),
            "{message}"
        );
    }

    #[cfg(not(feature = "postgres"))]
    #[tokio::test]
    async fn both_postgres_spellings_need_the_postgres_feature() {
        for url in ["postgres://u@127.0.0.1/db", "postgresql://u@127.0.0.1/db"] {
            let message = error_of(url).await;
            assert!(message.contains("feature `postgres`"), "{message}");
        }
    }

    #[cfg(feature = "etcd")]
    #[tokio::test]
    async fn an_etcds_url_needs_its_ca_file() {
        let message = error_of("etcds://root:s3cret@127.0.0.1:1,127.0.0.1:2").await;
        assert!(message.contains("ca"), "{message}");
        assert!(!message.contains("s3cret"), "{message}");
        let message = error_of("etcds://127.0.0.1:1?ca=/nonexistent/ca.pem").await;
        assert!(message.contains("/nonexistent/ca.pem"), "{message}");
    }

    #[cfg(not(feature = "etcd"))]
    #[tokio::test]
    async fn an_etcds_url_needs_the_etcd_feature() {
        assert!(
            error_of("etcds://127.0.0.1:1?ca=/x")
                .await
                .contains("feature `etcd`")
        );
    }

    #[tokio::test]
    async fn errors_never_contain_the_password() {
        for url in [
            "redis://:hunter2@127.0.0.1:1",
            "redis+cluster://:hunter2@127.0.0.1:1",
            "postgres://user:hunter2@127.0.0.1:1/db",
            "etcd://user:hunter2@127.0.0.1:1",
            "redis://:hunter2@[::1",
            "redis://:hunter2@127.0.0.1:99999",
            "unknown://user:hunter2@host",
            "memory://user:hunter2@",
        ] {
            let shown = match connect(url).await {
                Ok(backend) => format!("{backend:?}"),
                Err(e) => format!("{e} {e:?}"),
            };
            assert!(!shown.contains("hunter2"), "{url} leaked: {shown}");
        }
    }

    /// Every scheme, with a password in the userinfo holding `c`; the digits before `c`
    /// read as a port when a parser ends the authority at `c`.
    fn urls_with_a_password_holding(c: char) -> Vec<String> {
        let password = format!("12{c}hunter2");
        let mut urls: Vec<String> = [
            "redis://u:{}@127.0.0.1:1/",
            "rediss://:{}@127.0.0.1:1/",
            "redis+cluster://u:{}@127.0.0.1:1",
            // pool_size=0 fails after the URL is read, without waiting for a connection.
            "postgres://app:{}@127.0.0.1:1/db?mode=advisory&pool_size=0",
            "postgresql://app:{}@127.0.0.1:1/db?pool_size=0",
            "etcd://root:{}@127.0.0.1:1,127.0.0.1:2",
            "etcds://root:{}@127.0.0.1:1?ca=/nonexistent/ca.pem",
            "memory://u:{}@",
            "unknown://u:{}@h",
        ]
        .iter()
        .map(|template| template.replace("{}", &password))
        .collect();
        // An `&` in a query value ends it (it must be written %26).
        if c != '&' {
            urls.push(format!(
                "postgres://app@127.0.0.1:1/db?password={password}&pool_size=0"
            ));
        }
        urls
    }

    #[tokio::test]
    async fn errors_never_contain_a_password_holding_special_characters() {
        for c in ['@', '#', '?', '/', ',', '%', ':', '&'] {
            for url in urls_with_a_password_holding(c) {
                let shown = match connect(&url).await {
                    Ok(backend) => format!("{backend:?}"),
                    Err(e) => format!("{e} {e:?}"),
                };
                assert!(!shown.contains("hunter2"), "{url} leaked: {shown}");
                assert!(!redact_url(&url).contains("hunter2"), "{url}");
            }
        }
    }

    #[cfg(feature = "etcd")]
    #[tokio::test]
    async fn an_etcd_password_holding_a_comma_is_not_read_as_a_member() {
        // Nothing listens on port 1: the URL must get as far as trying to connect.
        match connect("etcd://root:pass,word@127.0.0.1:1").await {
            Err(LockError::Unavailable { .. }) => {}
            Err(other) => panic!("expected the cluster to be unreachable, got {other}"),
            Ok(backend) => panic!("opened {backend:?}"),
        }
    }

    #[test]
    fn schemes_know_their_features() {
        assert_eq!(Scheme::from_name("rediss"), Some(Scheme::RedisTls));
        assert_eq!(Scheme::from_name("postgresql"), Some(Scheme::Postgres));
        assert_eq!(Scheme::from_name("ftp"), None);
        assert_eq!(Scheme::RedisCluster.feature(), Some("redis"));
        assert!(Scheme::Memory.is_enabled());
        assert_eq!(Scheme::Etcd.is_enabled(), cfg!(feature = "etcd"));
        assert_eq!(Scheme::Postgres.to_string(), "postgres://");
    }

    /// A Sentinel URL lists several hosts, which no URL parser reads as one authority: it
    /// reaches the Redis backend whole, which names what is wrong with it.
    #[tokio::test]
    async fn a_sentinel_url_reaches_the_redis_backend() {
        assert_eq!(
            Scheme::from_name("rediss+sentinel"),
            Some(Scheme::RedisSentinel)
        );
        let checked = checked("redis+sentinel://127.0.0.1:1,127.0.0.1:2/locks");
        if cfg!(feature = "redis") {
            assert_eq!(checked.unwrap(), Scheme::RedisSentinel);
            let message = error_of("redis+sentinel://:hunter2@127.0.0.1:1,127.0.0.1:2").await;
            assert!(message.contains("names no master"), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        } else {
            assert!(matches!(checked, Err(LockError::Config(m)) if m.contains("`redis`")));
        }
    }

    #[test]
    fn connect_from_env_names_a_missing_variable() {
        use std::env::VarError;
        let url = url_from_env("TEST_URL", |name| {
            assert_eq!(name, "TEST_URL");
            Ok("memory://".into())
        });
        assert_eq!(url.unwrap(), "memory://");
        for found in [
            Err(VarError::NotPresent),
            Err(VarError::NotUnicode("x".into())),
            Ok(" ".to_owned()),
        ] {
            let Err(LockError::Config(message)) = url_from_env(URL_ENV, |_| found) else {
                panic!("a missing URL was accepted");
            };
            assert!(message.contains("DISTLOCK_URL"), "{message}");
        }
    }
}
