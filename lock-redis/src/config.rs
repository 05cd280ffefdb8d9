//! The builder for [`crate::RedisBackend`]: where the servers are, how keys are named,
//! which TTLs are accepted and how long a reply may take. Its `Debug` never shows a password.

use std::fmt;
use std::time::Duration;

use lock_api::LockError;

use crate::RedisBackend;

/// The key prefix used when none is set.
pub const DEFAULT_PREFIX: &str = "distlock";
/// The shortest TTL accepted by default: Redis keeps expiries in whole milliseconds.
pub const DEFAULT_MIN_TTL: Duration = Duration::from_millis(1);
/// The longest TTL accepted by default (one week): a longer lease is almost always a bug,
/// since a crashed holder keeps the key for the whole TTL.
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a request may wait for its reply by default before its outcome is unknown.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long establishing a connection may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Options for a [`RedisBackend`]; made by [`RedisBackend::builder`].
///
/// # URLs
///
/// * `redis://[[user]:password@]host[:port][/db]` — one node (plain TCP);
/// * `rediss://...` — one node over TLS (rustls, system roots);
/// * several URLs given with [`RedisBackendBuilder::cluster_urls`] — a Redis Cluster,
///   discovered from those seed nodes;
/// * `redis+cluster://...` or `rediss+cluster://...` — a Redis Cluster discovered from that
///   one seed node (the scheme is the plain one with `+cluster` added).
///
/// A cluster has no databases: a `/db` other than 0 is refused there.
#[must_use]
#[derive(Clone)]
pub struct RedisBackendBuilder {
    pub(crate) urls: Vec<String>,
    pub(crate) cluster: bool,
    pub(crate) prefix: String,
    pub(crate) min_ttl: Duration,
    pub(crate) max_ttl: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) replica_acks: Option<(usize, Duration)>,
}

impl Default for RedisBackendBuilder {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            cluster: false,
            prefix: DEFAULT_PREFIX.to_owned(),
            min_ttl: DEFAULT_MIN_TTL,
            max_ttl: DEFAULT_MAX_TTL,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            replica_acks: None,
        }
    }
}

impl RedisBackendBuilder {
    /// One node, or a cluster seed with the `redis+cluster://` scheme.
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

    /// The prefix of every key (default `"distlock"`): `<prefix>:{<name>}`. It may not be
    /// empty, contain `{` or `}` (they would change the hash slot) or control characters.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The shortest TTL to accept (default 1 ms).
    pub fn min_ttl(mut self, ttl: Duration) -> Self {
        self.min_ttl = ttl;
        self
    }

    /// The longest TTL to accept (default one week).
    pub fn max_ttl(mut self, ttl: Duration) -> Self {
        self.max_ttl = ttl;
        self
    }

    /// How long a request may wait for its reply (default 1 s). A request that got no
    /// reply in time fails with [`LockError::OutcomeUnknown`]. Keep it well below the
    /// renewal interval (a third of the TTL).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long opening a connection may take (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// After every acquire, wait (`WAIT replicas timeout`, in the same round trip) until
    /// `replicas` replicas have the write. When fewer acknowledge, the lock is released
    /// and the acquire fails with [`LockError::Unavailable`] saying how many did.
    pub fn replica_acks(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replica_acks = Some((replicas, timeout));
        self
    }

    /// Validates the options and connects.
    ///
    /// Fails with [`LockError::Config`] for a malformed URL, a bad prefix or bad TTL bounds,
    /// or refused credentials, and with [`LockError::Unavailable`] when no server answers.
    pub async fn build(self) -> Result<RedisBackend, LockError> {
        self.validate()?;
        RedisBackend::connect(self).await
    }

    fn validate(&self) -> Result<(), LockError> {
        if self.urls.is_empty() {
            return Err(LockError::Config("no Redis URL was given".into()));
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
        if self.min_ttl.is_zero() || self.min_ttl > self.max_ttl {
            return Err(LockError::Config(format!(
                "invalid TTL bounds {:?}..={:?}: need 0 < min <= max",
                self.min_ttl, self.max_ttl
            )));
        }
        if self.min_ttl.as_nanos() % 1_000_000 != 0 || self.max_ttl.as_nanos() % 1_000_000 != 0 {
            return Err(LockError::Config(
                "TTL bounds must be whole milliseconds".into(),
            ));
        }
        if self.response_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(LockError::Config(
                "timeouts must be greater than zero".into(),
            ));
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
            .field("min_ttl", &self.min_ttl)
            .field("max_ttl", &self.max_ttl)
            .field("response_timeout", &self.response_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("replica_acks", &self.replica_acks)
            .finish()
    }
}

/// The URL with any password replaced by `***`, for messages and `Debug`.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        // Not a URL at all: it may be a password pasted in the wrong place.
        return "<unparseable URL>".into();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    let hidden = if userinfo.contains(':') {
        format!("{user}:***")
    } else {
        // `redis://secret@host` puts the password where the user would be.
        "***".to_owned()
    };
    format!(
        "{}{hidden}@{}{}",
        &url[..scheme_end + 3],
        &authority[at + 1..],
        &rest[authority_end..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_passwords_and_keeps_the_rest() {
        assert_eq!(
            redact_url("redis://user:s3cret@127.0.0.1:6379/2"),
            "redis://user:***@127.0.0.1:6379/2"
        );
        assert_eq!(redact_url("rediss://:s3cret@h:1/"), "rediss://:***@h:1/");
        assert_eq!(redact_url("redis://s3cret@h"), "redis://***@h");
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(redact_url("s3cret"), "<unparseable URL>");
    }

    #[test]
    fn builder_debug_never_shows_the_password() {
        let b = RedisBackendBuilder::default().url("redis://u:hunter2@127.0.0.1:1/");
        let shown = format!("{b:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("u:***@127.0.0.1:1"), "{shown}");
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
            base.clone().min_ttl(Duration::ZERO),
            base.clone()
                .min_ttl(Duration::from_secs(10))
                .max_ttl(Duration::from_secs(1)),
            base.clone().max_ttl(Duration::from_micros(1500)),
            base.clone().response_timeout(Duration::ZERO),
            RedisBackendBuilder::default(),
        ] {
            assert!(
                matches!(bad.validate(), Err(LockError::Config(_))),
                "{bad:?}"
            );
        }
        assert!(base.validate().is_ok());
    }
}
