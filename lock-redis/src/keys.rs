//! The Redis key layout: `<prefix>:{<name>}` holds `<owner id>:<token>` while the lock is
//! held (with `:w` appended once an acquire found it held, so its release is announced).
//! The braces are a Redis Cluster hash tag, so the keys of one batch call can be grouped by
//! slot, and the key's name is also its release channel. A semaphore's permit slot
//! `<semaphore>:permit:<i>` is `<prefix>:{<semaphore>}:permit:<i>`: every slot of one
//! semaphore hashes with the semaphore's name, into one hash slot, so that on a Cluster
//! one script call on one shard can take any of them. Beside the locks, a high-water
//! key holds the highest token granted: `<prefix>:tokens` on a single node, and on a
//! Cluster `<prefix>:tokens:{<tag>}` for each hash slot, with a tag of that slot (a
//! script's keys must share one). It never expires: it is what tokens are counted from
//! (see `acquire.lua`), one small key per slot at most.

use distlock_core::{FencingToken, LockKey, OwnerId};

use crate::conn::key_slot;

/// The Redis key of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LockKeys {
    /// Holds `<owner id>:<token>`, with the lease's TTL.
    pub(crate) lock: String,
    /// How an acquire of the lock marks it waited for (see [`Mark`]).
    pub(crate) mark: Mark,
}

/// How an acquire marks its lock waited for (`:w`), which makes its release announced
/// (see `acquire.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    /// Marked when the acquire finds it held by another: this waiter is to be woken.
    WhenHeld,
    /// Granted already marked: other waiters of this process watch it.
    Granted,
    /// Never: nothing of this backend hears releases (wake-ups off, or the listener was
    /// refused), so an announcement would only cost the server a `PUBLISH`, which it may
    /// refuse this user (an `ACL LOG` entry per release).
    Never,
}

impl Mark {
    /// The scripts' argument: `'0'`, `'1'` or `'-'`.
    pub(crate) fn arg(self) -> u8 {
        match self {
            Self::WhenHeld => b'0',
            Self::Granted => b'1',
            Self::Never => b'-',
        }
    }
}

impl LockKeys {
    pub(crate) fn new(prefix: &str, key: &LockKey) -> Self {
        let lock = match key.permit_slot() {
            Some((semaphore, slot)) => {
                format!("{prefix}:{{{}}}:permit:{slot}", hash_tag(semaphore))
            }
            None => format!("{prefix}:{{{}}}", hash_tag(key.as_str())),
        };
        Self {
            lock,
            mark: Mark::WhenHeld,
        }
    }
}

/// The holder and token a lock key's value names: `<owner id>:<token>`, possibly marked
/// waited for (`:w`). `None` for anything else.
pub(crate) fn parse_held(value: &str) -> Option<(OwnerId, FencingToken)> {
    let value = value.strip_suffix(":w").unwrap_or(value);
    let (owner, token) = value.split_once(':')?;
    Some((
        OwnerId::parse(owner).ok()?,
        FencingToken(token.parse().ok()?),
    ))
}

/// The key that holds the highest admitted token of a fenced resource.
pub(crate) fn fenced_resource_key(prefix: &str, resource: &str) -> String {
    format!("{prefix}:fenced:{{{}}}", hash_tag(resource))
}

/// The high-water key of the locks of `slot` on a Cluster, or of every lock on a single
/// node (`None`).
pub(crate) fn high_water_key(prefix: &str, slot: Option<u16>) -> String {
    match slot {
        None => format!("{prefix}:tokens"),
        Some(slot) => format!("{prefix}:tokens:{{{}}}", slot_tag(slot)),
    }
}

/// A short hash tag that hashes to `slot`: the first decimal number that does, found for
/// every slot once (some 170,000 CRC16s of a few bytes, under a few milliseconds).
fn slot_tag(slot: u16) -> &'static str {
    static TAGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![String::new(); SLOTS];
        let mut left = SLOTS;
        let mut n = 0u32;
        while left > 0 {
            let tag = n.to_string();
            let slot = &mut tags[usize::from(key_slot(tag.as_bytes()))];
            if slot.is_empty() {
                *slot = tag;
                left -= 1;
            }
            n += 1;
        }
        tags
    });
    &tags[usize::from(slot) % SLOTS]
}

