//! What a backend sends, apart from sending it: [`Calls`] (a lock's keys and each script
//! call's keys and arguments), how a batch's items are grouped into multi-key calls and
//! how the replies of those calls are spread back over the items, and what an acquire sent
//! twice answers.

use std::collections::BTreeMap;

use std::time::Duration;

use distlock_core::{Effect, Lease, LockError, LockKey, OwnerId};
use redis::{ErrorKind, RedisError, RedisResult, Value};
use tracing::debug;

use crate::conn::{Call, key_slot, reply_error};
use crate::error::{KindName, is_unreachable, map_error};
use crate::keys::{LockKeys, Mark};
use crate::permits::PermitRun;
use crate::scripts::{
    ABANDON_PERMIT_SCRIPT, ABANDON_SCRIPT, ACQUIRE_ANY_SCRIPT, ACQUIRE_MANY_SCRIPT,
    ACQUIRE_PERMIT_SCRIPT, ACQUIRE_SCRIPT, Lua,
};

/// The calls a backend sends, made from its key prefix and what its servers allow: which
/// keys a lock has, and each script call's keys and arguments.
pub(crate) struct Calls {
    pub(crate) prefix: String,
    /// Hash slots divide the keys: a cluster, or a single node that runs in cluster mode
    /// (`redis_mode:cluster`; it answers for the keys of its slots and refuses a script
    /// whose keys span slots). Batches are then grouped by slot, and tokens counted per
    /// slot (see [`Calls::high_water`]).
    pub(crate) slotted: bool,
    /// Releases are announced with `SPUBLISH` (a cluster of Redis 7.0 or newer), not
    /// `PUBLISH`.
    pub(crate) sharded: bool,
    /// The server lets this user announce releases (see `releases::announcements_refused`).
    pub(crate) announces: bool,
}

impl Calls {
    /// The Redis key of `key`, `<prefix>:{<name>}`.
    pub(crate) fn keys(&self, key: &LockKey) -> LockKeys {
        LockKeys::new(&self.prefix, key)
    }

    /// The Redis keys of `keys` when one script call may hold them all: always on a
    /// single node, and where hash slots divide the keys, when they all share one (a
    /// semaphore's permit slots do; a script whose keys span slots is refused with
    /// `CROSSSLOT`). `None` when they span slots, known at the first key of another slot:
    /// a caller that then takes the keys one by one has built only those before it twice.
    pub(crate) fn one_script(&self, keys: &[LockKey]) -> Option<Vec<LockKeys>> {
        let mut first_slot = None;
        let mut locks = Vec::with_capacity(keys.len());
        for key in keys {
            let lock = self.keys(key);
            if self.slotted {
                let slot = key_slot(lock.lock.as_bytes());
                if *first_slot.get_or_insert(slot) != slot {
                    return None;
                }
            }
            locks.push(lock);
        }
        Some(locks)
    }

    /// The high-water key that `lock` shares with the other locks of its hash slot (on a
    /// Cluster) or of the server, which the acquire and fence scripts read (see
    /// `acquire.lua`).
    pub(crate) fn high_water(&self, lock: &str) -> String {
        crate::keys::high_water_key(
            &self.prefix,
            self.slotted.then(|| key_slot(lock.as_bytes())),
        )
    }

    /// The last argument of the release and abandon scripts: `S` makes them announce with
    /// `SPUBLISH`, on the key's shard only, and `-` not at all (the server refuses this
    /// user's announcements: each would be an `ACL LOG` entry); without it they `PUBLISH`.
    pub(crate) fn announce_arg(&self) -> Option<Vec<u8>> {
        if !self.announces {
            return Some(b"-".to_vec());
        }
        self.sharded.then(|| b"S".to_vec())
    }

    pub(crate) fn acquire_call(&self, keys: &LockKeys, owner: OwnerId, ttl: Duration) -> Call {
        let mut args = vec![owner.to_string().into(), ttl.as_millis().to_string().into()];
        if keys.mark != Mark::WhenHeld {
            args.push(vec![keys.mark.arg()]);
        }
        Call {
            script: &ACQUIRE_SCRIPT,
            keys: vec![keys.lock.clone(), self.high_water(&keys.lock)],
            args,
        }
    }

