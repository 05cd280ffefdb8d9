//! [`Table`]: the store's rows, one per key ever locked, and the rules that change them.
//!
//! Nothing here is async or shared: the caller holds the store's lock for each call and
//! passes the store's clock reading, `now`, in whole milliseconds since the store began.

use std::collections::HashMap;

use distlock::{FencingToken, LockInfo, LockKey, OwnerId};

/// The rows of the store.
#[derive(Debug, Default)]
pub(crate) struct Table {
    rows: HashMap<LockKey, Row>,
}

/// One key: the newest token granted for it, and who holds it until when.
#[derive(Debug, Default)]
struct Row {
    /// Stays when the holder releases or expires, so the next grant's token is higher.
    last_token: u64,
    holder: Option<Holder>,
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    owner: OwnerId,
    token: FencingToken,
    /// The store's millisecond at which the lease runs out: held while `now` is before it.
    expires_at: u64,
}

impl Row {
    /// The holder whose lease has not run out at `now`.
    fn live(&self, now: u64) -> Option<&Holder> {
        self.holder.as_ref().filter(|h| now < h.expires_at)
    }

    /// Whether `owner` still holds the key with `token` at `now`.
    fn held_by(&self, owner: OwnerId, token: FencingToken, now: u64) -> bool {
        self.live(now)
            .is_some_and(|h| h.owner == owner && h.token == token)
    }
}

impl Table {
    /// Takes `key` for `ttl_ms` if nobody holds it: a new owner id and the next token.
    pub(crate) fn grant(
        &mut self,
        key: &LockKey,
        ttl_ms: u64,
        now: u64,
    ) -> Option<(OwnerId, FencingToken)> {
        let row = self.rows.entry(key.clone()).or_default();
        if row.live(now).is_some() {
            return None;
        }
        row.last_token += 1;
        let holder = Holder {
            owner: OwnerId::random(),
            token: FencingToken(row.last_token),
            expires_at: now.saturating_add(ttl_ms),
        };
        row.holder = Some(holder);
        Some((holder.owner, holder.token))
    }

    /// Extends the lease of `owner` with `token` by `ttl_ms` from `now`, if it still
    /// holds the key; never brings back a lease that ran out.
    pub(crate) fn extend(
        &mut self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl_ms: u64,
        now: u64,
    ) -> bool {
        let Some(row) = self.rows.get_mut(key) else {
            return false;
        };
        if !row.held_by(owner, token, now) {
            return false;
        }
        if let Some(holder) = row.holder.as_mut() {
            holder.expires_at = now.saturating_add(ttl_ms);
        }
        true
    }

    /// Frees `key` if `owner` still holds it with `token`; whoever else holds it keeps it.
    pub(crate) fn free(
        &mut self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        now: u64,
    ) -> bool {
        match self.rows.get_mut(key) {
            Some(row) if row.held_by(owner, token, now) => {
                row.holder = None;
                true
            }
            _ => false,
        }
    }

    /// `Ok` if `owner` still holds `key` with `token`; else the key's newest token, if
    /// the store has a row for it.
    pub(crate) fn fence(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        now: u64,
    ) -> Result<(), Option<FencingToken>> {
        match self.rows.get(key) {
            Some(row) if row.held_by(owner, token, now) => Ok(()),
            Some(row) => Err(Some(FencingToken(row.last_token))),
            None => Err(None),
        }
    }

    /// The holder, the newest token and the time left, as the store sees `key` at `now`.
    pub(crate) fn info(&self, key: &LockKey, now: u64) -> LockInfo {
        let row = self.rows.get(key);
        let holder = row.and_then(|r| r.live(now));
        LockInfo {
            owner: holder.map(|h| h.owner),
            token: row
                .filter(|r| r.last_token > 0)
                .map(|r| FencingToken(r.last_token)),
            remaining: holder.map(|h| std::time::Duration::from_millis(h.expires_at - now)),
        }
    }

    /// Forgets `key`, its counter included.
    pub(crate) fn remove(&mut self, key: &LockKey) {
        self.rows.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_outlives_its_holders_and_a_lease_ends_at_its_millisecond() {
        let key = LockKey::new("job:1").unwrap();
        let mut table = Table::default();
        let (owner, first) = table.grant(&key, 100, 0).unwrap();
        assert!(table.grant(&key, 100, 99).is_none());
        assert!(!table.free(&key, OwnerId::random(), first, 50));
        assert!(table.free(&key, owner, first, 50));
        let (owner, second) = table.grant(&key, 100, 50).unwrap();
        assert!(second > first);
        // Granted at 50 for 100 ms, renewed at 149 for 100 more: held through 248.
        assert!(table.extend(&key, owner, second, 100, 149));
        assert!(table.fence(&key, owner, second, 248).is_ok());
        assert_eq!(table.fence(&key, owner, second, 249), Err(Some(second)));
        assert!(!table.extend(&key, owner, second, 100, 249));
        let (_, third) = table.grant(&key, 100, 249).unwrap();
        assert_eq!(table.info(&key, 250).token, Some(third));
        table.remove(&key);
        assert_eq!(table.info(&key, 250).token, None);
    }
}
