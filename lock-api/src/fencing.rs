//! Downstream enforcement of fencing tokens: a resource admits a write only when its
//! token is not lower than the highest token it has seen.
//!
//! Roll it out in [`EnforcementMode::Shadow`] first (stale writes are logged and counted,
//! and let through), then switch to [`EnforcementMode::Enforce`].

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use async_trait::async_trait;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::LockError;
use crate::key::FencingToken;
use crate::telemetry;

/// How a fenced resource treats a stale token.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnforcementMode {
    /// Log and count the stale write, then let it through (for rollout).
    Shadow,
    /// Reject the stale write.
    #[default]
    Enforce,
}

impl EnforcementMode {
    /// `"shadow"` or `"enforce"`, as used in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shadow => "shadow",
            Self::Enforce => "enforce",
        }
    }
}

impl fmt::Display for EnforcementMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EnforcementMode {
    type Err = LockError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shadow" => Ok(Self::Shadow),
            "enforce" => Ok(Self::Enforce),
            other => Err(LockError::Config(format!(
                "unknown enforcement mode {other:?}: expected \"shadow\" or \"enforce\""
            ))),
        }
    }
}

/// The verdict on a write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Admission {
    /// The token is the highest seen (or equal to it): write.
    Admitted,
    /// The token is lower than `latest`: do not write; this worker is stale.
    Stale {
        /// The highest token the resource has admitted.
        latest: FencingToken,
    },
    /// Shadow mode: the token is lower than `latest`, the write is let through and counted.
    ShadowStale {
        /// The highest token the resource has admitted.
        latest: FencingToken,
    },
}

impl Admission {
    /// True when the caller may go ahead with the write.
    pub fn is_admitted(self) -> bool {
        !matches!(self, Self::Stale { .. })
    }

    /// True when the token was stale, whether or not the write was let through.
    pub fn was_stale(self) -> bool {
        !matches!(self, Self::Admitted)
    }
}

/// A downstream store that gates writes on fencing tokens.
#[async_trait]
pub trait FencedResource: Send + Sync {
    /// Admits a write to `resource` carrying `token` if `token` is at least the highest
    /// admitted so far, and records it as the highest.
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<Admission, LockError>;
}

/// Decides an admission from the highest token seen so far, records stale writes in
/// logs and metrics, and returns the new highest token to store (if it moved).
///
/// Shared by every [`FencedResource`] whose store can run this check atomically.
pub fn decide(
    mode: EnforcementMode,
    resource: &str,
    token: FencingToken,
    latest: Option<FencingToken>,
) -> Admission {
    match latest {
        Some(latest) if token < latest => {
            telemetry::stale_write(mode, resource, token, latest);
            match mode {
                EnforcementMode::Shadow => Admission::ShadowStale { latest },
                EnforcementMode::Enforce => Admission::Stale { latest },
            }
        }
        _ => Admission::Admitted,
    }
}

/// An in-memory fenced resource: the highest admitted token per resource name.
#[derive(Debug, Default)]
pub struct MemoryFencedResource {
    mode: EnforcementMode,
    latest: Mutex<HashMap<String, FencingToken>>,
}

impl MemoryFencedResource {
    /// A resource in the given mode.
    pub fn new(mode: EnforcementMode) -> Self {
        Self {
            mode,
            latest: Mutex::new(HashMap::new()),
        }
    }

    /// The highest token admitted for `resource`.
    pub fn latest(&self, resource: &str) -> Option<FencingToken> {
        self.latest.lock().get(resource).copied()
    }

    /// Admits synchronously; see [`FencedResource::admit`].
    pub fn admit_now(&self, resource: &str, token: FencingToken) -> Admission {
        let mut latest = self.latest.lock();
        let seen = latest.get(resource).copied();
        let admission = decide(self.mode, resource, token, seen);
        if seen.is_none_or(|s| token > s) {
            latest.insert(resource.to_owned(), token);
        }
        admission
    }
}

#[async_trait]
impl FencedResource for MemoryFencedResource {
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<Admission, LockError> {
        Ok(self.admit_now(resource, token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforce_rejects_lower_tokens_and_admits_equal_or_higher() {
        let r = MemoryFencedResource::new(EnforcementMode::Enforce);
        assert_eq!(r.admit_now("a", FencingToken(5)), Admission::Admitted);
        assert_eq!(r.admit_now("a", FencingToken(5)), Admission::Admitted);
        assert_eq!(
            r.admit_now("a", FencingToken(4)),
            Admission::Stale {
                latest: FencingToken(5)
            }
        );
        assert_eq!(r.admit_now("a", FencingToken(9)), Admission::Admitted);
        assert_eq!(r.latest("a"), Some(FencingToken(9)));
        // Resources are independent.
        assert_eq!(r.admit_now("b", FencingToken(1)), Admission::Admitted);
    }

    #[test]
    fn shadow_lets_a_stale_write_through_but_reports_it() {
        let r = MemoryFencedResource::new(EnforcementMode::Shadow);
        r.admit_now("a", FencingToken(5));
        let a = r.admit_now("a", FencingToken(3));
        assert_eq!(
            a,
            Admission::ShadowStale {
                latest: FencingToken(5)
            }
        );
        assert!(a.is_admitted() && a.was_stale());
        // A stale write never lowers the highest token.
        assert_eq!(r.latest("a"), Some(FencingToken(5)));
    }

    #[test]
    fn modes_parse_from_their_names() {
        assert_eq!(
            "shadow".parse::<EnforcementMode>().unwrap(),
            EnforcementMode::Shadow
        );
        assert!("strict".parse::<EnforcementMode>().is_err());
    }
}