    /// The call of `acquire_any.lua` over `locks` (two or more, of one hash slot), each
    /// marked waited for as `mark` says.
    pub(crate) fn acquire_any_call(
        &self,
        locks: &[LockKeys],
        owner: OwnerId,
        ttl: Duration,
        mark: Mark,
    ) -> Call {
        Call {
            script: &ACQUIRE_ANY_SCRIPT,
            // One hash slot: one high-water key for all.
            keys: locks
                .iter()
                .map(|k| k.lock.clone())
                .chain([self.high_water(&locks[0].lock)])
                .collect(),
            args: vec![
                owner.to_string().into(),
                ttl.as_millis().to_string().into(),
                vec![mark.arg()],
            ],
        }
    }

    /// The call of `acquire_permit.lua` for `attempts` on the semaphore of `run` (each
    /// over a run of that semaphore's slots, by an owner for a TTL, marking as its mark
    /// says), served in order.
    pub(crate) fn acquire_permit_call<'a>(
        &self,
        run: &PermitRun,
        attempts: impl IntoIterator<Item = (&'a PermitRun, OwnerId, Duration, Mark)>,
    ) -> Call {
        let mut keys = run.keys();
        keys.push(self.high_water(&run.index));
        let mut args = vec![run.slots.clone().into_bytes()];
        for (run, owner, ttl, mark) in attempts {
            args.extend(run.attempt_args(owner, ttl, mark));
        }
        Call {
            script: &ACQUIRE_PERMIT_SCRIPT,
            keys,
            args,
        }
    }

    /// The call of `abandon_permit.lua` for an attempt of `owner` over `run`.
    pub(crate) fn abandon_permit_call(&self, run: &PermitRun, owner: OwnerId) -> Call {
        Call {
            script: &ABANDON_PERMIT_SCRIPT,
            keys: run.keys(),
            args: [
                Some(owner.to_string().into()),
                Some(run.slots.clone().into_bytes()),
                self.announce_arg(),
            ]
            .into_iter()
            .flatten()
            .collect(),
        }
    }

    /// The calls of an acquire batch: one [`ACQUIRE_MANY_SCRIPT`] call per group, and the
    /// groups of attempts they carry (for [`spread`]).
    pub(crate) fn acquire_calls(
        &self,
        attempts: &[(LockKeys, OwnerId, Duration)],
    ) -> (Vec<Vec<usize>>, Vec<Call>) {
        let groups = groups(
            self.slotted,
            attempts.iter().map(|(k, ..)| key_slot(k.lock.as_bytes())),
        );
        let mut calls = grouped_calls(&ACQUIRE_MANY_SCRIPT, &groups, |i, keys, args| {
            let (k, owner, ttl) = &attempts[i];
            keys.push(k.lock.clone());
            args.extend([owner.to_string().into(), ttl.as_millis().to_string().into()]);
        });
        // The high-water key each call's locks share, after them; and how each key is
        // marked waited for, one byte per key, unless all are marked only when held.
        for (call, group) in calls.iter_mut().zip(&groups) {
            let high_water = self.high_water(&call.keys[0]);
            call.keys.push(high_water);
            if group.iter().any(|&i| attempts[i].0.mark != Mark::WhenHeld) {
                let marks = group.iter().map(|&i| attempts[i].0.mark.arg());
                call.args.push(marks.collect());
            }
        }
        (groups, calls)
    }

    /// A renew, release or fence call: the lock key (and for a fence the high-water key it
    /// shares), the value the lease holds it with, and `extra` (see [`Extra`]).
    pub(crate) fn lease_call(&self, script: &'static Lua, lease: &Lease, extra: Extra) -> Call {
        let (value, more) = lease_args(lease, extra);
        let mut args: Vec<Vec<u8>> = std::iter::once(value).chain(more).map(Into::into).collect();
        let lock = self.keys(lease.key()).lock;
        let keys = match extra {
            Extra::Release => {
                args.extend(self.announce_arg());
                vec![lock]
            }
            Extra::Token => {
                let high_water = self.high_water(&lock);
                vec![lock, high_water]
            }
            Extra::Ttl => vec![lock],
        };
        Call { script, keys, args }
    }

