//! [`EtcdBuilder`]: where the cluster is, how to reach it (TLS, user and password), the key
//! prefix, the TTL bounds, the request timeout and the token retention. `build()` validates everything, connects,
//! and asks the cluster for its shortest lease.

use std::fmt;
use std::time::Duration;

use distlock_core::{LockError, redact_url};
use etcd_client::{Certificate, ConnectOptions, GetOptions, Identity, TlsOptions};

use crate::backend::EtcdBackend;
use crate::backend::retention::{
    DEFAULT_TOKEN_RETENTION, MAX_TOKEN_RETENTION, MIN_TOKEN_RETENTION,
};
use crate::error::Effect;
use crate::members::Members;

/// The longest lease etcd grants (`MaxLeaseTTL` in etcd's lessor, in seconds).
pub const ETCD_MAX_LEASE_TTL: Duration = Duration::from_secs(9_000_000_000);

/// The default key prefix: locks live under `distlock/locks/`, fences under `distlock/fenced/`.
pub const DEFAULT_KEY_PREFIX: &str = "distlock";

const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 pings under an open call or watch: twice etcd's default
/// `--grpc-keepalive-min-time`, the shortest interval it allows.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// TCP keepalive on a connection idle this long, as the Redis backend's: against
/// middleboxes that forget idle connections.
const TCP_KEEPALIVE_IDLE: Duration = Duration::from_secs(15);

impl EtcdBackend {
    /// Starts configuring a backend.
    pub fn builder() -> EtcdBuilder {
        EtcdBuilder::new()
    }
}

/// Builds an [`EtcdBackend`].
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::LockError> {
/// use std::time::Duration;
/// use distlock::etcd::EtcdBackend;
///
/// let backend = EtcdBackend::builder()
///     .endpoints(["http://127.0.0.1:2379", "http://127.0.0.1:22379"])
///     .key_prefix("billing")
///     .credentials("worker", "s3cret")
///     .request_timeout(Duration::from_secs(2))
///     .build()
///     .await?;
/// # Ok(()) }
/// ```
///
/// `Debug` never shows the password or the TLS private key.
#[derive(Clone)]
#[must_use = "a builder does nothing until `build().await`"]
pub struct EtcdBuilder {
    endpoints: Vec<String>,
    key_prefix: String,
    user: Option<(String, String)>,
    tls: Option<TlsSettings>,
    ttl_bounds: Option<(Duration, Duration)>,
    request_timeout: Duration,
    connect_timeout: Duration,
    token_retention: Duration,
}

#[derive(Clone, Default)]
struct TlsSettings {
    ca_pem: Option<Vec<u8>>,
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    domain: Option<String>,
}

impl Default for EtcdBuilder {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            user: None,
            tls: None,
            ttl_bounds: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            token_retention: DEFAULT_TOKEN_RETENTION,
        }
    }
}

impl fmt::Debug for EtcdBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let endpoints: Vec<String> = self.endpoints.iter().map(|e| shown(e)).collect();
        f.debug_struct("EtcdBuilder")
            .field("endpoints", &endpoints)
            .field("key_prefix", &self.key_prefix)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .field("password", &self.user.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.is_some())
            .field("ttl_bounds", &self.ttl_bounds)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("token_retention", &self.token_retention)
            .finish()
    }
}

