//! [`Found`]: what one read of a name finds, its lock key and its token key.

use distlock_core::{FencingToken, OwnerId};
use etcd_client::{KeyValue, TxnOpResponse, TxnResponse};

use crate::tokens::{parse_lock_value, recorded_token};

/// A name's lock key and token key, as one transaction read them.
#[derive(Debug, Default)]
pub(super) struct Found {
    lock: Option<KeyValue>,
    tokens: Option<KeyValue>,
}

impl Found {
    /// The two gets of [`super::EtcdBackend::reads`], in that order, from a reply.
    pub(super) fn from_reads(resp: &TxnResponse) -> Self {
        let mut gets = resp.op_responses().into_iter().filter_map(|op| match op {
            TxnOpResponse::Get(mut get) => Some(get.take_kvs().into_iter().next()),
            _ => None,
        });
        Self {
            lock: gets.next().flatten(),
            tokens: gets.next().flatten(),
        }
    }

    /// The lock key, if the name is held.
    pub(super) fn lock(&self) -> Option<&KeyValue> {
        self.lock.as_ref()
    }

    pub(super) fn is_held(&self) -> bool {
        self.lock.is_some()
    }

    /// The holder's owner id and token, if the lock key names them.
    pub(super) fn holder(&self) -> Option<(OwnerId, FencingToken)> {
        self.lock
            .as_ref()
            .and_then(|kv| parse_lock_value(kv.value()))
    }

    /// The newest token granted for the name, if its token key is there (see
    /// [`recorded_token`]).
    pub(super) fn newest(&self) -> Option<FencingToken> {
        self.tokens.as_ref().and_then(recorded_token)
    }

    /// The token key's `mod_revision`, 0 when it does not exist (what etcd compares a
    /// missing key's revision with): unchanged until the next grant.
    pub(super) fn token_revision(&self) -> i64 {
        self.tokens.as_ref().map_or(0, KeyValue::mod_revision)
    }
}
