//! The etcd baselines: a put-if-absent transaction on one shared lease, and the same
//! operations as the backend (a read of the lock and token keys, a lease per lock, a
//! token from the clock checked against the token key, a checked delete).

use std::time::Instant;

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::{BenchKey, Cycle, Subject, SubjectId, TTL};
use crate::BenchError;

/// The etcd baselines.
pub(super) struct RawEtcd {
    id: SubjectId,
    client: etcd_client::Client,
    /// The one lease every key of [`SubjectId::EtcdRawTxn`] is put on.
    shared_lease: i64,
    ttl_secs: i64,
}

impl RawEtcd {
    pub(super) async fn connect(id: SubjectId, endpoint: &str) -> Result<Self, BenchError> {
        let err = |e: etcd_client::Error| BenchError::client(id.slug(), e);
        let client = etcd_client::Client::connect([endpoint], None)
            .await
            .map_err(err)?;
        // Outlives any measurement; it lapses on its own after the run.
        let shared_lease = client
            .lease_client()
            .grant(3600, None)
            .await
            .map_err(err)?
            .id();
        Ok(Self {
            id,
            client,
            shared_lease,
            ttl_secs: i64::try_from(TTL.as_secs()).unwrap_or(i64::MAX),
        })
    }

    fn err(&self, e: etcd_client::Error) -> BenchError {
        BenchError::client(self.id.slug(), e)
    }

    fn revoke_in_background(&self, lease: i64) {
        let mut leases = self.client.lease_client();
        tokio::spawn(async move {
            let _ = leases.revoke(lease).await;
        });
    }
}

#[async_trait]
impl Subject for RawEtcd {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let mut kv = self.client.kv_client();
        let start = Instant::now();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let lock_key = format!("bench/locks/{}", key.as_str());
        if self.id == SubjectId::EtcdRawTxn {
            let put_if_absent = Txn::new()
                .when([Compare::create_revision(
                    lock_key.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([TxnOp::put(
                    lock_key.clone(),
                    owner,
                    Some(PutOptions::new().with_lease(self.shared_lease)),
                )]);
            let taken = kv
                .txn(put_if_absent)
                .await
                .map_err(|e| self.err(e))?
                .succeeded();
            let acquire = start.elapsed();
            if taken {
                kv.delete(lock_key, None).await.map_err(|e| self.err(e))?;
            }
            return Ok(Cycle {
                acquire,
                acquired: taken,
            });
        }

        let token_key = format!("bench/tokens/{}", key.as_str());
        let reads = [
            TxnOp::get(lock_key.clone(), None),
            TxnOp::get(token_key.clone(), None),
        ];
        let seen = kv
            .txn(Txn::new().and_then(reads))
            .await
            .map_err(|e| self.err(e))?;
        let token_kv = match seen.op_responses().pop() {
            Some(TxnOpResponse::Get(mut get)) => get.take_kvs().pop(),
            _ => None,
        };
        let newest = token_kv
            .as_ref()
            .and_then(|kv| kv.value_str().ok()?.parse::<u64>().ok())
            .unwrap_or(0);
        let token_revision = token_kv.map_or(0, |kv| kv.mod_revision());
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let token = clock.max(newest + 1);

        let lease = self
            .client
            .lease_client()
            .grant(self.ttl_secs, None)
            .await
            .map_err(|e| self.err(e))?
            .id();
        let value = format!("{owner}:{token}");
        let put_if_absent = Txn::new()
            .when([
                Compare::create_revision(lock_key.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(token_key.clone(), CompareOp::Equal, token_revision),
            ])
            .and_then([
                TxnOp::put(
                    lock_key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::put(token_key, format!("{token:020}"), None),
            ])
            .or_else([TxnOp::get(lock_key.clone(), None)]);
        let resp = kv.txn(put_if_absent).await.map_err(|e| self.err(e))?;
        let acquire = start.elapsed();
        if resp.succeeded() {
            let checked_delete = Txn::new()
                .when([Compare::value(lock_key.clone(), CompareOp::Equal, value)])
                .and_then([
                    TxnOp::get(lock_key.clone(), None),
                    TxnOp::delete(lock_key, None),
                ]);
            kv.txn(checked_delete).await.map_err(|e| self.err(e))?;
        }
        self.revoke_in_background(lease);
        Ok(Cycle {
            acquire,
            acquired: resp.succeeded(),
        })
    }
}
