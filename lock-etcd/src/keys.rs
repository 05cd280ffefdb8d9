//! Where a name lives in etcd: `<prefix>/<kind>/<name>`, with the name's `%` and `/`
//! percent-encoded (`%25`, `%2F`).
//!
//! Prefixes and names may both contain `/`, so plain concatenation would give two locks one
//! key: prefix `app` with name `x/locks/y`, and prefix `app/locks/x` with name `y`, would
//! both be `app/locks/x/locks/y`. With the name's slashes encoded, a key has one reading:
//! the name is its last segment, the kind the one before, the prefix the rest. Names
//! without `%` or `/` (most of them) are stored as they are.

/// The etcd key of `name` of `kind` (`locks`, `tokens`, `fenced`, `data`) under `prefix`.
pub(crate) fn etcd_key(prefix: &str, kind: &str, name: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + kind.len() + name.len() + 2);
    key.push_str(prefix);
    key.push('/');
    key.push_str(kind);
    key.push('/');
    for c in name.chars() {
        match c {
            '%' => key.push_str("%25"),
            '/' => key.push_str("%2F"),
            c => key.push(c),
        }
    }
    key
}

/// The name stored at `key` if it is a key of `kind` under `prefix` as [`etcd_key`] writes
/// it; `None` for any other key (another prefix that starts alike, a name not encoded
/// here).
pub(crate) fn name_of(prefix: &str, kind: &str, key: &[u8]) -> Option<String> {
    let key = std::str::from_utf8(key).ok()?;
    let encoded = key
        .strip_prefix(prefix)?
        .strip_prefix('/')?
        .strip_prefix(kind)?
        .strip_prefix('/')?;
    let mut name = String::with_capacity(encoded.len());
    let mut chars = encoded.chars();
    while let Some(c) = chars.next() {
        match c {
            '%' => match (chars.next(), chars.next()) {
                (Some('2'), Some('5')) => name.push('%'),
                (Some('2'), Some('F')) => name.push('/'),
                _ => return None,
            },
            '/' => return None,
            c => name.push(c),
        }
    }
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_without_a_slash_or_percent_are_stored_as_they_are() {
        assert_eq!(
            etcd_key("distlock", "locks", "payout:42"),
            "distlock/locks/payout:42"
        );
    }

    #[test]
    fn a_prefix_and_a_name_that_concatenate_alike_get_different_keys() {
        assert_ne!(
            etcd_key("app", "locks", "x/locks/y"),
            etcd_key("app/locks/x", "locks", "y")
        );
        assert_ne!(
            etcd_key("app", "locks", "x%2Fy"),
            etcd_key("app", "locks", "x/y")
        );
        assert_eq!(etcd_key("app", "locks", "x/y%"), "app/locks/x%2Fy%25");
    }

    #[test]
    fn a_key_reads_back_as_the_name_it_was_made_from() {
        for name in ["payout:42", "x/locks/y", "50%", "a%2Fb", "%/%"] {
            let key = etcd_key("app", "locks", name);
            assert_eq!(
                name_of("app", "locks", key.as_bytes()).as_deref(),
                Some(name)
            );
        }
    }

    #[test]
    fn keys_of_another_prefix_or_kind_or_encoding_have_no_name() {
        let nested = etcd_key("app/locks/x", "locks", "y");
        assert_eq!(name_of("app", "locks", nested.as_bytes()), None);
        let token = etcd_key("app", "tokens", "y");
        assert_eq!(name_of("app", "locks", token.as_bytes()), None);
        assert_eq!(name_of("app", "locks", b"app/locks/50%"), None);
        assert_eq!(name_of("app", "locks", b"app/locks/%41"), None);
        assert_eq!(name_of("app", "locks", b"apple/locks/y"), None);
    }
}
