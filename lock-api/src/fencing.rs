//! Downstream enforcement of fencing tokens: a resource admits a write only when its
//! token is not lower than the highest token it has seen.
//!
//! The check protects a write only when the write is conditional on it in the same
//! transaction or script; see [`FencedResource`].
//!
//! Roll it out in [`EnforcementMode::Shadow`] first (stale writes are logged and counted,
//! and let through), then switch to [`EnforcementMode::Enforce`].
//!
//! A holder fences its writes with a [`WriteFence`], its lease's key and token together
//! ([`FencedResourceExt`]), so a token is never checked against another key's.

mod write_fence;

pub use write_fence::{FencedResourceExt, WriteFence};

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
///
/// # The write must be conditional on the token, in the same step
///
/// [`FencedResource::write`] is the fenced write: the store compares the token with the
/// highest it has admitted for the resource, records it, and stores the value only when
/// admitted, **in one atomic step** (a script, a transaction). A holder that pauses and
/// wakes after a newer holder has written is refused, not applied late.
///
/// [`FencedResource::check_only`] records the token and says whether a write may go
/// ahead, but writes nothing. Checking first and writing elsewhere afterwards is not
/// fencing: a holder that pauses between `Admitted` and its write (a GC pause, a slow
/// network, a descheduled process) still writes after a newer holder has been admitted,
/// and overwrites it. Call it on its own only where a late write is harmless: to try out
/// [`EnforcementMode::Shadow`], or to count stale workers.
///
/// Where the side effect is not a value this store keeps, make it conditional on the
/// token in the store that has it:
///
/// - PostgreSQL: `PgFencedResource::admit_in(&mut tx, ..)`, then the write in the same
///   `tx`, committed together (the token row stays locked until the commit);
/// - in memory: [`MemoryFencedResource::admit_with`], which runs the write under the
///   same lock as the check;
/// - any other store: make the token part of the write's own condition
///   (`UPDATE .. SET .., fence = $token WHERE id = $id AND fence <= $token`, a script that
///   compares and sets), and treat "nothing changed" as stale.
///
/// # Which name goes with which token
///
/// Tokens are ordered per key: a resource name must only ever be given tokens of one
/// key. A semaphore's permits are leases on different slots, whose tokens are not ordered
/// against each other: fenced under the semaphore's name, a holder of one slot is refused
/// after a holder of another wrote with a higher token, though both hold their permits.
/// Pass a [`WriteFence`] instead ([`FencedResourceExt::write_under`] with
/// [`Permit::fence`](crate::locker::semaphore::Permit::fence) or [`WriteFence::of`] a lock's guard): it names
/// the key its token was granted on.
///
/// Every implementation admits a token equal to the highest seen (the newest holder may
/// write many times), never lowers the recorded token, and in shadow mode stores a stale
/// token's value too (logged and counted) without lowering the token.
#[async_trait]
pub trait FencedResource: Send + Sync {
    /// The fenced write: stores `value` as `resource`'s value if `token` is at least the
    /// highest admitted so far, and records `token` as the highest, in one atomic step of
    /// the store. A stale token writes nothing in enforce mode.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled write may or may not have been applied (never a stale
    /// one in enforce mode).
    async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<Admission, LockError>;

    /// The value last stored by [`FencedResource::write`] for `resource`, if any.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, LockError>;

    /// **Check only, not atomic with any write:** admits `token` for `resource` if it is at
    /// least the highest admitted so far, and records it as the highest. Nothing stops this
    /// caller from writing after a newer holder is admitted; see the trait docs.
    ///
    /// # Cancel safety
    /// A cancelled call may or may not have recorded `token`; it never writes.
    async fn check_only(&self, resource: &str, token: FencingToken)
    -> Result<Admission, LockError>;
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
            telemetry::stale_write(mode.as_str(), resource, token, latest);
            match mode {
                EnforcementMode::Shadow => Admission::ShadowStale { latest },
                EnforcementMode::Enforce => Admission::Stale { latest },
            }
        }
        _ => Admission::Admitted,
    }
}

/// An in-memory fenced resource: the highest admitted token and the value written, per
/// resource name.
#[derive(Debug, Default)]
pub struct MemoryFencedResource {
    mode: EnforcementMode,
    fences: Mutex<HashMap<String, Fence>>,
}

/// What a [`MemoryFencedResource`] keeps for one resource.
#[derive(Debug, Default)]
struct Fence {
    latest: Option<FencingToken>,
    value: Option<Vec<u8>>,
}

impl MemoryFencedResource {
    /// A resource in the given mode.
    pub fn new(mode: EnforcementMode) -> Self {
        Self {
            mode,
            fences: Mutex::new(HashMap::new()),
        }
    }

    /// The highest token admitted for `resource`.
    pub fn latest(&self, resource: &str) -> Option<FencingToken> {
        self.fences.lock().get(resource).and_then(|f| f.latest)
    }

    /// [`FencedResource::check_only`], synchronously: **check only**.
    pub fn check_only_now(&self, resource: &str, token: FencingToken) -> Admission {
        self.admit_with(resource, token, || {})
    }

