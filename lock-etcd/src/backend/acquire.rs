//! Acquiring: grant a lease with the lock's TTL, then put the key on it in one
//! transaction if the key is free; every outcome but a grant revokes the lease.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{FencingToken, Lease, LockError, LockKey, OwnerId, valid_until};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnResponse};
use tokio::time::Instant;
use tracing::debug;

use super::lease::EtcdLease;
use super::{EtcdBackend, first_kv};
use crate::error::{Effect, NAME};

impl EtcdBackend {
    /// Grants a lease, then in one transaction puts the key on it if the key does not
    /// exist. Validity counts from `sent`, taken before the grant was requested: the lease
    /// starts counting when etcd grants it, so validity from `sent` ends before it does.
    pub(super) async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        seconds: i64,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        // A lost grant reply leaves at most an unused lease that lapses: no lock was taken.
        let granted = self
            .call(Effect::None, |client| async move {
                client.lease_client().grant(seconds, None).await
            })
            .await?;
        let lease_id = granted.id();
        if granted.ttl() != seconds {
            self.revoke_in_background(lease_id);
            return Err(LockError::invalid_ttl(
                ttl,
                format!(
                    "etcd granted a {} s lease instead of {seconds} s (its minimum lease TTL \
                     changed?); refusing a lease longer than asked for",
                    granted.ttl()
                ),
            ));
        }

        let owner = OwnerId::random();
        let resp = self
            .txn(
                Effect::Write("acquire"),
                self.acquire_txn(key, owner, lease_id),
            )
            .await;
        self.settle_acquire(key, ttl, owner, lease_id, sent, resp)
    }

    /// If `key` does not exist, puts it with `owner` on the lease, and touches its token key;
    /// otherwise reads the holder.
    fn acquire_txn(&self, key: &LockKey, owner: OwnerId, lease_id: i64) -> Txn {
        let etcd_key = self.lock_key(key);
        Txn::new()
            .when([Compare::create_revision(
                etcd_key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    etcd_key.clone(),
                    owner.to_string(),
                    Some(PutOptions::new().with_lease(lease_id)),
                ),
                TxnOp::put(self.token_key(key), owner.to_string(), None),
            ])
            .or_else([TxnOp::get(etcd_key, None)])
    }

    /// The lease granted by the acquire transaction's reply, if it granted one. Every other
    /// outcome revokes the lease: if the put did happen (a lost reply, a reply without the
    /// revision that would be the token), revoking our own lease deletes the key again, so
    /// no key is held for a TTL by a caller that was told it does not hold it.
    fn settle_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        owner: OwnerId,
        lease_id: i64,
        sent: Instant,
        resp: Result<TxnResponse, LockError>,
    ) -> Result<Option<Lease>, LockError> {
        let revision = resp.and_then(|resp| {
            if resp.succeeded() {
                header_revision(&resp).map(Some)
            } else {
                debug!(
                    holder_token = first_kv(&resp).map(|kv| kv.create_revision()),
                    "contended"
                );
                Ok(None)
            }
        });
        let Ok(Some(revision)) = revision else {
            self.revoke_in_background(lease_id);
            return revision.map(|_| None);
        };
        Ok(Some(
            Lease::new(
                self.inner.id,
                key.clone(),
                owner,
                FencingToken(revision),
                ttl,
                valid_until(sent, ttl),
            )
            .with_handle(Arc::new(EtcdLease { id: lease_id })),
        ))
    }
}

fn header_revision(resp: &TxnResponse) -> Result<u64, LockError> {
    resp.header()
        .and_then(|h| u64::try_from(h.revision()).ok())
        .filter(|&r| r > 0)
        .ok_or_else(|| LockError::backend(NAME, "etcd's transaction reply has no revision"))
}

#[cfg(test)]
mod tests {
    use distlock_core::LockBackend;
    use harness::etcd::EtcdServer;
    use harness::require;

    use super::*;

    /// A reply that says the put happened but carries no revision cannot become a lease;
    /// the key it put must not stay held until its lease runs out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_acquire_reply_without_a_revision_revokes_the_lease_it_put_the_key_on() {
        let server = require(EtcdServer::start().await);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .build()
            .await
            .unwrap();
        let key = LockKey::new("no-revision").unwrap();
        let ttl = Duration::from_secs(30);
        let granted = backend
            .call(Effect::None, |client| async move {
                client.lease_client().grant(30, None).await
            })
            .await
            .unwrap();
        let owner = OwnerId::random();
        let sent = Instant::now();
        let mut resp = backend
            .txn(
                Effect::Write("acquire"),
                backend.acquire_txn(&key, owner, granted.id()),
            )
            .await
            .unwrap();
        assert!(resp.succeeded(), "the key was free and is now put");
        resp.take_header();

        let settled = backend.settle_acquire(&key, ttl, owner, granted.id(), sent, Ok(resp));
        assert!(
            matches!(settled, Err(LockError::Backend { .. })),
            "{settled:?}"
        );
        // Freed by the revoke, long before the 30 s lease would lapse.
        let deadline = Instant::now() + Duration::from_secs(10);
        while backend.inspect(&key).await.unwrap().owner.is_some() {
            assert!(
                Instant::now() < deadline,
                "the key is still held on the unrevoked lease"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let taken = backend.acquire(&key, Duration::from_secs(2)).await.unwrap();
        assert!(taken.is_some(), "the key is free to take");
    }
}