impl EtcdBuilder {
    /// A builder with no endpoints, prefix [`DEFAULT_KEY_PREFIX`], a 5 s request timeout and
    /// a 3 s connect timeout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one endpoint: `http://host:port`, `https://host:port`, or `host:port` (plain HTTP).
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoints.push(endpoint.into());
        self
    }

    /// Adds several endpoints (the members of one cluster).
    pub fn endpoints<I, S>(mut self, endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.endpoints.extend(endpoints.into_iter().map(Into::into));
        self
    }

    /// The prefix under which every key of this backend lives; a trailing `/` is ignored.
    /// Backends with different prefixes never see each other's locks.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Authenticates as `user` with `password`. The password is never logged or printed.
    pub fn credentials(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// Trusts the CA certificate(s) in `pem` for `https://` endpoints.
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.get_or_insert_with(TlsSettings::default).ca_pem = Some(pem.into());
        self
    }

    /// Presents a client certificate and its private key (both PEM) to the server.
    pub fn tls_client_identity_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls
            .get_or_insert_with(TlsSettings::default)
            .identity_pem = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// The name the server certificate must carry, when it differs from the endpoint host.
    pub fn tls_domain_name(mut self, domain: impl Into<String>) -> Self {
        self.tls.get_or_insert_with(TlsSettings::default).domain = Some(domain.into());
        self
    }

    /// Narrows the TTLs this backend accepts to `min..=max` (whole seconds). The cluster's
    /// own minimum lease TTL still applies when it is higher than `min`.
    pub fn ttl_bounds(mut self, min: Duration, max: Duration) -> Self {
        self.ttl_bounds = Some((min, max));
        self
    }

    /// How long one request to one member may take before it fails: `Unavailable` for a
    /// read, or `OutcomeUnknown` for a write that may have been applied. A call that
    /// moves to the next member (the first could not be reached) gives each attempt this
    /// long.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How long connecting to an endpoint may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long the token key of a lock name nobody holds is kept after its last grant
    /// (default [`DEFAULT_TOKEN_RETENTION`], 24 h; from [`MIN_TOKEN_RETENTION`] to
    /// [`MAX_TOKEN_RETENTION`]). With a lock per job id, each name leaves a token key;
    /// acquires start a sweep in the background, about once per a 24th of the retention
    /// (between 1 s and 1 h) across the processes sharing the prefix, that deletes the
    /// token keys of free names whose token is older than the retention by this client's
    /// clock. Tokens still never go back: a name's next token is at least the granting
    /// client's clock in microseconds, past a deleted token by the retention, so only a
    /// client clock behind the sweeping client's by more than the retention could repeat
    /// one. Processes sharing a prefix with different retentions: the shortest applies.
    pub fn token_retention(mut self, retention: Duration) -> Self {
        self.token_retention = retention;
        self
    }

    /// Validates the settings, connects, and learns the cluster's minimum lease TTL.
    ///
    /// # Errors
    /// [`LockError::Config`] for invalid settings or rejected credentials;
    /// [`LockError::Unavailable`] when no endpoint answers within the timeouts.
    pub async fn build(self) -> Result<EtcdBackend, LockError> {
        let settings = self.validate()?;
        let members = Members::new(
            settings.endpoints,
            self.connect_options(),
            self.connect_timeout,
            self.request_timeout,
        );
        probe_access(&members, &settings.prefix).await?;
        let server_min = probe_min_lease_ttl(&members).await?;
        let (min, max) = self
            .ttl_bounds
            .unwrap_or((Duration::from_secs(1), ETCD_MAX_LEASE_TTL));
        let min = min.max(server_min);
        if min > max {
            return Err(LockError::Config(format!(
                "the TTL bounds end at {max:?}, below this cluster's minimum lease TTL of \
                 {server_min:?}"
            )));
        }
        Ok(EtcdBackend::from_parts(
            members,
            settings.prefix,
            self.user.map(|(name, _)| name),
            server_min,
            (min, max),
            self.token_retention,
        ))
    }

    fn validate(&self) -> Result<Validated, LockError> {
        if self.endpoints.is_empty() {
            return Err(LockError::Config(
                "no etcd endpoint: call `endpoint(..)` or `endpoints(..)`".into(),
            ));
        }
        let mut endpoints = Vec::with_capacity(self.endpoints.len());
        for endpoint in &self.endpoints {
            let endpoint = endpoint.trim();
            let normalized = if endpoint.starts_with("http://") || endpoint.starts_with("https://")
            {
                endpoint.to_owned()
            } else if endpoint.contains("://") {
                return Err(LockError::Config(format!(
                    "etcd endpoint {} must use http:// or https://",
                    shown(endpoint)
                )));
            } else {
                format!("http://{endpoint}")
            };
            if normalized.ends_with("://") {
                return Err(LockError::Config(format!(
                    "etcd endpoint {} has no host",
                    shown(endpoint)
                )));
            }
            if normalized.contains('@') {
                return Err(LockError::Config(format!(
                    "etcd endpoint {} holds a user or password: give them with \
                     `credentials(user, password)`",
                    shown(endpoint)
                )));
            }
            let https = normalized.starts_with("https://");
            if https != self.tls.is_some() {
                return Err(LockError::Config(format!(
                    "etcd endpoint {normalized}: TLS settings are {} but the endpoint uses {}; \
                     use https:// endpoints with TLS settings and http:// without",
                    if self.tls.is_some() {
                        "given"
                    } else {
                        "missing"
                    },
                    if https { "https" } else { "http" },
                )));
            }
            endpoints.push(normalized);
        }
        if let Some(ca) = self.tls.as_ref().and_then(|tls| tls.ca_pem.as_deref())
            && !is_pem_certificate(ca)
        {
            // Caught here: the TLS layer would only fail later, on every member, as if the
            // cluster were unreachable.
            return Err(LockError::Config(
                "the TLS CA given to `tls_ca_pem` holds no PEM certificate \
                 (-----BEGIN CERTIFICATE-----)"
                    .into(),
            ));
        }
        let prefix = self.key_prefix.trim_end_matches('/');
        if prefix.is_empty() {
            return Err(LockError::Config("the key prefix must not be empty".into()));
        }
        if let Some((user, _)) = &self.user
            && user.is_empty()
        {
            return Err(LockError::Config("the etcd user name is empty".into()));
        }
        if let Some((min, max)) = self.ttl_bounds {
            for bound in [min, max] {
                if bound.is_zero() || bound.subsec_nanos() != 0 {
                    return Err(LockError::Config(format!(
                        "TTL bound {bound:?} must be a positive whole number of seconds: etcd \
                         leases are granted in whole seconds"
                    )));
                }
            }
            if min > max || max > ETCD_MAX_LEASE_TTL {
                return Err(LockError::Config(format!(
                    "TTL bounds {min:?}..={max:?} must satisfy min <= max <= {ETCD_MAX_LEASE_TTL:?}"
                )));
            }
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(LockError::Config(
                "the request and connect timeouts must be greater than zero".into(),
            ));
        }
        if !(MIN_TOKEN_RETENTION..=MAX_TOKEN_RETENTION).contains(&self.token_retention) {
            return Err(LockError::Config(format!(
                "token retention {:?} is out of range {MIN_TOKEN_RETENTION:?}..={MAX_TOKEN_RETENTION:?}",
                self.token_retention
            )));
        }
        Ok(Validated {
            endpoints,
            prefix: prefix.to_owned(),
        })
    }

    fn connect_options(&self) -> ConnectOptions {
        // `require_leader` makes a member without a leader fail at once ("no leader": the
        // request was not proposed) instead of holding the request until the timeout.
        // HTTP/2 keep-alive pings notice a dead connection under an open call or watch, so
        // the channel reconnects. etcd sends a client away (`GOAWAY too_many_pings`, failing
        // any call made as the connection closes) at the third ping in a row sooner than its
        // `--grpc-keepalive-min-time` (5 s as shipped) after the last while a stream is open,
        // and at any ping while none is: so every `KEEP_ALIVE_INTERVAL`, and never while idle.
        // An idle connection that died is found by TCP keepalive, or by the next call's
        // request timeout.
        // Auth tokens expire (a JWT after its TTL, a simple token on each member once unused
        // there for `--auth-token-ttl`): a call refused with "invalid auth token" (refused
        // before it was proposed) authenticates again and is sent once more.
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_require_leader(true)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, self.request_timeout)
            .with_keep_alive_while_idle(false)
            .with_tcp_keepalive(TCP_KEEPALIVE_IDLE)
            .with_auto_token_refresh(true);
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(tls) = &self.tls {
            let mut config = TlsOptions::new();
            if let Some(ca) = &tls.ca_pem {
                config = config.ca_certificate(Certificate::from_pem(ca));
            }
            if let Some((cert, key)) = &tls.identity_pem {
                config = config.identity(Identity::from_pem(cert, key));
            }
            if let Some(domain) = &tls.domain {
                config = config.domain_name(domain.clone());
            }
            options = options.with_tls(config);
        }
        options
    }
}