    /// The multi-key calls of a renew or release batch, and the groups of leases they
    /// carry (for [`spread`]).
    pub(crate) fn lease_calls(
        &self,
        script: &'static Lua,
        leases: &[&Lease],
        extra: Extra,
    ) -> (Vec<Vec<usize>>, Vec<Call>) {
        let keys: Vec<LockKeys> = leases.iter().map(|l| self.keys(l.key())).collect();
        let groups = groups(
            self.slotted,
            keys.iter().map(|k| key_slot(k.lock.as_bytes())),
        );
        let mut calls = grouped_calls(script, &groups, |i, call_keys, args| {
            let (value, more) = lease_args(leases[i], extra);
            call_keys.push(keys[i].lock.clone());
            args.extend(std::iter::once(value).chain(more).map(Into::into));
        });
        if let Extra::Release = extra {
            for call in &mut calls {
                call.args.extend(self.announce_arg());
            }
        }
        (groups, calls)
    }

    /// The call of `abandon.lua` on the key an attempt of `owner` may have taken.
    pub(crate) fn abandon_call(&self, keys: LockKeys, owner: OwnerId) -> Call {
        Call {
            script: &ABANDON_SCRIPT,
            keys: vec![keys.lock],
            args: [Some(owner.to_string().into()), self.announce_arg()]
                .into_iter()
                .flatten()
                .collect(),
        }
    }
}

/// What a lease call sends besides the value the lease holds its key with.
#[derive(Clone, Copy)]
pub(crate) enum Extra {
    /// The lease's TTL in milliseconds (renewals).
    Ttl,
    /// The lease's token, and the high-water key as a second key (fence checks).
    Token,
    /// Nothing per lease, and after the leases the announcing command
    /// ([`Calls::announce_arg`]): releases.
    Release,
}

/// `<owner id>:<token>`, what the lock key holds while `lease` holds it, and the argument
/// `extra` adds after it, if any.
pub(crate) fn lease_args(lease: &Lease, extra: Extra) -> (String, Option<String>) {
    let token = lease.token().get();
    let value = format!("{}:{token}", lease.owner());
    match extra {
        Extra::Ttl => (value, Some(lease.ttl().as_millis().to_string())),
        Extra::Token => (value, Some(token.to_string())),
        Extra::Release => (value, None),
    }
}

/// The reply of an acquire sent again after its first send's connection dropped. The first
/// send may have run: an error of the second (refused for now, no connection, LOADING or
/// READONLY on a server met after a restart or a switchover) says only that the second did
/// not run, so the first send's error stands, an unknown outcome, and the caller cleans up
/// what the first may have taken.
pub(crate) fn resent<T>(first: RedisError, again: redis::RedisResult<T>) -> redis::RedisResult<T> {
    again.map_err(|e| {
        debug!(error = %e.kind_name(), "the acquire sent again failed too; its outcome is unknown");
        first
    })
}

/// One multi-key call per group: `item(i, keys, args)` adds item `i`'s keys and arguments.
pub(crate) fn grouped_calls(
    script: &'static Lua,
    groups: &[Vec<usize>],
    mut item: impl FnMut(usize, &mut Vec<String>, &mut Vec<Vec<u8>>),
) -> Vec<Call> {
    groups
        .iter()
        .map(|group| {
            let mut keys = Vec::with_capacity(group.len());
            let mut args = Vec::with_capacity(group.len() * 2);
            for &i in group {
                item(i, &mut keys, &mut args);
            }
            Call { script, keys, args }
        })
        .collect()
}

