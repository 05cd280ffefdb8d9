//! The Redis key layout: `<prefix>:{<name>}` holds the owner id, `<prefix>:{<name>}:fence`
//! the newest token. The braces are a Redis Cluster hash tag, so both keys of a lock live
//! in the same slot and one script can touch both.

use distlock_core::LockKey;

/// The two keys of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LockKeys {
    /// Holds the owner id, with the lease's TTL.
    pub(crate) lock: String,
    /// Holds the newest fencing token, without a TTL.
    pub(crate) fence: String,
}

impl LockKeys {
    pub(crate) fn new(prefix: &str, key: &LockKey) -> Self {
        let lock = format!("{prefix}:{{{}}}", hash_tag(key.as_str()));
        let fence = format!("{lock}:fence");
        Self { lock, fence }
    }
}

/// The key that holds the highest admitted token of a fenced resource.
pub(crate) fn fenced_resource_key(prefix: &str, resource: &str) -> String {
    format!("{prefix}:fenced:{{{}}}", hash_tag(resource))
}

/// The name as it goes between the braces.
///
/// Redis hashes the text between the first `{` and the first `}` after it, so a `}` in
/// the name would end the tag early (and `}` first would make it empty, which hashes the
/// whole key and splits a lock's two keys across slots). `%` and `}` are therefore
/// percent-encoded; every other name, `{` and non-ASCII text included, is used as is,
/// and the encoding is one-to-one so two names never share keys.
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
        assert_eq!(k.fence, "distlock:{payout:42}:fence");
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
    fn fenced_resources_have_their_own_namespace() {
        assert_eq!(
            fenced_resource_key("distlock", "ledger"),
            "distlock:fenced:{ledger}"
        );
    }
}
