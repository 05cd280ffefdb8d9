//! Replica acknowledgements ([`RedisBackendBuilder::replica_acks`]): each acquire is
//! followed by `WAIT` in the same round trip, and a grant too few replicas acknowledged in
//! time is released again.
//!
//! [`RedisBackendBuilder::replica_acks`]: crate::RedisBackendBuilder::replica_acks

use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockError, LockKey, OwnerId};
use redis::Value;
use tokio::time::Instant;

use super::{AbandonOnDrop, NAME, RedisBackend, parse_token};
use crate::error::map_error;

impl RedisBackend {
    /// An acquire followed by `WAIT` in the same round trip. Whatever it took is given back
    /// in the background when its future is dropped before it returns, and when it fails
    /// after taking the key.
    pub(super) async fn acquire_with_replicas(
        &self,
        key: &LockKey,
        ttl: Duration,
        replicas: usize,
        wait: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let keys = self.keys(key);
        let owner = OwnerId::random();
        let call = self.acquire_call(&keys, owner, ttl);
        let mut wait_cmd = redis::cmd("WAIT");
        wait_cmd.arg(replicas).arg(wait.as_millis().to_string());
        let mut pending = AbandonOnDrop {
            backend: self,
            attempt: Some((keys, owner)),
            ttl,
        };
        let sent = Instant::now();
        let replies = self
            .timed(
                "acquire",
                true,
                self.inner.conn.invoke_with(&call, &[wait_cmd]),
            )
            .await;
        let mut replies = match replies {
            Ok(r) => r.into_iter(),
            Err(e) => {
                if !matches!(e, LockError::OutcomeUnknown { .. }) {
                    pending.attempt = None;
                }
                return Err(e);
            }
        };
        // The script's own error, or no grant: nothing was taken.
        let Some(token) = parse_token(replies.next()).inspect_err(|_| pending.attempt = None)?
        else {
            pending.attempt = None;
            return Ok(None);
        };
        let acked: i64 = match replies.next().map(Value::extract_error) {
            Some(Ok(v)) => redis::from_redis_value(v).map_err(|e| LockError::backend(NAME, e))?,
            Some(Err(e)) => return Err(map_error("acquire", true, &e)),
            None => 0,
        };
        let lease = self.lease(key, owner, token, ttl, sent);
        if usize::try_from(acked).unwrap_or(0) < replicas {
            let short = format!(
                "only {acked} of {replicas} replicas acknowledged the lock within {wait:?}"
            );
            return match self.release(&lease).await {
                Ok(_) => {
                    pending.attempt = None;
                    Err(LockError::unavailable(
                        NAME,
                        format!("{short}; it was released"),
                    ))
                }
                // The lock may still be held (until its TTL, or until the cleanup that
                // dropping `pending` starts gets through).
                Err(e) => Err(LockError::outcome_unknown(
                    NAME,
                    "acquire",
                    format!("{short}; releasing it failed ({e})"),
                )),
            };
        }
        pending.attempt = None;
        Ok(Some(lease))
    }

    /// `acquire_many` with replica acknowledgements: each grant needs its own `WAIT`
    /// verdict, so the keys are taken one at a time. A failed batch holds nothing.
    pub(super) async fn acquire_many_with_replicas(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let mut taken = ReleaseOnDrop {
            backend: self,
            leases: Vec::new(),
        };
        let mut granted: Vec<bool> = Vec::with_capacity(keys.len());
        for key in keys {
            match self.acquire(key, ttl).await {
                Ok(lease) => {
                    granted.push(lease.is_some());
                    taken.leases.extend(lease);
                }
                Err(e) => {
                    // A failed batch holds nothing: give back what it took (what this
                    // cannot give back, dropping `taken` tries again in the background).
                    return match self.release_many(&taken.leases).await {
                        Ok(_) => {
                            taken.leases.clear();
                            Err(e)
                        }
                        Err(release) => Err(LockError::outcome_unknown(
                            NAME,
                            "acquire_many",
                            format!(
                                "{e}; releasing the {} locks taken before failed ({release})",
                                taken.leases.len()
                            ),
                        )),
                    };
                }
            }
        }
        let mut leases = std::mem::take(&mut taken.leases).into_iter();
        Ok(granted
            .into_iter()
            .map(|g| if g { leases.next() } else { None })
            .collect())
    }
}

/// Leases a batch has taken so far: released in the background if the batch's future is
/// dropped before it hands them over.
struct ReleaseOnDrop<'a> {
    backend: &'a RedisBackend,
    leases: Vec<Lease>,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        if leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.backend.clone();
        runtime.spawn(async move {
            let released = backend.release_many(&leases).await;
            tracing::debug!(
                leases = leases.len(),
                done = released.is_ok(),
                "released the leases of a batch whose caller had gone"
            );
        });
    }
}
