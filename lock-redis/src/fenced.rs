//! [`RedisFencedResource`]: downstream token gating kept in Redis. One script stores the
//! highest token admitted per resource, so concurrent writers are judged atomically; the
//! fenced write runs the check and the write in one script.

use async_trait::async_trait;
use distlock_core::{Admission, EnforcementMode, FencedResource, FencingToken, LockError, decide};

use crate::backend::RedisBackend;
use crate::keys::fenced_resource_key;
use crate::scripts::{ADMIT_SCRIPT, ADMIT_WRITE_SCRIPT};

/// A [`FencedResource`] in Redis: `<prefix>:fenced:{<resource>}` holds the highest token
/// admitted for the resource and `<prefix>:fenced:{<resource>}:data` its value (neither
/// has a TTL).
///
/// In [`EnforcementMode::Shadow`] a stale token is logged, counted in
/// `distlock_fence_rejected_total{mode="shadow"}` and let through; in
/// [`EnforcementMode::Enforce`] it is rejected. A stale token never lowers the stored one.
///
/// [`FencedResource::write`] is one script: it compares the token, stores it as the
/// highest and, only when admitted (or let through in shadow mode), sets the value. No
/// newer token can be admitted between the check and the write, and both keys share the
/// resource's hash tag, so this works on a Redis Cluster too. It needs only the commands of
/// README's ACL line (`GET`, `SET`).
///
/// ```no_run
/// # async fn run(backend: distlock::redis::RedisBackend, token: distlock::FencingToken)
/// # -> Result<(), distlock::LockError> {
/// use distlock::{EnforcementMode, FencedResource};
/// use distlock::redis::RedisFencedResource;
///
/// let ledger = RedisFencedResource::new(backend, EnforcementMode::Enforce);
/// if !ledger.write("account:7", token, b"10").await?.is_admitted() {
///     // A newer holder has written: this worker is stale and wrote nothing.
/// }
/// assert!(ledger.read("account:7").await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RedisFencedResource {
    backend: RedisBackend,
    mode: EnforcementMode,
}

impl RedisFencedResource {
    /// A fenced resource on the same servers (and key prefix) as `backend`.
    pub fn new(backend: RedisBackend, mode: EnforcementMode) -> Self {
        Self { backend, mode }
    }

    /// The enforcement mode.
    pub fn mode(&self) -> EnforcementMode {
        self.mode
    }
}

/// The highest admitted token as the scripts return it (`''` when none).
fn parse_latest(latest: &str) -> Result<Option<FencingToken>, LockError> {
    if latest.is_empty() {
        return Ok(None);
    }
    latest.parse().map(|t| Some(FencingToken(t))).map_err(|_| {
        LockError::backend(
            "redis",
            format!("the fenced resource holds a non-numeric token {latest:?}"),
        )
    })
}

#[async_trait]
impl FencedResource for RedisFencedResource {
    async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<Admission, LockError> {
        let fence = fenced_resource_key(self.backend.key_prefix(), resource);
        let data = format!("{fence}:data");
        let token_arg = token.get().to_string();
        let shadow: &[u8] = match self.mode {
            EnforcementMode::Shadow => b"1",
            EnforcementMode::Enforce => b"0",
        };
        let latest: String = self
            .backend
            .core()
            .run_script_on(
                "fenced_write",
                &ADMIT_WRITE_SCRIPT,
                &[fence, data],
                &[token_arg.as_bytes(), shadow, value],
            )
            .await?;
        Ok(decide(self.mode, resource, token, parse_latest(&latest)?))
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, LockError> {
        let data = format!(
            "{}:data",
            fenced_resource_key(self.backend.key_prefix(), resource)
        );
        let mut get = redis::cmd("GET");
        get.arg(data);
        self.backend.core().read_command("fenced_read", &get).await
    }

    async fn check_only(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, LockError> {
        let latest: String = self
            .backend
            .core()
            .run_script("admit", &ADMIT_SCRIPT, resource, token.get())
            .await?;
        Ok(decide(self.mode, resource, token, parse_latest(&latest)?))
    }
}
