//! A semaphore's attempt ([`distlock_core::LockBackend::acquire_any`] over its permit slots): one range
//! read of the slot keys finds which are held, so a full semaphore is refused in one
//! round trip whatever its number of permits, and a slot it shows free is taken by
//! `acquire`, as any key is. Asked slot by slot (the trait's default), a refusal was one
//! round trip per slot.
//!
//! The read is a snapshot: a slot taken after it is found held by its `acquire`, and the
//! next free one in the snapshot is tried; a slot freed after it is not seen, as a slot
//! freed just after a refusal is not. A lock key is in etcd only while held (a release
//! deletes it, and an expiry deletes it with its lease), so a key present is a slot held.

use std::collections::HashSet;
use std::time::Duration;

use distlock_core::{Lease, LockError, LockKey, acquire_first_free};
use etcd_client::GetOptions;
use tokio::time::Instant;

use super::EtcdBackend;
use crate::error::Effect;

impl EtcdBackend {
    /// The etcd key prefix the lock keys of `keys` share, `<prefix>/locks/<name>:permit:`,
    /// when they are slots of one semaphore (`<name>:permit:<digits>`, see
    /// [`LockKey::permit_slot`]), more than one; `None` for any other list.
    pub(super) fn slots_prefix(&self, keys: &[LockKey]) -> Option<String> {
        let (first, rest) = keys.split_first()?;
        let (name, slot) = first.permit_slot()?;
        let same = |key: &LockKey| key.permit_slot().is_some_and(|(n, _)| n == name);
        if rest.is_empty() || !rest.iter().all(same) {
            return None;
        }
        // The name is encoded in the lock key, the slot's digits are not: they end it.
        let mut prefix = self.lock_key(first);
        prefix.truncate(prefix.len() - slot.len());
        Some(prefix)
    }

    /// The first of `keys` (slots under `prefix`, see [`Self::slots_prefix`]) the slots'
    /// range read shows free and `acquire` takes, in order; `None` when the read shows
    /// every one held, or each it showed free was taken before its `acquire`.
    ///
    /// # Cancel safety
    /// The read changes nothing; each slot's `acquire` gives back what it took when
    /// dropped, as [`distlock_core::LockBackend::acquire`] does.
    pub(super) async fn acquire_free_slot(
        &self,
        keys: &[LockKey],
        prefix: String,
        ttl: Duration,
        seconds: i64,
    ) -> Result<Option<Lease>, LockError> {
        let held = self.held_slots(&prefix).await?;
        let free: Vec<LockKey> = keys
            .iter()
            .filter(|key| {
                let slot = key.permit_slot().map_or("", |(_, slot)| slot);
                !held.contains(slot.as_bytes())
            })
            .cloned()
            .collect();
        acquire_first_free(&free, |key| {
            self.acquire_sent(key, ttl, seconds, Instant::now())
        })
        .await
    }

    /// The slot part (what follows `prefix`) of every lock key under `prefix`: one range
    /// read, keys only.
    async fn held_slots(&self, prefix: &str) -> Result<HashSet<Vec<u8>>, LockError> {
        let resp = self
            .call(Effect::None, |client| {
                let prefix = prefix.to_owned();
                async move {
                    let options = GetOptions::new().with_prefix().with_keys_only();
                    client.kv_client().get(prefix, Some(options)).await
                }
            })
            .await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| kv.key().strip_prefix(prefix.as_bytes()))
            .map(<[u8]>::to_vec)
            .collect())
    }
}
