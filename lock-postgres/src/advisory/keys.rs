//! How a lock name becomes an advisory-lock key: a stable hash of the schema and the
//! name, and its `(classid, objid)` halves as `pg_locks` shows them.

use distlock_core::LockKey;
use sha2::{Digest, Sha256};

use crate::schema::Schema;

/// `(classid, objid)` of a bigint advisory key, as `pg_locks` shows them.
pub(super) fn split(key: i64) -> (i64, i64) {
    let bits = key as u64;
    ((bits >> 32) as i64, (bits & 0xffff_ffff) as i64)
}

/// The first 8 bytes of SHA-256 of `distlock:<schema>:<name>`, big-endian.
pub(super) fn lock_id(schema: &Schema, key: &LockKey) -> i64 {
    let digest = Sha256::new()
        .chain_update(b"distlock:")
        .chain_update(schema.as_str().as_bytes())
        .chain_update(b":")
        .chain_update(key.as_str().as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_stable_and_namespaced() {
        let a = Schema::new("distlock").unwrap();
        let b = Schema::new("other").unwrap();
        let key = LockKey::new("payout:42").unwrap();
        // SHA-256("distlock:distlock:payout:42"), first 8 bytes, big-endian.
        let digest = Sha256::digest(b"distlock:distlock:payout:42");
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(lock_id(&a, &key), expected);
        assert_ne!(lock_id(&a, &key), lock_id(&b, &key));
    }

    #[test]
    fn keys_split_into_classid_and_objid() {
        assert_eq!(split(0x0000_0001_0000_0002), (1, 2));
        assert_eq!(split(-1), (0xffff_ffff, 0xffff_ffff));
    }
}