/// One reply per item from the replies of the grouped calls: a call's array is split over
/// its items (an error inside it is its item's own); a call's error is each of its items' error.
pub(crate) fn spread(
    groups: &[Vec<usize>],
    replies: Vec<RedisResult<Value>>,
    items: usize,
) -> Vec<RedisResult<Value>> {
    let mut out: Vec<Option<RedisResult<Value>>> = (0..items).map(|_| None).collect();
    for (group, reply) in groups.iter().zip(replies) {
        match reply.and_then(reply_error) {
            Ok(Value::Array(values)) if values.len() == group.len() => {
                for (&i, value) in group.iter().zip(values) {
                    out[i] = Some(value.extract_error());
                }
            }
            other => {
                let e = other.err().unwrap_or_else(|| {
                    RedisError::from((ErrorKind::Client, "a batch script sent a malformed reply"))
                });
                for &i in group {
                    out[i] = Some(Err(e.clone()));
                }
            }
        }
    }
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(RedisError::from((ErrorKind::Client, "no reply")))))
        .collect()
}

/// Most locks in one multi-key script call. A script runs atomically and holds the server
/// meanwhile, so a long batch is split into several calls (pipelined together).
pub(crate) const CHUNK: usize = 128;

/// The items of a batch (given by the slots of their keys) grouped into multi-key
/// script calls: where hash slots divide the keys (a cluster, or a node in cluster
/// mode) a call's keys must share a slot; on one node in standalone mode any
/// keys go together. At most [`CHUNK`] items per call.
pub(crate) fn groups(slotted: bool, slots: impl Iterator<Item = u16>) -> Vec<Vec<usize>> {
    let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, slot) in slots.enumerate() {
        let slot = if slotted { slot } else { 0 };
        by_slot.entry(slot).or_default().push(i);
    }
    by_slot
        .into_values()
        .flat_map(|items| {
            items
                .chunks(CHUNK)
                .map(<[usize]>::to_vec)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The per-lease replies of a renew or release batch: `Some(script result)`, or `None`
/// for a lease whose cluster node did not answer while another node did. Any other
/// per-lease error, or no node answering at all, fails the whole batch.
pub(crate) fn lease_outcomes(
    cluster: bool,
    operation: &'static str,
    replies: Vec<redis::RedisResult<Value>>,
) -> Result<Vec<Option<i64>>, LockError> {
    let mut out = Vec::with_capacity(replies.len());
    let mut unreachable = None;
    let mut answered = 0usize;
    for reply in replies {
        match reply.and_then(|v| Ok(redis::from_redis_value::<i64>(v)?)) {
            Ok(n) => {
                answered += 1;
                out.push(Some(n));
            }
            Err(e) if cluster && is_unreachable(&e) => {
                unreachable.get_or_insert(e);
                out.push(None);
            }
            Err(e) => return Err(map_error(operation, Effect::Write(operation), &e)),
        }
    }
    match unreachable {
        Some(e) if answered == 0 => Err(map_error(operation, Effect::Write(operation), &e)),
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{map_error, server_error};

    /// Whatever stops the resend, the first send may have run: the acquire's outcome is
    /// unknown (so its caller cleans up), never `Unavailable`.
    #[test]
    fn a_resend_that_fails_leaves_the_first_sends_outcome_unknown() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "test"));
        for again in [
            io(std::io::ErrorKind::ConnectionRefused),
            server_error("LOADING Redis is loading the dataset in memory"),
            server_error("READONLY You can't write against a read only replica."),
            server_error("BUSY Redis is busy running a script."),
            server_error("MASTERDOWN Link with MASTER is down"),
        ] {
            let alone = map_error("acquire", Effect::Write("acquire"), &again);
            assert!(matches!(alone, LockError::Unavailable { .. }), "{alone:?}");
            let first = io(std::io::ErrorKind::BrokenPipe);
            let e = resent::<()>(first, Err(again)).expect_err("the resend failed");
            let e = map_error("acquire", Effect::Write("acquire"), &e);
            assert!(matches!(e, LockError::OutcomeUnknown { .. }), "{e:?}");
        }
        let first = io(std::io::ErrorKind::BrokenPipe);
        assert_eq!(resent(first, Ok(7)).unwrap(), 7);
    }
}