/// Hash slots in a Redis Cluster.
const SLOTS: usize = 16384;

/// The name as it goes between the braces.
///
/// Redis hashes the text between the first `{` and the first `}` after it, so a `}` in
/// the name would end the tag early (and `}` first would make it empty, which hashes the
/// whole key). `%` and `}` are therefore percent-encoded; every other name, `{` and
/// non-ASCII text included, is used as is, and the encoding is one-to-one so two names
/// never share keys.
fn hash_tag(name: &str) -> std::borrow::Cow<'_, str> {
    if !name.contains(['%', '}']) {
        return name.into();
    }
    let mut out = String::with_capacity(name.len() + 8);
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(name: &str) -> LockKeys {
        LockKeys::new("distlock", &LockKey::new(name).unwrap())
    }

    #[test]
    fn plain_names_follow_the_documented_layout() {
        let k = keys("payout:42");
        assert_eq!(k.lock, "distlock:{payout:42}");
    }

    #[test]
    fn a_semaphores_permit_slots_share_the_hash_slot_of_its_name() {
        assert_eq!(keys("exports:permit:3").lock, "distlock:{exports}:permit:3");
        let slot = |name: &str| key_slot(keys(name).lock.as_bytes());
        let name = slot("exports");
        for i in [0, 1, 63, 1023] {
            assert_eq!(slot(&format!("exports:permit:{i}")), name, "slot {i}");
        }
        // The last `:permit:` names the slot; the name before it is the semaphore's.
        assert_eq!(
            keys("a:permit:1:permit:0").lock,
            "distlock:{a:permit:1}:permit:0"
        );
        // Not a permit slot: the whole name is the tag, as for any lock.
        assert_eq!(keys("exports:permit:x").lock, "distlock:{exports:permit:x}");
        assert_eq!(keys(":permit:0").lock, "distlock:{:permit:0}");
        // One to one: a lock named like the tag never meets a slot's key, nor do two
        // semaphores' slots.
        assert_ne!(keys("exports").lock, keys("exports:permit:0").lock);
        assert_ne!(keys("a}:permit:0").lock, keys("a:permit:0").lock);
        assert_eq!(keys("a}:permit:0").lock, "distlock:{a%7D}:permit:0");
    }

    #[test]
    fn closing_braces_and_percent_are_encoded_one_to_one() {
        assert_eq!(keys("a}b").lock, "distlock:{a%7Db}");
        assert_eq!(keys("}").lock, "distlock:{%7D}");
        assert_eq!(keys("{x").lock, "distlock:{{x}");
        // "%7D" literally and "}" must not collide.
        assert_ne!(keys("%7D").lock, keys("}").lock);
        assert_eq!(keys("%7D").lock, "distlock:{%257D}");
    }

    #[test]
    fn a_held_value_names_its_holder_and_token_marked_or_not() {
        let owner = OwnerId::random();
        let held = Some((owner, FencingToken(1_764_000_000_123_456)));
        assert_eq!(parse_held(&format!("{owner}:1764000000123456")), held);
        assert_eq!(parse_held(&format!("{owner}:1764000000123456:w")), held);
        for bad in ["", "x", &format!("{owner}"), &format!("{owner}:"), "zz:12"] {
            assert_eq!(parse_held(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_slots_high_water_key_hashes_to_that_slot() {
        assert_eq!(high_water_key("distlock", None), "distlock:tokens");
        for slot in (0..16384).step_by(97).chain([16383]) {
            let key = high_water_key("distlock", Some(slot));
            assert_eq!(key_slot(key.as_bytes()), slot, "{key}");
        }
        // The lock keys of a slot and its high-water key go into one script call.
        let lock = keys("payout:42").lock;
        let slot = key_slot(lock.as_bytes());
        let high = high_water_key("distlock", Some(slot));
        assert_eq!(key_slot(high.as_bytes()), slot);
    }

    #[test]
    fn fenced_resources_have_their_own_namespace() {
        assert_eq!(
            fenced_resource_key("distlock", "ledger"),
            "distlock:fenced:{ledger}"
        );
    }
}
