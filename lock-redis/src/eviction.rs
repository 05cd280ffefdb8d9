//! The eviction check of `build`: a Redis that may evict lock keys (any
//! `maxmemory-policy` but `noeviction`, with a `maxmemory` limit) is refused, as read
//! from each node's `INFO memory`.

use distlock_core::LockError;
use redis::{FromRedisValue, Value};
use tracing::warn;

/// What a node's `INFO memory` says Redis may evict.
#[derive(Debug, PartialEq, Eq)]
enum Eviction {
    /// `noeviction`: a full server refuses writes (`OOM`, which callers see as
    /// `Unavailable`) and keeps every key.
    Never,
    /// Another policy with no memory limit (`maxmemory 0`): nothing is evicted on a 64-bit
    /// server until `maxmemory` is set, which `CONFIG SET` does at runtime.
    Dormant { policy: String },
    /// Another policy with a memory limit (or none reported): keys go once it is reached.
    Live {
        policy: String,
        maxmemory: Option<u64>,
    },
    /// The reply names no policy (a proxy, say).
    Unknown,
}

/// The eviction a node's `INFO memory` text (fields `maxmemory`, `maxmemory_policy`) allows.
fn eviction(info: &str) -> Eviction {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let Some(policy) = field("maxmemory_policy").filter(|p| !p.is_empty()) else {
        return Eviction::Unknown;
    };
    if policy == "noeviction" {
        return Eviction::Never;
    }
    let policy = policy.to_owned();
    match field("maxmemory").and_then(|m| m.parse::<u64>().ok()) {
        Some(0) => Eviction::Dormant { policy },
        maxmemory => Eviction::Live { policy, maxmemory },
    }
}

/// Refuses a Redis that may evict lock keys, naming each such node with its
/// `maxmemory-policy` and `maxmemory`. Under `volatile-*` a full Redis drops keys with a
/// TTL, every lock key among them; under `allkeys-*` also the keys kept without one (the
/// token high-water keys, a fenced resource's highest admitted token): mutual exclusion
/// and fencing would break without an error. The nodes where eviction is only a
/// `CONFIG SET maxmemory` away get one warning, and those whose policy cannot be read
/// another.
pub(crate) fn check(nodes: Vec<(String, Value)>) -> Result<(), LockError> {
    let (mut live, mut dormant, mut unread) = (Vec::new(), Vec::new(), Vec::new());
    for (node, reply) in nodes {
        let info = match reply {
            Value::ServerError(e) => {
                unread.push(format!("{node} (INFO memory refused: {})", e.code()));
                continue;
            }
            reply => String::from_redis_value(reply).map_or(Eviction::Unknown, |i| eviction(&i)),
        };
        match info {
            Eviction::Never => {}
            Eviction::Dormant { policy } => {
                dormant.push(format!(
                    "{node} (`maxmemory-policy {policy}`, `maxmemory 0`)"
                ));
            }
            Eviction::Live { policy, maxmemory } => {
                let maxmemory =
                    maxmemory.map_or_else(|| "not reported".to_owned(), |m| m.to_string());
                live.push(format!(
                    "{node} (`maxmemory-policy {policy}`, `maxmemory {maxmemory}`)"
                ));
            }
            Eviction::Unknown => {
                unread.push(format!("{node} (no maxmemory_policy in INFO memory)"))
            }
        }
    }
    if !live.is_empty() {
        return Err(LockError::Config(format!(
            "Redis may evict lock keys when its memory is full, which silently breaks mutual \
             exclusion and fencing: {}. Set `maxmemory-policy noeviction` (a full Redis then \
             refuses new locks instead)",
            live.join(", ")
        )));
    }
    if !dormant.is_empty() {
        warn!(
            "`maxmemory-policy` evicts keys on {} but no `maxmemory` limit is set, so nothing \
             is evicted yet; once `maxmemory` is set Redis may evict lock keys and silently \
             break mutual exclusion and fencing. Set `maxmemory-policy noeviction`",
            dormant.join(", ")
        );
    }
    // Not refused: nothing shows that this Redis evicts, and refusing would shut out a user
    // whose ACL leaves out `INFO`, or a proxy or managed service that blocks it, who
    // could not change that from here (the version check lets such servers through too).
    if !unread.is_empty() {
        warn!(
            "cannot read `maxmemory-policy` on {}: if it evicts keys (any policy but \
             `noeviction`, with `maxmemory` set), Redis may drop held locks. Check that it is \
             `noeviction`, or grant the user `+info` to have it checked",
            unread.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(maxmemory: &str, policy: &str) -> String {
        format!(
            "# Memory\r\nused_memory:1040856\r\nmaxmemory:{maxmemory}\r\n\
             maxmemory_human:0B\r\nmaxmemory_policy:{policy}\r\nallocator_frag_ratio:1.00\r\n"
        )
    }

    #[test]
    fn any_policy_but_noeviction_evicts_once_maxmemory_is_set() {
        assert_eq!(eviction(&info("104857600", "noeviction")), Eviction::Never);
        assert_eq!(eviction(&info("0", "noeviction")), Eviction::Never);
        for policy in [
            "volatile-lru",
            "allkeys-lru",
            "volatile-ttl",
            "allkeys-lfu",
            "some-future-policy",
        ] {
            assert_eq!(
                eviction(&info("104857600", policy)),
                Eviction::Live {
                    policy: policy.to_owned(),
                    maxmemory: Some(104_857_600)
                }
            );
            assert_eq!(
                eviction(&info("0", policy)),
                Eviction::Dormant {
                    policy: policy.to_owned()
                }
            );
        }
        // `maxmemory_human` is not `maxmemory`; a missing limit is not proof of none.
        assert_eq!(
            eviction("maxmemory_human:0B\r\nmaxmemory_policy:allkeys-lru\r\n"),
            Eviction::Live {
                policy: "allkeys-lru".to_owned(),
                maxmemory: None
            }
        );
        assert_eq!(eviction("# Memory\r\nmaxmemory:0\r\n"), Eviction::Unknown);
    }

    #[test]
    fn the_refusal_names_the_setting_the_value_the_node_and_the_fix() {
        let text = |s: String| Value::BulkString(s.into_bytes());
        let refused = check(vec![
            ("127.0.0.1:7000".to_owned(), text(info("0", "noeviction"))),
            (
                "127.0.0.1:7001".to_owned(),
                text(info("104857600", "allkeys-lru")),
            ),
        ]);
        let Err(LockError::Config(message)) = refused else {
            panic!("refused with a Config error: {refused:?}")
        };
        for part in [
            "`maxmemory-policy allkeys-lru`",
            "127.0.0.1:7001",
            "104857600",
            "`maxmemory-policy noeviction`",
        ] {
            assert!(message.contains(part), "{part} in {message}");
        }
        assert!(!message.contains("7000"), "{message}");
    }

    #[test]
    fn a_policy_that_is_dormant_or_cannot_be_read_is_let_through() {
        // What Redis answers a user without `+info`.
        let refused = redis::parse_redis_value(
            b"-NOPERM this user has no permissions to run the 'info' command\r\n",
        )
        .expect("an error reply");
        let nodes = vec![
            (
                "a".to_owned(),
                Value::BulkString(info("0", "volatile-lru").into_bytes()),
            ),
            ("b".to_owned(), refused),
            ("c".to_owned(), Value::BulkString(b"# Memory\r\n".to_vec())),
        ];
        assert!(check(nodes).is_ok());
    }
}
