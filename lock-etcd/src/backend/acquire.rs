//! Acquiring: read the name while a lease with the lock's TTL is found (a spare granted
//! ahead) or granted, and only if the name is free put the key on the lease in one
//! transaction, with the next token. Two round trips; with a spare, the transaction is the
//! only consensus write on the acquire's path.
//!
//! # Why a read comes first
//!
//! A refused attempt that began with the transaction would be a consensus write (etcd sends
//! a transaction that may write through raft even when its comparison fails), flushed to
//! disk on a quorum, exactly when a key is busy. A linearizable read answers "held" without
//! a write, and the lease the attempt did not use is put back as a spare (see `spare`) for
//! the next acquire instead of being revoked. An attempt grants beside its read only when
//! it has no spare and the last acquire of its TTL found its name free; once one is
//! refused, the next ones read first, so attempts on a busy key write nothing.
//!
//! # The token
//!
//! The next token is [`next_token`] of the newest one read, and the transaction puts it
//! only if the token key's `mod_revision` is still the one read: if another acquire was
//! granted (and released) since, the transaction reads the name again instead, and the
//! attempt goes on from what it found, on the same lease.
//!
//! # Cancel safety
//!
//! The lease an attempt uses is held by a [`Claim`] until a lock holds it. Dropped before a
//! transaction was sent (the read or the grant cancelled, the name held), the lease holds
//! no key and goes back to the spares; dropped once one was sent, it is revoked, which
//! deletes the key if the transaction put it. So no lock is left held by nobody, beyond
//! the moment the revoke takes (or, if the revoke is lost too, the lease's TTL).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::{FencingToken, Lease, LockError, LockKey, OwnerId, valid_until};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::time::Instant;
use tracing::debug;

use super::EtcdBackend;
use super::found::Found;
use super::lease::EtcdLease;
use super::spare::Spare;
use crate::error::Effect;
use crate::tokens::{encode, lock_value, next_token};

/// How many transactions one attempt sends while other acquires keep granting (and
/// releasing) the name between its read and its transaction; after that it is refused,
/// as a contended attempt is.
const TRANSACTIONS_PER_ATTEMPT: usize = 3;

/// The lease an acquire is using, until a lock holds it (see "Cancel safety" above).
struct Claim<'a> {
    backend: &'a EtcdBackend,
    seconds: i64,
    /// Set by the grant, which runs beside the read.
    lease: Mutex<Option<Spare>>,
    /// Whether a transaction that may have put the key on the lease was sent.
    put_sent: bool,
}

impl<'a> Claim<'a> {
    fn new(backend: &'a EtcdBackend, seconds: i64, spare: Option<Spare>) -> Self {
        Self {
            backend,
            seconds,
            lease: Mutex::new(spare),
            put_sent: false,
        }
    }

    fn lease(&mut self) -> Option<Spare> {
        *self
            .lease
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lease now holds a lock: nothing is to be done with it on drop.
    fn hold(mut self) {
        self.lease
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let Some(spare) = self
            .lease
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        else {
            return;
        };
        let spares = &self.backend.inner.spares;
        if !self.put_sent && spares.put_back(self.seconds, spare, Instant::now()) {
            return;
        }
        // The transaction may have put the key: revoking our own lease deletes it again, so
        // no key is held for a TTL by a caller that was told it does not hold it. A lease
        // too old to keep holds nothing and is revoked to free it early.
        self.backend.revoke_in_background(spare.id);
    }
}

impl EtcdBackend {
    /// Reads the name, with a spare lease taken or a lease granted beside the read (see
    /// `spare`) or, after a refused attempt, granted after it; if the name is free, puts
    /// the key on the lease with the next token. Validity counts from `sent`, taken before
    /// anything was sent, or from when the spare's grant was sent if that is earlier: a
    /// lease starts counting when etcd grants it, so validity from then ends before it
    /// does.
    pub(super) async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        seconds: i64,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        self.poke_sweeper();
        let taken = self.inner.spares.take(seconds, ttl, Instant::now());
        let claim = Claim::new(self, seconds, taken.spare);
        let granting = async {
            if taken.spare.is_some() {
                return Ok(());
            }
            let granted_from = Instant::now();
            let id = self.grant(ttl, seconds).await?;
            *claim
                .lease
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(Spare { id, granted_from });
            Ok::<_, LockError>(())
        };
        let found = if taken.spare.is_some() || taken.grant_beside_read {
            let (found, granted) = tokio::join!(self.lookup(key), granting);
            let found = found?;
            if !found.is_held() {
                granted?;
            }
            found
        } else {
            let found = self.lookup(key).await?;
            if found.is_held() {
                drop(granting);
            } else {
                granting.await?;
            }
            found
        };
        if found.is_held() {
            debug!(holder_token = ?found.holder().map(|(_, t)| t), "contended");
            self.inner.spares.found(seconds, false, Instant::now());
            return Ok(None);
        }
        self.take_free(key, ttl, sent, found, claim).await
    }

