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
}
