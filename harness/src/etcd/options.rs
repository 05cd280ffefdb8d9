//! What a test can ask of an etcd member beyond a plain one: TLS on its client URL
//! ([`EtcdTls`]), authentication ([`EtcdAuth`]) and a small database with automatic
//! compaction ([`EtcdSpace`]).

use std::time::Duration;

use crate::error::HarnessError;

/// The PEM files of a TLS client URL: the server's certificate and key, and the CA that
/// signed it, for clients to trust. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct EtcdTls {
    /// The server certificate (PEM), valid for `127.0.0.1`.
    pub cert_pem: String,
    /// The server's private key (PEM).
    pub key_pem: String,
    /// The CA certificate (PEM) that signed `cert_pem`.
    pub ca_pem: String,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("cert_pem", &format!("<{} bytes>", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .field("ca_pem", &format!("<{} bytes>", self.ca_pem.len()))
            .finish()
    }
}

/// Authentication for a test etcd: the user [`EtcdAuth::USER`] (with etcd's `root` role)
/// and its password, and simple tokens (`--auth-token=simple`) that a member forgets once
/// they have not been used there for `token_ttl` (`--auth-token-ttl`). Its `Debug` never
/// shows the password.
#[derive(Clone)]
pub struct EtcdAuth {
    /// The password of [`EtcdAuth::USER`].
    pub password: String,
    /// How long a token stays valid on a member without being used there (whole seconds,
    /// at least 1 s).
    pub token_ttl: Duration,
}

impl EtcdAuth {
    /// The user that is created: etcd's superuser, which may do everything.
    pub const USER: &'static str = "root";

    /// `root` with `password`, tokens expiring after `token_ttl` unused.
    pub fn new(password: impl Into<String>, token_ttl: Duration) -> Self {
        Self {
            password: password.into(),
            token_ttl,
        }
    }

    pub(super) fn token_ttl_seconds(&self) -> Result<u64, HarnessError> {
        if self.token_ttl.subsec_nanos() != 0 || self.token_ttl.is_zero() {
            return Err(HarnessError::Setup(format!(
                "the etcd token TTL {:?} must be a positive whole number of seconds",
                self.token_ttl
            )));
        }
        Ok(self.token_ttl.as_secs())
    }
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &Self::USER)
            .field("password", &"<redacted>")
            .field("token_ttl", &self.token_ttl)
            .finish()
    }
}

/// A space quota and automatic compaction, as operators run etcd: `--quota-backend-bytes`
/// (etcd refuses every write with `NOSPACE` once its database file reaches it) and
/// `--auto-compaction-mode=periodic --auto-compaction-retention` (history older than the
/// retention is compacted away, so its pages are reused; the live keys stay).
#[derive(Debug, Clone, Copy)]
pub struct EtcdSpace {
    /// The database quota in bytes.
    pub quota_bytes: u64,
    /// How much history automatic compaction keeps (whole seconds, at least 1 s).
    pub compaction_retention: Duration,
}

impl EtcdSpace {
    pub(super) fn args(&self) -> Result<[String; 3], HarnessError> {
        let retention = self.compaction_retention;
        if retention.subsec_nanos() != 0 || retention.is_zero() || self.quota_bytes == 0 {
            return Err(HarnessError::Setup(format!(
                "{self:?}: the quota must be positive and the retention a positive whole \
                 number of seconds"
            )));
        }
        Ok([
            format!("--quota-backend-bytes={}", self.quota_bytes),
            "--auto-compaction-mode=periodic".to_owned(),
            format!("--auto-compaction-retention={}s", retention.as_secs()),
        ])
    }
}
