//! [`RedisFencedResource`]: downstream token gating kept in Redis. One script stores the
//! highest token admitted per resource, so concurrent writers are judged atomically.

use async_trait::async_trait;
use lock_api::{Admission, EnforcementMode, FencedResource, FencingToken, LockError, decide};

use crate::backend::RedisBackend;
use crate::scripts::ADMIT_SCRIPT;

/// A [`FencedResource`] in Redis: `<prefix>:fenced:{<resource>}` holds the highest token
/// admitted for the resource (no TTL).
///
/// In [`EnforcementMode::Shadow`] a stale token is logged, counted in
/// `distlock_fence_rejected_total{mode="shadow"}` and let through; in
/// [`EnforcementMode::Enforce`] it is rejected. A stale token never lowers the stored one.
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

#[async_trait]
impl FencedResource for RedisFencedResource {
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<Admission, LockError> {
        let latest: String = self
            .backend
            .run_script("admit", &ADMIT_SCRIPT, resource, token.get())
            .await?;
        let latest = if latest.is_empty() {
            None
        } else {
            Some(FencingToken(latest.parse().map_err(|_| {
                LockError::backend(
                    "redis",
                    format!("the fenced resource holds a non-numeric token {latest:?}"),
                )
            })?))
        };
        Ok(decide(self.mode, resource, token, latest))
    }
}