/// An endpoint fit for `Debug` and messages: a password written into it (which `validate`
/// refuses) is hidden.
fn shown(endpoint: &str) -> String {
    if endpoint.contains("://") {
        return redact_url(endpoint);
    }
    let shown = redact_url(&format!("http://{endpoint}"));
    shown
        .strip_prefix("http://")
        .map_or_else(|| shown.clone(), str::to_owned)
}

/// True when `pem` holds at least one PEM certificate block.
fn is_pem_certificate(pem: &[u8]) -> bool {
    const BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----";
    pem.windows(BEGIN.len()).any(|w| w == BEGIN)
}

struct Validated {
    endpoints: Vec<String>,
    prefix: String,
}

/// Reads (counts) the lock keys once, so that missing or rejected credentials, and a user
/// without access to the prefix, fail `build()` instead of the first lock call.
async fn probe_access(members: &Members, prefix: &str) -> Result<(), LockError> {
    let locks = format!("{prefix}/locks/");
    members
        .call(Effect::None, |client| {
            let locks = locks.clone();
            let options = GetOptions::new().with_prefix().with_count_only();
            async move { client.kv_client().get(locks, Some(options)).await }
        })
        .await
        .map(drop)
}

/// Grants a 1-second lease and reads back the TTL the cluster actually gave it: etcd
/// silently raises a TTL below its minimum (about 1.5 election timeouts, rounded up to whole
/// seconds: 2 s with the default 1 s election timeout), so this is the shortest TTL it honours.
async fn probe_min_lease_ttl(members: &Members) -> Result<Duration, LockError> {
    let granted = members
        .call(Effect::None, |client| async move {
            client.lease_client().grant(1, None).await
        })
        .await?;
    // The probe lease holds no key; if this revoke is lost it simply expires.
    let id = granted.id();
    let _ = members
        .call(Effect::None, |client| async move {
            client.lease_client().revoke(id).await
        })
        .await;
    let seconds = u64::try_from(granted.ttl()).unwrap_or(0).max(1);
    Ok(Duration::from_secs(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_password() {
        let b = EtcdBuilder::new()
            .endpoint("127.0.0.1:2379")
            .credentials("worker", "hunter2-secret");
        let shown = format!("{b:?}");
        assert!(shown.contains("worker"), "{shown}");
        assert!(!shown.contains("hunter2-secret"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn a_password_written_into_an_endpoint_is_refused_and_never_shown() {
        for endpoint in [
            "http://root:hun#ter2@127.0.0.1:2379",
            "http://root:hun,ter2@127.0.0.1:2379",
            "root:hun?ter2@127.0.0.1:2379",
            "https://root:hun/ter2@127.0.0.1:2379",
            "etcd://root:hun@ter2@127.0.0.1:2379",
        ] {
            let builder = EtcdBuilder::new().endpoint(endpoint);
            let shown = format!("{builder:?}");
            assert!(!shown.contains("ter2"), "{shown}");
            let Err(LockError::Config(message)) = builder.validate().map(drop) else {
                panic!("{endpoint} was accepted");
            };
            assert!(!message.contains("ter2"), "{message}");
        }
        let shown = format!("{:?}", EtcdBuilder::new().endpoint("127.0.0.1:2379"));
        assert!(shown.contains("[\"127.0.0.1:2379\"]"), "{shown}");
    }

    #[test]
    fn settings_are_validated_before_connecting() {
        let cases = [
            EtcdBuilder::new(),
            EtcdBuilder::new().endpoint("redis://127.0.0.1:6379"),
            EtcdBuilder::new().endpoint("http://"),
            EtcdBuilder::new().endpoint("https://127.0.0.1:2379"),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .key_prefix("/"),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .credentials("", "x"),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .ttl_bounds(Duration::from_millis(1500), Duration::from_secs(10)),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .ttl_bounds(Duration::from_secs(10), Duration::from_secs(5)),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .request_timeout(Duration::ZERO),
            EtcdBuilder::new()
                .endpoint("https://127.0.0.1:2379")
                .tls_ca_pem("not a certificate"),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .token_retention(MIN_TOKEN_RETENTION - Duration::from_millis(1)),
            EtcdBuilder::new()
                .endpoint("127.0.0.1:2379")
                .token_retention(MAX_TOKEN_RETENTION + Duration::from_secs(1)),
        ];
        for builder in cases {
            assert!(
                matches!(builder.validate(), Err(LockError::Config(_))),
                "{builder:?} should be refused"
            );
        }
        let ok = EtcdBuilder::new()
            .endpoints(["127.0.0.1:2379", "http://127.0.0.1:2380"])
            .key_prefix("jobs/")
            .validate()
            .unwrap();
        assert_eq!(
            ok.endpoints,
            ["http://127.0.0.1:2379", "http://127.0.0.1:2380"]
        );
        assert_eq!(ok.prefix, "jobs");
    }
}
