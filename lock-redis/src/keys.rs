//! The Redis key layout: `<prefix>:{<name>}` holds `<owner id>:<token>` while the lock is
//! held (with `:w` appended once an acquire found it held, so its release is announced),
//! and nothing else is kept. The braces are a Redis Cluster hash tag, so the keys of one
//! batch call can be grouped by slot, and the key's name is also its release channel.

use distlock_core::{FencingToken, LockKey, OwnerId};

/// The Redis key of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LockKeys {
    /// Holds `<owner id>:<token>`, with the lease's TTL.
    pub(crate) lock: String,
    /// An acquire grants the lock already marked waited for (`:w`), so that its release is
    /// announced: other waiters of this process watch it (see `acquire.lua`).
    pub(crate) mark_waited: bool,
}

impl LockKeys {
    pub(crate) fn new(prefix: &str, key: &LockKey) -> Self {
        let lock = format!("{prefix}:{{{}}}", hash_tag(key.as_str()));
        Self {
            lock,
            mark_waited: false,
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
    fn fenced_resources_have_their_own_namespace() {
        assert_eq!(
            fenced_resource_key("distlock", "ledger"),
            "distlock:fenced:{ledger}"
        );
    }
}
