//! Acquiring: read the name, and only if it is free grant a lease with the lock's TTL and
//! put the key on it in one transaction, with the next token; every outcome but a grant
//! revokes the lease.
//!
//! # Why a read comes first
//!
//! A refused attempt that began with the grant would cost three consensus writes (the
//! grant, a transaction that may write — etcd sends it through raft even when its
//! comparison fails — and the revoke), each flushed to disk on a quorum, and would load
//! the cluster exactly when a key is busy. A linearizable read answers "held" without a
//! write; a free key costs the read plus the two writes it always cost.
//!
//! # The token
//!
//! The next token is [`next_token`] of the newest one read, and the transaction puts it
//! only if the token key's `mod_revision` is still the one read: if another acquire was
//! granted (and released) since, the transaction reads the name again instead, and the
//! attempt goes on from what it found, on the same lease.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{FencingToken, Lease, LockError, LockKey, OwnerId, valid_until};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::time::Instant;
use tracing::debug;

use super::EtcdBackend;
use super::found::Found;
use super::lease::EtcdLease;
use crate::error::Effect;
use crate::tokens::{encode, lock_value, next_token};

/// How many transactions one attempt sends while other acquires keep granting (and
/// releasing) the name between its read and its transaction; after that it is refused,
/// as a contended attempt is.
const TRANSACTIONS_PER_ATTEMPT: usize = 3;

impl EtcdBackend {
    /// Reads the name; if it is free, grants a lease and puts the key on it with the next
    /// token. Validity counts from `sent`, taken before anything was sent: the lease starts
    /// counting when etcd grants it, so validity from `sent` ends before it does.
    pub(super) async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        seconds: i64,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        self.poke_sweeper();
        let found = self.lookup(key).await?;
        if found.is_held() {
            debug!(holder_token = ?found.holder().map(|(_, t)| t), "contended");
            return Ok(None);
        }
        self.take_free(key, ttl, seconds, sent, found).await
    }

    /// Grants a lease and puts the key on it with the token after the newest `found`
    /// shows, for a name `found` saw free; reads and tries again (on the same lease) while
    /// other grants came between.
    async fn take_free(
        &self,
        key: &LockKey,
        ttl: Duration,
        seconds: i64,
        sent: Instant,
        mut found: Found,
    ) -> Result<Option<Lease>, LockError> {
        let lease_id = self.grant(ttl, seconds).await?;
        let owner = OwnerId::random();
        for _ in 0..TRANSACTIONS_PER_ATTEMPT {
            let token = next_token(found.newest());
            let txn = self.acquire_txn(key, owner, token, lease_id, found.token_revision());
            match self.txn(Effect::Write("acquire"), txn).await {
                Ok(resp) if resp.succeeded() => {
                    let lease = Lease::new(
                        self.inner.id,
                        key.clone(),
                        owner,
                        token,
                        ttl,
                        valid_until(sent, ttl),
                    );
                    return Ok(Some(
                        lease.with_handle(Arc::new(EtcdLease { id: lease_id })),
                    ));
                }
                Ok(resp) => {
                    found = Found::from_reads(&resp);
                    if found.is_held() {
                        debug!(holder_token = ?found.holder().map(|(_, t)| t), "contended");
                        break;
                    }
                }
                Err(e) => {
                    // The put may have happened with the reply lost: revoking our own lease
                    // deletes the key again, so no key is held for a TTL by a caller that
                    // was told it does not hold it.
                    self.revoke_in_background(lease_id);
                    return Err(e);
                }
            }
        }
        self.revoke_in_background(lease_id);
        Ok(None)
    }

    /// Grants a lease of `seconds` for a lock of `ttl`; refuses one etcd granted longer.
    /// A lost grant reply leaves at most an unused lease that lapses: no lock was taken.
    async fn grant(&self, ttl: Duration, seconds: i64) -> Result<i64, LockError> {
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
        let lease = backend
            .take_free(&key, ttl, 2, Instant::now(), seen)
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