    /// Puts the key on the claimed lease with the token after the newest `found` shows,
    /// for a name `found` saw free; reads and tries again (on the same lease) while other
    /// grants came between.
    async fn take_free(
        &self,
        key: &LockKey,
        ttl: Duration,
        sent: Instant,
        mut found: Found,
        mut claim: Claim<'_>,
    ) -> Result<Option<Lease>, LockError> {
        let Some(spare) = claim.lease() else {
            return Err(LockError::unavailable(
                crate::error::NAME,
                "no lease to put the key on",
            ));
        };
        let owner = OwnerId::random();
        for _ in 0..TRANSACTIONS_PER_ATTEMPT {
            let token = next_token(found.newest());
            let txn = self.acquire_txn(key, owner, token, spare.id, found.token_revision());
            claim.put_sent = true;
            // An error leaves the claim to revoke the lease when it is dropped.
            let resp = self.txn(Effect::Write("acquire"), txn).await?;
            if resp.succeeded() {
                let seconds = claim.seconds;
                claim.hold();
                if self.inner.spares.found(seconds, true, Instant::now()) {
                    self.grant_ahead(ttl, seconds);
                }
                let lease = Lease::new(
                    self.inner.id,
                    key.clone(),
                    owner,
                    token,
                    ttl,
                    valid_until(sent.min(spare.granted_from), ttl),
                );
                return Ok(Some(
                    lease.with_handle(Arc::new(EtcdLease { id: spare.id })),
                ));
            }
            // The comparison failed: nothing was put, and the lease holds no key.
            claim.put_sent = false;
            found = Found::from_reads(&resp);
            if found.is_held() {
                debug!(holder_token = ?found.holder().map(|(_, t)| t), "contended");
                self.inner
                    .spares
                    .found(claim.seconds, false, Instant::now());
                break;
            }
        }
        Ok(None)
    }

    /// Grants a lease of `seconds` for a lock of `ttl`; refuses one etcd granted longer.
    /// A lost grant reply leaves at most an unused lease that lapses: no lock was taken.
    pub(super) async fn grant(&self, ttl: Duration, seconds: i64) -> Result<i64, LockError> {
        let granted = self
            .call(Effect::None, |client| async move {
                client.lease_client().grant(seconds, None).await
            })
            .await?;
        if granted.ttl() != seconds {
            self.revoke_in_background(granted.id());
            return Err(LockError::invalid_ttl(
                ttl,
                format!(
                    "etcd granted a {} s lease instead of {seconds} s (its minimum lease TTL \
                     changed?); refusing a lease longer than asked for",
                    granted.ttl()
                ),
            ));
        }
        Ok(granted.id())
    }

    /// If the key does not exist and no token was granted since the read that saw
    /// `token_revision`, puts the key with `owner` and `token` on the lease and records
    /// `token` as the newest; otherwise reads the name again.
    fn acquire_txn(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        lease_id: i64,
        token_revision: i64,
    ) -> Txn {
        let lock = self.lock_key(key);
        let tokens = self.token_key(key);
        Txn::new()
            .when([
                Compare::create_revision(lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(tokens.clone(), CompareOp::Equal, token_revision),
            ])
            .and_then([
                TxnOp::put(
                    lock,
                    lock_value(owner, token),
                    Some(PutOptions::new().with_lease(lease_id)),
                ),
                TxnOp::put(tokens, encode(token), None),
            ])
            .or_else(self.reads(key))
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::{Fence, LockBackend};
    use harness::etcd::EtcdServer;
    use harness::require;

    use super::*;

    /// Another client is granted the name (and releases it) between an attempt's read and
    /// its transaction, with a clock far ahead of this one: the attempt must notice and
    /// grant a token above the one granted in between, never one at or below it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_between_the_read_and_the_transaction_is_read_and_outbid() {
        let server = require(EtcdServer::start().await);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .build()
            .await
            .unwrap();
        let key = LockKey::new("granted-between").unwrap();
        let seen = backend.lookup(&key).await.unwrap();
        assert!(!seen.is_held() && seen.newest().is_none(), "{seen:?}");

        let hour_ahead = FencingToken(next_token(None).get() + 3_600_000_000);
        let token_key = backend.token_key(&key);
        backend
            .call(Effect::Write("test"), |client| {
                let token_key = token_key.clone();
                async move {
                    client
                        .kv_client()
                        .put(token_key, encode(hour_ahead), None)
                        .await
                }
            })
            .await
            .unwrap();

        let ttl = Duration::from_secs(2);
        let granted_from = Instant::now();
        let id = backend.grant(ttl, 2).await.unwrap();
        let claim = Claim::new(&backend, 2, Some(Spare { id, granted_from }));
        let lease = backend
            .take_free(&key, ttl, granted_from, seen, claim)
            .await
            .unwrap()
            .expect("the name is free");
        assert!(
            lease.token() > hour_ahead,
            "granted {:?} after {hour_ahead:?} was granted",
            lease.token()
        );
        assert_eq!(backend.fence(&lease).await.unwrap(), Fence::Current);
        assert_eq!(
            backend.inspect(&key).await.unwrap().token,
            Some(lease.token())
        );
    }
}