    /// The atomic form for a write this resource does not keep: checks `token` and, if the
    /// write is admitted, runs `write` while still holding the lock the check took, so no
    /// newer token can be admitted in between. A stale token in enforce mode does not run
    /// `write`.
    ///
    /// ```
    /// use distlock::{EnforcementMode, FencingToken, MemoryFencedResource};
    ///
    /// let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    /// let mut balance = 0;
    /// ledger.admit_with("account:7", FencingToken(2), || balance += 10);
    /// // A paused older holder wakes up: its write is refused, not applied late.
    /// let late = ledger.admit_with("account:7", FencingToken(1), || balance += 10);
    /// assert!(!late.is_admitted());
    /// assert_eq!(balance, 10);
    /// ```
    pub fn admit_with(
        &self,
        resource: &str,
        token: FencingToken,
        write: impl FnOnce(),
    ) -> Admission {
        self.admit_then(resource, token, |_| write())
    }

    /// [`MemoryFencedResource::admit_with`] under a [`WriteFence`]: its key and its token.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::{EnforcementMode, LockKey, Locker, MemoryFencedResource};
    ///
    /// let locker = Locker::new(distlock::connect("memory://").await?)?;
    /// let exports = locker.semaphore(&LockKey::new("exports:tenant-7")?, 2)?;
    /// let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    /// let permit = exports.acquire().await?;
    /// let mut sent = 0;
    /// assert!(ledger.admit_under(&permit.fence(), || sent += 1).is_admitted());
    /// assert_eq!(sent, 1);
    /// # Ok(()) }
    /// ```
    pub fn admit_under(&self, fence: &WriteFence, write: impl FnOnce()) -> Admission {
        self.admit_with(fence.key().as_str(), fence.token(), write)
    }

    /// Decides `token` for `resource` and, if admitted, runs `write` on the resource's
    /// entry, all under the lock.
    fn admit_then(
        &self,
        resource: &str,
        token: FencingToken,
        write: impl FnOnce(&mut Fence),
    ) -> Admission {
        let mut fences = self.fences.lock();
        let fence = fences.entry(resource.to_owned()).or_default();
        let admission = decide(self.mode, resource, token, fence.latest);
        if fence.latest.is_none_or(|seen| token > seen) {
            fence.latest = Some(token);
        }
        if admission.is_admitted() {
            write(fence);
        }
        admission
    }
}

#[async_trait]
impl FencedResource for MemoryFencedResource {
    async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<Admission, LockError> {
        Ok(self.admit_then(resource, token, |fence| {
            fence.value = Some(value.to_vec());
        }))
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, LockError> {
        Ok(self
            .fences
            .lock()
            .get(resource)
            .and_then(|f| f.value.clone()))
    }

    async fn check_only(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, LockError> {
        Ok(self.check_only_now(resource, token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforce_rejects_lower_tokens_and_admits_equal_or_higher() {
        let r = MemoryFencedResource::new(EnforcementMode::Enforce);
        assert_eq!(r.check_only_now("a", FencingToken(5)), Admission::Admitted);
        assert_eq!(r.check_only_now("a", FencingToken(5)), Admission::Admitted);
        assert_eq!(
            r.check_only_now("a", FencingToken(4)),
            Admission::Stale {
                latest: FencingToken(5)
            }
        );
        assert_eq!(r.check_only_now("a", FencingToken(9)), Admission::Admitted);
        assert_eq!(r.latest("a"), Some(FencingToken(9)));
        // Resources are independent.
        assert_eq!(r.check_only_now("b", FencingToken(1)), Admission::Admitted);
    }

    #[test]
    fn shadow_lets_a_stale_write_through_but_reports_it() {
        let r = MemoryFencedResource::new(EnforcementMode::Shadow);
        r.check_only_now("a", FencingToken(5));
        let a = r.check_only_now("a", FencingToken(3));
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
    fn admit_with_applies_a_write_only_under_an_admitted_token() {
        let r = MemoryFencedResource::new(EnforcementMode::Enforce);
        let mut writes = Vec::new();
        r.admit_with("a", FencingToken(1), || writes.push(1));
        r.admit_with("a", FencingToken(3), || writes.push(3));
        let late = r.admit_with("a", FencingToken(2), || writes.push(2));
        assert_eq!(
            late,
            Admission::Stale {
                latest: FencingToken(3)
            }
        );
        assert_eq!(writes, [1, 3], "the stale write was applied");

        let shadow = MemoryFencedResource::new(EnforcementMode::Shadow);
        shadow.admit_with("a", FencingToken(3), || {});
        let mut applied = false;
        assert!(
            shadow
                .admit_with("a", FencingToken(2), || applied = true)
                .was_stale()
        );
        assert!(applied, "shadow mode lets the stale write through");
    }

    #[tokio::test]
    async fn write_stores_the_value_of_an_admitted_token_only() {
        let r = MemoryFencedResource::new(EnforcementMode::Enforce);
        assert_eq!(r.read("a").await.unwrap(), None);
        let write = |token, value: &'static [u8]| r.write("a", FencingToken(token), value);
        assert_eq!(write(2, b"two").await.unwrap(), Admission::Admitted);
        assert!(!write(1, b"one").await.unwrap().is_admitted());
        assert_eq!(r.read("a").await.unwrap().as_deref(), Some(&b"two"[..]));
        assert_eq!(write(2, b"again").await.unwrap(), Admission::Admitted);
        assert_eq!(r.read("a").await.unwrap().as_deref(), Some(&b"again"[..]));

        let shadow = MemoryFencedResource::new(EnforcementMode::Shadow);
        shadow.write("a", FencingToken(3), b"three").await.unwrap();
        assert!(
            shadow
                .write("a", FencingToken(2), b"late")
                .await
                .unwrap()
                .was_stale()
        );
        assert_eq!(
            shadow.read("a").await.unwrap().as_deref(),
            Some(&b"late"[..])
        );
        assert_eq!(shadow.latest("a"), Some(FencingToken(3)));
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
