//! The waiters' registry: which keys some process waits for, readable by a release for
//! the cost of one lock-manager call, so that a release is announced only when someone
//! listens for its key.
//!
//! # Why not notify every release
//!
//! A transaction that runs `NOTIFY` takes one cluster-wide lock at commit and holds it
//! until its commit is written (and, with `synchronous_commit = on`, flushed): every
//! notifying transaction on the server, of every database and application, commits one
//! at a time. A notify also gives the transaction an id, so an advisory unlock, which
//! otherwise writes nothing, writes and flushes a commit record.
//!
//! # How a waiter registers
//!
//! Each key has a *waiter id*, a two-`int4` advisory-lock key (a key space apart from the
//! advisory backend's `bigint` locks, and from other applications' locks but for a 2^-64
//! chance). The release listener of a process holds a **shared** session lock on the
//! waiter id of every key its waiters watch, taken before it wakes them. A release tries
//! the **exclusive** transaction-level lock on the same id in its own statement
//! ([`waited`]): when that fails someone waits, and the backend has the release announced
//! once it committed ([`crate::announcer`]); when it succeeds nobody does, and the lock
//! goes with the release's transaction. Neither writes to the WAL; the try never blocks.
//!
//! # No release is missed
//!
//! - A waiter registered before the release's try makes the try fail: the release is
//!   announced after it committed, and the listener, which `LISTEN`s before it registers
//!   anything, hears it.
//! - A registration that comes after the try waits for the release's transaction to end
//!   (the exclusive lock is held until then); the listener then wakes the key's waiters,
//!   which look at the store again and find the key free.

use distlock_core::LockKey;
use sha2::{Digest, Sha256};

use crate::schema::Schema;

/// The SQL expression, for a release statement, that says whether some process waits for
/// the key whose waiter id is `(class, obj)` (the exclusive try fails). Each argument is
/// SQL text: a bind parameter or a column. Evaluate it only for a key that was released.
pub(crate) fn waited(class: &str, obj: &str) -> String {
    format!("(NOT pg_try_advisory_xact_lock({class}, {obj}))")
}

/// The waiter id of `key` for the releases of backend mode `mode` in `schema`: the first 8
/// bytes of SHA-256 of `distlock-waiters:<mode>:<schema>:<name>`, as two `int4`.
pub(crate) fn waiter_id(mode: &str, schema: &Schema, key: &LockKey) -> (i32, i32) {
    let digest = Sha256::new()
        .chain_update(b"distlock-waiters:")
        .chain_update(mode.as_bytes())
        .chain_update(b":")
        .chain_update(schema.as_str().as_bytes())
        .chain_update(b":")
        .chain_update(key.as_str().as_bytes())
        .finalize();
    let half =
        |i: usize| i32::from_be_bytes([digest[i], digest[i + 1], digest[i + 2], digest[i + 3]]);
    (half(0), half(4))
}

/// Takes a shared session lock on every waiter id in `$1`, `$2` (`int4[]`), waiting for
/// any release of those keys that is committing now.
pub(crate) const REGISTER: &str = "SELECT count(pg_advisory_lock_shared(w.class, w.obj)) \
     FROM unnest($1::int4[], $2::int4[]) AS w(class, obj)";

/// Gives back the shared session locks of the waiter ids in `$1`, `$2` (`int4[]`).
pub(crate) const UNREGISTER: &str = "SELECT count(pg_advisory_unlock_shared(w.class, w.obj)) \
     FROM unnest($1::int4[], $2::int4[]) AS w(class, obj)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiter_ids_are_stable_and_per_mode_schema_and_name() {
        let s = Schema::new("distlock").unwrap();
        let k = LockKey::new("job:1").unwrap();
        let digest = Sha256::digest(b"distlock-waiters:lease:distlock:job:1");
        let class = i32::from_be_bytes(digest[..4].try_into().unwrap());
        let obj = i32::from_be_bytes(digest[4..8].try_into().unwrap());
        assert_eq!(waiter_id("lease", &s, &k), (class, obj));
        assert_ne!(waiter_id("advisory", &s, &k), waiter_id("lease", &s, &k));
        let other = Schema::new("other").unwrap();
        assert_ne!(waiter_id("lease", &other, &k), waiter_id("lease", &s, &k));
    }
}
