//! The builder for [`crate::RedisBackend`]: where the servers are, how keys are named,
//! which TTLs are accepted and how long a reply may take. Its `Debug` never shows a password.
//!
//! The options carry the names the other backends' builders give the same ideas
//! (`key_prefix`, `ttl_bounds`, `request_timeout`, `connect_timeout`, `tls_ca_pem`); the
//! names this builder had before 0.1.0 forward to them, deprecated.

use std::fmt;
use std::time::Duration;

use distlock_core::{LockError, redact_url, trusted_for};

use crate::url::SentinelUrl;

/// The key prefix used when none is set.
pub const DEFAULT_KEY_PREFIX: &str = "distlock";
/// The key prefix used when none is set.
#[deprecated(
    since = "0.1.0",
    note = "use `DEFAULT_KEY_PREFIX`, as lock-etcd names it"
)]
pub const DEFAULT_PREFIX: &str = DEFAULT_KEY_PREFIX;
/// The shortest TTL accepted by default: Redis keeps expiries in whole milliseconds, and
/// 3 ms is the shortest whole number of them a lease is trusted for at all
/// ([`distlock_core::trusted_for`]).
pub const DEFAULT_MIN_TTL: Duration = Duration::from_millis(3);
/// The longest TTL accepted by default (one week): a longer lease is almost always a bug,
/// since a crashed holder keeps the key for the whole TTL.
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a request may wait for its reply by default before its outcome is unknown.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a request may wait for its reply by default before its outcome is unknown.
#[deprecated(since = "0.1.0", note = "use `DEFAULT_REQUEST_TIMEOUT`")]
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = DEFAULT_REQUEST_TIMEOUT;
/// How long establishing a connection may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The environment variable [`RedisBackendBuilder::from_env`] reads the URL from.
pub const REDIS_URL_ENV: &str = "DISTLOCK_REDIS_URL";

/// Options for a [`RedisBackend`](crate::RedisBackend); made by [`new`](Self::new) (or
/// [`RedisBackend::builder`](crate::RedisBackend::builder)), [`from_url`](Self::from_url) or [`from_env`](Self::from_env).
///
/// # URLs
///
/// * `redis://[[user]:password@]host[:port][/db]` — one node (plain TCP);
/// * `rediss://...` — one node over TLS (rustls with the `ring` crypto provider). The
///   server certificate is checked against the Mozilla roots bundled with the client
///   (`webpki-roots`), or only against [`RedisBackendBuilder::tls_ca_pem`] when set
///   (a private CA). `rediss://host:port/#insecure` turns certificate checks off entirely:
///   anyone on the path can then read and forge replies; use it only against a test server;
///
/// * several URLs given with [`RedisBackendBuilder::cluster_urls`] — a Redis Cluster,
///   discovered from those seed nodes;
/// * `redis+cluster://...` or `rediss+cluster://...` — a Redis Cluster discovered from that
///   one seed node (the scheme is the plain one with `+cluster` added);
/// * `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master_name[/db]` — the
///   master that Redis Sentinel monitors under `master_name`, found by asking the Sentinels
///   listed (port 26379 when none is given) in turn, and asked for again after a failover or
///   switchover. The user and password are the master's (a Sentinel with a password of its
///   own: [`RedisBackendBuilder::sentinel_auth`]); `rediss+sentinel://` uses TLS to the
///   master and the Sentinels alike. [`RedisBackendBuilder::sentinel`] is the same without
///   a URL.
///
/// A cluster has no databases: a `/db` other than 0 is refused there. A URL takes no
/// query parameters (`build` names one it finds in a [`LockError::Config`]), and a `/`,
/// `?`, `#` or `@` in the user or password must be escaped (`%2F`, `%3F`, `%23`, `%40`).
///
/// # TLS and the process-wide crypto provider
///
/// The client library builds its TLS configuration from rustls's process-wide default
/// crypto provider. When a `rediss://` URL is used and the process has not chosen one,
/// [`RedisBackendBuilder::build`] installs rustls's `ring` provider as that default; a
/// provider the application installed first is kept.
#[derive(Clone)]
#[must_use = "a builder does nothing until `build().await`"]
pub struct RedisBackendBuilder {
    pub(crate) urls: Vec<String>,
    pub(crate) cluster: bool,
    pub(crate) prefix: String,
    pub(crate) min_ttl: Duration,
    pub(crate) max_ttl: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) replica_acks: Option<(usize, Duration)>,
    pub(crate) tls_ca: Option<Vec<u8>>,
    /// The user (empty: the default one) and password the Sentinels take.
    pub(crate) sentinel_auth: Option<(String, String)>,
}

