//! [`Claim`]: a lock taken by one process and held on by another, for a job that must
//! stay unique from the moment it is enqueued (its producer claims the key) until it has
//! started or finished (its worker resumes the claim).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::backend::lease::Renewal;
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};
use crate::locker::guard::LockGuard;
use crate::locker::{Locker, refuse_permit_slot};
use crate::telemetry::Kind;

/// A key taken by [`Locker::claim`] and not renewed by anyone until a process resumes it
/// with [`Locker::resume`]: what a job's producer puts into the job, for its worker.
///
/// It carries the lease's owner id, which releases it: treat it as a secret of the job,
/// as the job's arguments are (it is not printed by `Debug`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    key: LockKey,
    owner: OwnerId,
    token: FencingToken,
}

impl Claim {
    /// The claimed key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token of the claim's lease, which a resumed guard keeps.
    pub fn token(&self) -> FencingToken {
        self.token
    }
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Locker {
    /// Takes `key` for `ttl` and hands it over as a [`Claim`] instead of a guard: nothing
    /// renews it until a process [resumes](Locker::resume) it, so `ttl` must cover the
    /// time until then (a job's longest wait in its queue). `None` when the key is held
    /// (claimed for a job already enqueued: do not enqueue this one). A TTL the store
    /// cannot honour is an error before anything is sent.
    ///
    /// # Cancel safety
    /// As [`Locker::try_lock`]: dropped after the store granted it, the claim is lost and
    /// the key frees itself when `ttl` runs out.
    pub async fn claim(&self, key: &LockKey, ttl: Duration) -> Result<Option<Claim>, LockError> {
        refuse_permit_slot(key)?;
        self.backend().capabilities().check_ttl(ttl)?;
        let granted = self.backend().acquire(key, ttl).await?;
        Ok(granted.map(|lease| Claim {
            key: lease.key().clone(),
            owner: lease.owner(),
            token: lease.token(),
        }))
    }

    /// Goes on holding a [`Claim`] made by any process: renews its lease with this
    /// locker's TTL and returns a guard the watchdog renews from then on, with the claim's
    /// token, or `None` when the claim's lease has ended (its TTL ran out, or the key
    /// went to another holder since). Unsupported ([`LockError::Unsupported`]) on a
    /// backend whose leases carry a private handle (PostgreSQL advisory locks, bound to
    /// the session that took them).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before the renewal's reply, the claim is left as it was
    /// (renewed or not), to run out at its TTL or be resumed again.
    pub async fn resume(&self, claim: &Claim) -> Result<Option<LockGuard>, LockError> {
        let lease = self
            .backend()
            .adopt(&claim.key, claim.owner, claim.token, self.ttl())?;
        let sent = Instant::now();
        match self.backend().renew(&lease).await? {
            Renewal::Renewed { valid_until } => Ok(Some(self.guard(
                lease.with_valid_until(valid_until),
                sent,
                Kind::Lock,
            ))),
            Renewal::Lost => Ok(None),
            Renewal::Unreachable => Err(LockError::unavailable(
                self.backend().name(),
                format!(
                    "the store did not answer the renewal of the claim on {}",
                    claim.key
                ),
            )),
        }
    }
}
