//! [`EtcdFencedResource`]: downstream values stored in etcd, written only by the holder of
//! the newest fencing token, in one transaction per write.
//!
//! The highest admitted token of a resource lives in `<prefix>/fenced/<resource>` (`%` and
//! `/` in the name percent-encoded, as in lock keys) as a 20-digit zero-padded decimal, so
//! etcd's byte-wise value comparison orders tokens numerically. A write is one transaction:
//!
//! ```text
//! if value(fence) > token           (false when the fence key does not exist yet)
//! then get(fence)                   stale: report the newest token; shadow mode also
//!                                   writes the value, but never lowers the fence
//! else put(fence, token), put(data) admitted: the fence moves up with the write
//! ```
//!
//! Because the check and the write are one transaction, no interleaving lets a holder with
//! a lower token write after a holder with a higher one.

use std::sync::Arc;

use async_trait::async_trait;
use distlock_core::{Admission, EnforcementMode, FencedResource, FencingToken, LockError, decide};
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};

use crate::backend::EtcdBackend;
use crate::error::Effect;
use crate::keys::etcd_key;
use crate::tokens::{encode, parse_token};

/// A fenced resource whose state lives in etcd, next to the locks of an [`EtcdBackend`].
#[derive(Debug, Clone)]
pub struct EtcdFencedResource {
    backend: Arc<EtcdBackend>,
    mode: EnforcementMode,
}

impl EtcdFencedResource {
    /// A resource store on `backend`'s connection and key prefix, in `mode`.
    pub fn new(backend: &EtcdBackend, mode: EnforcementMode) -> Self {
        Self {
            backend: Arc::new(backend.clone()),
            mode,
        }
    }

    /// The enforcement mode.
    pub fn mode(&self) -> EnforcementMode {
        self.mode
    }

    /// The etcd key holding `resource`'s highest admitted token.
    pub fn fence_key(&self, resource: &str) -> String {
        etcd_key(self.backend.key_prefix(), "fenced", resource)
    }

    /// The etcd key holding `resource`'s value written by [`FencedResource::write`].
    pub fn data_key(&self, resource: &str) -> String {
        etcd_key(self.backend.key_prefix(), "data", resource)
    }

    /// The highest token admitted for `resource`, if any.
    pub async fn latest(&self, resource: &str) -> Result<Option<FencingToken>, LockError> {
        check_resource(resource)?;
        let fence = self.get(self.fence_key(resource)).await?;
        fence.map(|value| parse_token(&value)).transpose()
    }

    /// The value of the etcd key `key`, if it exists.
    async fn get(&self, key: String) -> Result<Option<Vec<u8>>, LockError> {
        let mut resp = self
            .backend
            .call(Effect::None, |client| {
                let key = key.clone();
                async move { client.kv_client().get(key, None).await }
            })
            .await?;
        Ok(resp
            .take_kvs()
            .into_iter()
            .next()
            .map(|kv| kv.into_key_value().1))
    }

    async fn guarded(
        &self,
        resource: &str,
        token: FencingToken,
        value: Option<Vec<u8>>,
    ) -> Result<Admission, LockError> {
        check_resource(resource)?;
        let fence = self.fence_key(resource);
        let encoded = encode(token);
        let data = value.map(|v| TxnOp::put(self.data_key(resource), v, None));

        let mut stale_ops = vec![TxnOp::get(fence.clone(), None)];
        let mut admitted_ops = vec![TxnOp::put(
            fence.clone(),
            encoded.clone(),
            Some(PutOptions::new().with_prev_key()),
        )];
        if let Some(data) = data {
            if self.mode == EnforcementMode::Shadow {
                stale_ops.push(data.clone());
            }
            admitted_ops.push(data);
        }
        let txn = Txn::new()
            .when([Compare::value(fence, CompareOp::Greater, encoded)])
            .and_then(stale_ops)
            .or_else(admitted_ops);
        let resp = self.backend.txn(Effect::Write("fenced write"), txn).await?;
        let seen = seen_token(&resp)?;
        Ok(decide(self.mode, resource, token, seen))
    }
}

/// [`FencedResource::write`] is the transaction of the module docs, putting the value
/// with the fence; [`FencedResource::check_only`] the same transaction without it.
#[async_trait]
impl FencedResource for EtcdFencedResource {
    async fn write(
        &self,
        resource: &str,
        token: FencingToken,
        value: &[u8],
    ) -> Result<Admission, LockError> {
        self.guarded(resource, token, Some(value.to_vec())).await
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, LockError> {
        check_resource(resource)?;
        self.get(self.data_key(resource)).await
    }

    async fn check_only(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, LockError> {
        self.guarded(resource, token, None).await
    }
}

fn check_resource(resource: &str) -> Result<(), LockError> {
    if resource.is_empty() {
        return Err(LockError::InvalidKey {
            reason: "the fenced resource name is empty".into(),
        });
    }
    Ok(())
}

/// The token the fence held before this write: from the `get` of the stale branch, or the
/// previous value of the `put` of the admitted branch.
fn seen_token(resp: &TxnResponse) -> Result<Option<FencingToken>, LockError> {
    let stale = resp.succeeded();
    let kv = resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) if stale => get.kvs().first().cloned(),
        TxnOpResponse::Put(put) if !stale => put.prev_key().cloned(),
        _ => None,
    });
    kv.map(|kv| parse_token(kv.value())).transpose()
}