impl Default for RedisBackendBuilder {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            cluster: false,
            prefix: DEFAULT_KEY_PREFIX.to_owned(),
            min_ttl: DEFAULT_MIN_TTL,
            max_ttl: DEFAULT_MAX_TTL,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            replica_acks: None,
            tls_ca: None,
            sentinel_auth: None,
        }
    }
}

impl RedisBackendBuilder {
    /// A builder with no URL and the default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// A builder for the node or cluster a URL names (see [URLs](Self#urls)), with the
    /// default settings, which can be changed before [`build`](Self::build). The URL is
    /// checked here.
    ///
    /// ```
    /// let builder = distlock::redis::RedisBackendBuilder::from_url("redis://:s3cret@127.0.0.1:6379/0")?;
    /// assert!(!format!("{builder:?}").contains("s3cret"));
    /// # Ok::<(), distlock::LockError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for a malformed URL, another scheme, no host, a query
    /// parameter, or a `redis+sentinel://` URL without a master name; the message never
    /// shows the password.
    pub fn from_url(url: &str) -> Result<Self, LockError> {
        Ok(Self::new().url(crate::url::checked(url)?))
    }

    /// [`from_url`](Self::from_url) with the URL in the environment variable
    /// `DISTLOCK_REDIS_URL` ([`REDIS_URL_ENV`]).
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
        distlock_core::builder_from_env(REDIS_URL_ENV, "a redis:// URL", lookup, Self::from_url)
    }

    /// One node, a cluster seed with the `redis+cluster://` scheme, or the Sentinels of a
    /// master with `redis+sentinel://` (see [URLs](Self#urls)).
    pub fn url(mut self, url: impl Into<String>) -> Self {
        let url = url.into();
        self.cluster = url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://");
        self.urls = vec![url.replacen("+cluster", "", usize::from(self.cluster))];
        self
    }

    /// A Redis Cluster, discovered from these seed nodes (`redis://` or `rediss://` URLs).
    pub fn cluster_urls<I, S>(mut self, urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.urls = urls.into_iter().map(Into::into).collect();
        self.cluster = true;
        self
    }

    /// The master Redis Sentinel monitors as `master_name`, found by asking the Sentinels
    /// at `sentinels` (`host:port` each) in turn: the same as the URL
    /// `redis+sentinel://host:port,.../master_name`. The master's credentials, database or
    /// TLS are given in that URL instead ([`url`](Self::url)).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), distlock::LockError> {
    /// let redis = distlock::redis::RedisBackend::builder()
    ///     .sentinel(["10.0.0.1:26379", "10.0.0.2:26379", "10.0.0.3:26379"], "locks")
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn sentinel<I, S>(self, sentinels: I, master_name: impl AsRef<str>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let hosts: Vec<String> = sentinels
            .into_iter()
            .map(|s| s.as_ref().to_owned())
            .collect();
        self.url(format!(
            "redis+sentinel://{}/{}",
            hosts.join(","),
            master_name.as_ref()
        ))
    }

    /// The user (empty for the default user) and password of the Sentinels, when they
    /// require one of their own (`requirepass` in `sentinel.conf`); without it the
    /// Sentinels are asked without credentials. The master's own are in the URL.
    pub fn sentinel_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.sentinel_auth = Some((user.into(), password.into()));
        self
    }

    /// The prefix of every key (default `"distlock"`): `<prefix>:{<name>}`. It may not be
    /// empty, contain `{` or `}` (they would change the hash slot) or control characters.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The shortest and longest TTL to accept, in whole milliseconds (default 3 ms
    /// ([`DEFAULT_MIN_TTL`]) to one week ([`DEFAULT_MAX_TTL`])). `build` refuses a minimum
    /// a lease would be trusted for no time at all ([`distlock_core::trusted_for`]), a
    /// minimum above the maximum, and a maximum longer than Redis keeps an expiry
    /// ([`LONGEST_TTL`](crate::LONGEST_TTL)).
    pub fn ttl_bounds(mut self, min: Duration, max: Duration) -> Self {
        self.min_ttl = min;
        self.max_ttl = max;
        self
    }

    /// The shortest TTL to accept; the longest stays as it was.
    #[deprecated(
        since = "0.1.0",
        note = "use `ttl_bounds(min, max)`, as lock-etcd and lock-postgres name it"
    )]
    pub fn min_ttl(self, ttl: Duration) -> Self {
        let max = self.max_ttl;
        self.ttl_bounds(ttl, max)
    }

    /// The longest TTL to accept; the shortest stays as it was.
    #[deprecated(
        since = "0.1.0",
        note = "use `ttl_bounds(min, max)`, as lock-etcd and lock-postgres name it"
    )]
    pub fn max_ttl(self, ttl: Duration) -> Self {
        let min = self.min_ttl;
        self.ttl_bounds(min, ttl)
    }

    /// How long a request may wait for its reply (default 1 s). A request that got no
    /// reply in time fails with [`LockError::OutcomeUnknown`]. Keep it well below the
    /// renewal interval (a third of the TTL).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How long a request may wait for its reply.
    #[deprecated(
        since = "0.1.0",
        note = "use `request_timeout`, as lock-etcd and lock-postgres name it"
    )]
    pub fn response_timeout(self, timeout: Duration) -> Self {
        self.request_timeout(timeout)
    }

    /// How long opening a connection may take (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// After every acquire, wait (`WAIT replicas timeout`, in the same round trip) until
    /// `replicas` replicas have the write. When fewer acknowledge, the lock is released
    /// and the acquire fails with [`LockError::Unavailable`] saying how many did.
    /// `timeout` must be 1 ms or more (`WAIT` counts whole milliseconds and takes 0 as no
    /// limit) and shorter than the [request timeout](Self::request_timeout), which the
    /// acquire's reply (after `WAIT`) has to meet; otherwise `build` fails with
    /// [`LockError::Config`] before connecting. Batches of acquires then run one key at a time.
    ///
    /// Redis answers nothing else of a connection blocked in `WAIT`, so acquires with
    /// `WAIT` go over connections of their own, one acquire at a time each, at most
    /// [`ACKED_CONNECTIONS`](crate::ACKED_CONNECTIONS): renewals and releases never wait
    /// behind a `WAIT`, even while a replica is down.
    pub fn replica_acks(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replica_acks = Some((replicas, timeout));
        self
    }

    /// Trusts only the CA certificates in `pem` (one or more PEM `CERTIFICATE` blocks) for
    /// `rediss://` servers, instead of the bundled public roots: for a server whose
    /// certificate a private CA signed. Every URL must then be `rediss://`; a PEM without a
    /// certificate, or with one that does not parse, is a [`LockError::Config`].
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), distlock::LockError> {
    /// let ca = std::fs::read("/etc/redis/tls/ca.crt").map_err(|e| distlock::LockError::Config(e.to_string()))?;
    /// let redis = distlock::redis::RedisBackend::builder()
    ///     .url("rediss://redis.internal:6380/")
    ///     .tls_ca_pem(ca)
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca = Some(pem.into());
        self
    }

    /// Trusts only the CA certificates in `pem` for `rediss://` servers.
    #[deprecated(since = "0.1.0", note = "use `tls_ca_pem`, as lock-etcd names it")]
    pub fn tls_root_ca_pem(self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca_pem(pem)
    }

    /// True when any URL uses TLS.
    pub(crate) fn uses_tls(&self) -> bool {
        self.urls.iter().any(|u| crate::url::is_tls(u))
    }

    /// The Sentinels and master name of a `redis+sentinel://` URL.
    pub(crate) fn sentinel_url(&self) -> Result<Option<SentinelUrl>, LockError> {
        match self.urls.as_slice() {
            [url] => SentinelUrl::parse(url),
            _ => Ok(None),
        }
    }

    /// Checks the options before anything is sent: the URLs, the prefix, the TTL bounds,
    /// the timeouts, `replica_acks` and the TLS CA. [`build`](Self::build) (in
    /// lib.rs, above this module and the backend's) calls it first.
    pub(crate) fn validate(&self) -> Result<(), LockError> {
        if self.urls.is_empty() {
            return Err(LockError::Config("no Redis URL was given".into()));
        }
        for url in &self.urls {
            crate::url::check(url)?;
        }
        let sentinel = self.sentinel_url()?;
        if sentinel.is_none() && self.sentinel_auth.is_some() {
            return Err(LockError::Config(
                "Sentinel credentials were given but the URL is not a redis+sentinel:// one".into(),
            ));
        }
        if self.cluster
            && self
                .urls
                .iter()
                .any(|u| SentinelUrl::parse(u).is_ok_and(|s| s.is_some()))
        {
            return Err(LockError::Config(
                "a redis+sentinel:// URL cannot be a cluster seed".into(),
            ));
        }
        if self.prefix.is_empty()
            || self
                .prefix
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_control())
        {
            return Err(LockError::Config(format!(
                "invalid key prefix {:?}: it must be non-empty, without braces or control characters",
                self.prefix
            )));
        }
        if trusted_for(self.min_ttl).is_zero() || self.min_ttl > self.max_ttl {
            return Err(LockError::Config(format!(
                "invalid TTL bounds {:?}..={:?}: need min <= max, and a min a lease is \
                 trusted for at all (3 ms or more)",
                self.min_ttl, self.max_ttl
            )));
        }
        if self.min_ttl.as_nanos() % 1_000_000 != 0 || self.max_ttl.as_nanos() % 1_000_000 != 0 {
            return Err(LockError::Config(
                "TTL bounds must be whole milliseconds".into(),
            ));
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(LockError::Config(
                "timeouts must be greater than zero".into(),
            ));
        }
        if let Some((_, wait)) = self.replica_acks {
            // `WAIT` takes whole milliseconds, and 0 means no limit at all: every acquire
            // would then wait until the replicas answer, however long they are away.
            if wait.as_millis() == 0 {
                return Err(LockError::Config(format!(
                    "the replica acknowledgement timeout {wait:?} is less than 1 ms, which \
                     `WAIT` takes as no limit; give it 1 ms or more"
                )));
            }
            // WAIT holds the reply for up to its timeout; a shorter request timeout would
            // turn every slow acknowledgement into an unknown outcome.
            if wait >= self.request_timeout {
                return Err(LockError::Config(format!(
                    "the replica acknowledgement timeout {wait:?} must be shorter than the \
                     request timeout {:?}",
                    self.request_timeout
                )));
            }
        }
        if let Some(pem) = &self.tls_ca {
            if let Some(url) = self.urls.iter().find(|u| !crate::url::is_tls(u)) {
                return Err(LockError::Config(format!(
                    "a TLS root CA was given but {} is not a rediss:// URL",
                    redact_url(url)
                )));
            }
            crate::tls::check_root_pem(pem)?;
        }
        Ok(())
    }
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("RedisBackendBuilder")
            .field("urls", &urls)
            .field("cluster", &self.cluster)
            .field("prefix", &self.prefix)
            .field("ttl_bounds", &(self.min_ttl, self.max_ttl))
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("replica_acks", &self.replica_acks)
            .field(
                "sentinel_auth",
                &self
                    .sentinel_auth
                    .as_ref()
                    .map(|(user, _)| format!("{user}:***")),
            )
            .field(
                "tls_ca",
                &self
                    .tls_ca
                    .as_ref()
                    .map(|pem| format!("<{} bytes of PEM>", pem.len())),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::url::DEFAULT_SENTINEL_PORT;

    /// A self-signed CA certificate (its key was thrown away), for option checks only.
    const CA_PEM: &str = "\
-----BEGIN CERTIFICATE-----
MIIBmDCCAT2gAwIBAgIUPlTIuWSunvcfW9otEkwMXnn1smowCgYIKoZIzj0EAwIw
IDEeMBwGA1UEAwwVZGlzdGxvY2sgdW5pdC10ZXN0IENBMCAXDTI2MTIwMjE2MjUy
MVoYDzIxMjYxMTA4MTYyNTIxWjAgMR4wHAYDVQQDDBVkaXN0bG9jayB1bml0LXRl
c3QgQ0EwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATk1IgiKDJIeAu5DK/x+m78
QgyvHqt3OrcGv8W3za7Go6KFaarFLTR/1wp4A7u+0Z7ky77vQJn1Aah/eDurMA3b
o1MwUTAdBgNVHQ4EFgQU/eraDVAhto8pil1RM3pGWUxwsCMwHwYDVR0jBBgwFoAU
/eraDVAhto8pil1RM3pGWUxwsCMwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQD
AgNJADBGAiEAnYiOGrgFJWkxxgEGIRhZJo+Vxw5pKopEZ4fscl4RYKoCIQCeBSuc
GcwyvloEA2NUbfSS64Q5fXUPAjOHpqyD7bC+6w==
-----END CERTIFICATE-----
";

    /// Passwords holding every character that ends a URL part or separates etcd members.
    fn passwords() -> Vec<String> {
        ['@', '#', '?', '/', ',', '%', ':', '&']
            .iter()
            .map(|c| format!("hun{c}ter2"))
            .collect()
    }

    #[test]
    fn builder_debug_never_shows_the_password() {
        for password in passwords() {
            let b =
                RedisBackendBuilder::default().url(format!("redis://u:{password}@127.0.0.1:1/"));
            let shown = format!("{b:?}");
            assert!(!shown.contains(&password), "{shown}");
            assert!(!shown.contains("ter2"), "{shown}");
            assert!(shown.contains("u:***@127.0.0.1:1"), "{shown}");
            let b = RedisBackendBuilder::default().cluster_urls([
                format!("redis://:{password}@127.0.0.1:7000"),
                format!("rediss://{password}@127.0.0.1:7001"),
            ]);
            let shown = format!("{b:?}");
            assert!(!shown.contains("ter2"), "{shown}");
        }
    }

    #[test]
    fn config_errors_never_show_the_password() {
        for password in passwords() {
            for url in [
                format!("redis://u:{password}@127.0.0.1:1/?prefix=jobs"),
                format!("redis://u:{password}@127.0.0.1:1/"),
                format!("redis://{password}@127.0.0.1:1/"),
            ] {
                // A root CA with a redis:// URL: the message names the URL.
                let b = RedisBackendBuilder::default().url(&url).tls_ca_pem(CA_PEM);
                let Err(LockError::Config(message)) = b.validate() else {
                    panic!("{url} was accepted");
                };
                assert!(!message.contains("ter2"), "{url}: {message}");
            }
        }
    }

    #[test]
    fn a_password_with_an_unescaped_delimiter_is_refused_before_connecting() {
        for url in [
            "redis://u:12/hunter2@127.0.0.1:6379",
            "redis://u:12?hunter2@127.0.0.1:6379",
            "redis://u:12#hunter2@127.0.0.1:6379",
        ] {
            let Err(LockError::Config(message)) =
                RedisBackendBuilder::default().url(url).validate()
            else {
                panic!("{url} was accepted");
            };
            assert!(message.contains("%2F"), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        }
        assert!(
            RedisBackendBuilder::default()
                .url("redis://u:12%2Fhunter2@127.0.0.1:6379")
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn a_query_parameter_is_refused_by_name() {
        for (url, name) in [
            ("redis://127.0.0.1:6379/?prefix=jobs", "`prefix`"),
            ("redis://127.0.0.1:6379/0?protocol=resp3", "`protocol`"),
            ("rediss://127.0.0.1:6379?db=1&x=2", "`db`"),
            ("redis://127.0.0.1:6379/?&flag", "`flag`"),
        ] {
            let Err(LockError::Config(message)) =
                RedisBackendBuilder::default().url(url).validate()
            else {
                panic!("{url} was accepted");
            };
            assert!(message.contains(name), "{url}: {message}");
        }
        let seeds = RedisBackendBuilder::default()
            .cluster_urls(["redis://127.0.0.1:7000", "redis://127.0.0.1:7001?timeout=1"]);
        assert!(matches!(seeds.validate(), Err(LockError::Config(m)) if m.contains("`timeout`")));
        for url in [
            "redis://127.0.0.1:6379/0",
            "redis://127.0.0.1:6379/?",
            "rediss://127.0.0.1:6379/#insecure",
        ] {
            assert!(
                RedisBackendBuilder::default().url(url).validate().is_ok(),
                "{url}"
            );
        }
    }

    #[test]
    fn cluster_scheme_selects_cluster_mode() {
        let b = RedisBackendBuilder::default().url("redis+cluster://127.0.0.1:7000");
        assert!(b.cluster);
        assert_eq!(b.urls, vec!["redis://127.0.0.1:7000".to_string()]);
        let b = RedisBackendBuilder::default().url("redis://127.0.0.1:7000");
        assert!(!b.cluster);
    }

    #[test]
    fn invalid_options_are_config_errors() {
        let base = RedisBackendBuilder::default().url("redis://127.0.0.1:1");
        for bad in [
            base.clone().key_prefix(""),
            base.clone().key_prefix("a{b"),
            base.clone().ttl_bounds(Duration::ZERO, DEFAULT_MAX_TTL),
            base.clone()
                .ttl_bounds(Duration::from_millis(2), DEFAULT_MAX_TTL),
            base.clone()
                .ttl_bounds(Duration::from_secs(10), Duration::from_secs(1)),
            base.clone()
                .ttl_bounds(DEFAULT_MIN_TTL, Duration::from_micros(1500)),
            base.clone().request_timeout(Duration::ZERO),
            base.clone()
                .request_timeout(Duration::from_secs(1))
                .replica_acks(1, Duration::from_secs(1)),
            // `WAIT 1 0` would wait forever.
            base.clone().replica_acks(1, Duration::ZERO),
            base.clone().replica_acks(1, Duration::from_micros(999)),
            // A root CA only makes sense with TLS URLs, and must hold a certificate.
            base.clone().tls_ca_pem(CA_PEM),
            RedisBackendBuilder::default()
                .url("rediss://127.0.0.1:1")
                .tls_ca_pem("not a certificate"),
            RedisBackendBuilder::default()
                .url("rediss://127.0.0.1:1")
                .tls_ca_pem(CA_PEM.replace("MII", "@@@")),
            RedisBackendBuilder::default(),
        ] {
            assert!(
                matches!(bad.validate(), Err(LockError::Config(_))),
                "{bad:?}"
            );
        }
        assert!(base.validate().is_ok());
        assert!(
            RedisBackendBuilder::default()
                .url("rediss://127.0.0.1:1")
                .tls_ca_pem(CA_PEM)
                .validate()
                .is_ok()
        );
    }

    /// `WAIT n 0` waits for ever: a timeout under 1 ms is refused by `build`, before it
    /// connects (nothing listens on port 1; a build that got as far as connecting would
    /// fail with `Unavailable`).
    #[tokio::test]
    async fn a_replica_timeout_under_a_millisecond_is_refused_before_connecting() {
        for wait in [Duration::ZERO, Duration::from_micros(999)] {
            let built = RedisBackendBuilder::default()
                .url("redis://127.0.0.1:1")
                .replica_acks(1, wait)
                .build()
                .await;
            let Err(LockError::Config(message)) = built else {
                panic!("replica_acks(1, {wait:?}) was not refused: {built:?}");
            };
            assert!(message.contains("1 ms"), "{message}");
        }
    }

    /// A message continued over source lines reads as one sentence: no run of spaces
    /// where a line break was.
    #[test]
    fn option_errors_read_without_runs_of_spaces() {
        let node = || RedisBackendBuilder::default().url("redis://127.0.0.1:1");
        for refused in [
            node().replica_acks(1, Duration::ZERO),
            node().replica_acks(1, DEFAULT_REQUEST_TIMEOUT),
            node().ttl_bounds(Duration::ZERO, DEFAULT_MAX_TTL),
            node().key_prefix(""),
            node().url("redis://127.0.0.1:1/?x=1"),
            node().url("redis://u:1/2@127.0.0.1:1"),
        ] {
            let Err(LockError::Config(message)) = refused.validate() else {
                panic!("{refused:?} was accepted");
            };
            assert!(!message.contains("  "), "{message:?}");
        }
    }

    #[test]
    fn from_url_checks_the_url_and_reads_the_cluster_scheme() {
        let b = RedisBackendBuilder::from_url(" redis+cluster://:pw@127.0.0.1:7000 ").unwrap();
        assert!(b.cluster);
        assert_eq!(b.urls, ["redis://:pw@127.0.0.1:7000"]);
        assert!(b.validate().is_ok());
        for (url, says) in [
            ("redis://127.0.0.1:99999", "invalid port"),
            ("redis://", "no host"),
            ("etcd://127.0.0.1:2379", "redis://"),
            ("redis://127.0.0.1/?protocol=resp3", "`protocol`"),
            ("redis://u:12/hunter2@127.0.0.1", "%2F"),
            ("127.0.0.1:6379", "malformed Redis URL"),
        ] {
            let Err(LockError::Config(message)) = RedisBackendBuilder::from_url(url) else {
                panic!("{url} was accepted");
            };
            assert!(message.contains(says), "{url}: {message}");
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
    }

    #[test]
    fn a_sentinel_url_names_the_sentinels_the_master_and_its_settings() {
        let b = RedisBackendBuilder::from_url(
            "rediss+sentinel://u:hun%40ter2@10.0.0.1:5000,[::1],s3/locks/2#insecure",
        )
        .unwrap();
        assert!(b.uses_tls() && !b.cluster);
        let sentinel = b.sentinel_url().unwrap().unwrap();
        assert_eq!(
            sentinel.sentinels,
            [
                ("10.0.0.1".to_owned(), 5000),
                ("::1".to_owned(), DEFAULT_SENTINEL_PORT),
                ("s3".to_owned(), DEFAULT_SENTINEL_PORT)
            ]
        );
        assert_eq!(sentinel.master_name, "locks");
        assert_eq!(
            sentinel.master_url,
            "rediss://u:hun%40ter2@10.0.0.1:5000/2#insecure"
        );
        let b = b.sentinel_auth("watcher", "s3cret");
        assert!(b.validate().is_ok());
        let shown = format!("{b:?}");
        assert!(
            !shown.contains("ter2") && !shown.contains("s3cret"),
            "{shown}"
        );
        assert!(shown.contains("watcher:***"), "{shown}");
        let built = RedisBackendBuilder::new().sentinel(["10.0.0.1:5000", "s2"], "locks");
        assert_eq!(
            built.sentinel_url().unwrap().unwrap().sentinels,
            [
                ("10.0.0.1".to_owned(), 5000),
                ("s2".to_owned(), DEFAULT_SENTINEL_PORT)
            ]
        );
        assert!(
            RedisBackendBuilder::new()
                .sentinel(Vec::<String>::new(), "locks")
                .validate()
                .is_err()
        );
        assert!(
            RedisBackendBuilder::new()
                .sentinel(["s1"], "")
                .validate()
                .is_err()
        );
    }

    /// The names the builder had before 0.1.0 set what the new ones set, and leave the
    /// rest as it was.
    #[test]
    #[allow(deprecated)]
    fn the_deprecated_names_set_what_the_new_ones_do() {
        let new = RedisBackendBuilder::new()
            .url("rediss://127.0.0.1:1")
            .ttl_bounds(Duration::from_millis(5), Duration::from_secs(60))
            .request_timeout(Duration::from_millis(700))
            .tls_ca_pem(CA_PEM);
        let old = RedisBackendBuilder::new()
            .url("rediss://127.0.0.1:1")
            .max_ttl(Duration::from_secs(60))
            .min_ttl(Duration::from_millis(5))
            .response_timeout(Duration::from_millis(700))
            .tls_root_ca_pem(CA_PEM);
        assert_eq!(format!("{old:?}"), format!("{new:?}"));
        assert_eq!(
            (old.min_ttl, old.max_ttl, old.request_timeout, old.tls_ca),
            (new.min_ttl, new.max_ttl, new.request_timeout, new.tls_ca)
        );
        assert_eq!(DEFAULT_PREFIX, DEFAULT_KEY_PREFIX);
        assert_eq!(DEFAULT_RESPONSE_TIMEOUT, DEFAULT_REQUEST_TIMEOUT);
    }

    #[test]
    fn from_env_reads_the_url_and_names_a_missing_variable() {
        use std::env::VarError;
        let b = RedisBackendBuilder::from_env_with(|name| {
            assert_eq!(name, REDIS_URL_ENV);
            Ok("rediss://:hunter2@127.0.0.1:6380".into())
        })
        .unwrap();
        assert!(b.uses_tls());
        for found in [
            Err(VarError::NotPresent),
            Err(VarError::NotUnicode("x".into())),
            Ok("  ".to_owned()),
        ] {
            let Err(LockError::Config(message)) = RedisBackendBuilder::from_env_with(|_| found)
            else {
                panic!("a missing URL was accepted");
            };
            assert!(message.contains("DISTLOCK_REDIS_URL"), "{message}");
        }
    }
}
