//! Batches: the items of a batch call (or of coalesced single calls, which the
//! [`SendBatch`] impls here send) grouped into multi-key script calls, one per hash slot
//! (all items on a single node) and at most [`CHUNK`] items each, sent as one pipeline per
//! node; the replies are spread back over the items.

use std::collections::BTreeMap;
use std::time::Duration;

use distlock_core::{BoxError, Effect, Release};
use distlock_core::{Lease, LockBackend, LockError, LockKey, OwnerId};
use redis::{ErrorKind, RedisError, RedisResult, Value};
use tokio::time::Instant;

use super::coalesce::{SendBatch, Waiting};
use super::reply::{parse_token, release};
use super::{Extra, NAME, RedisBackend, lease_args};
use crate::conn::{Call, key_slot, reply_error};
use crate::error::{is_resendable, is_unreachable, map_error};
use crate::keys::{LockKeys, Mark};
use crate::scripts::{ACQUIRE_MANY_SCRIPT, Lua, RELEASE_MANY_SCRIPT};

/// Most locks in one multi-key script call. A script runs atomically and holds the server
/// meanwhile, so a long batch is split into several calls (pipelined together).
const CHUNK: usize = 128;

impl RedisBackend {
    /// Runs a batch under [`Self::timed_within`]. In a cluster each node's pipeline has the
    /// response timeout of its own (a silent node makes only its items unreachable), so
    /// the whole batch gets twice that, room for the redirected calls sent again after.
    async fn timed_batch(
        &self,
        operation: &'static str,
        calls: &[Call],
    ) -> Result<Vec<redis::RedisResult<Value>>, LockError> {
        let node_timeout = self.inner.response_timeout;
        let limit = if self.inner.cluster {
            node_timeout * 2
        } else {
            node_timeout
        };
        let request = self.inner.conn.batch(calls, node_timeout);
        self.timed_within(limit, operation, Effect::Write(operation), request)
            .await
    }

    /// The per-lease replies of a renew or release batch: `Some(script result)`, or `None`
    /// for a lease whose cluster node did not answer while another node did. Any other
    /// per-lease error, or no node answering at all, fails the whole batch.
    pub(super) fn lease_outcomes(
        &self,
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
                Err(e) if self.inner.cluster && is_unreachable(&e) => {
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

    /// The items of a batch (given by the slots of their keys) grouped into multi-key
    /// script calls: where hash slots divide the keys (a cluster, or a node in cluster
    /// mode) a call's keys must share a slot; on one node in standalone mode any
    /// keys go together. At most [`CHUNK`] items per call.
    fn groups(&self, slots: impl Iterator<Item = u16>) -> Vec<Vec<usize>> {
        let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, slot) in slots.enumerate() {
            let slot = if self.inner.slotted { slot } else { 0 };
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

    /// An acquire batch: one [`ACQUIRE_MANY_SCRIPT`] call per group, one reply per attempt
    /// (in the order of `attempts`). The outer error means nothing is known of any attempt.
    pub(super) async fn send_acquires(
        &self,
        operation: &'static str,
        attempts: &[(LockKeys, OwnerId, Duration)],
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let groups = self.groups(attempts.iter().map(|(k, ..)| key_slot(k.lock.as_bytes())));
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
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, attempts.len()))
    }

    /// `acquire_many` without replica acknowledgements: one acquire batch for all keys.
    /// In a cluster, the keys of a node that did not answer while another did are `None`
    /// (what their attempts may have taken is given back in the background); any other
    /// failure fails the batch, and the keys it took are released.
    pub(super) async fn acquire_batch(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let with_ttl: Vec<(LockKeys, OwnerId, Duration)> = keys
            .iter()
            .map(|k| (self.acquire_keys(k), OwnerId::random(), ttl))
            .collect();
        let sent = Instant::now();
        let replies = self.send_acquires("acquire_many", &with_ttl).await;
        let attempts: Vec<(LockKeys, OwnerId)> =
            with_ttl.into_iter().map(|(k, o, _)| (k, o)).collect();
        let replies = match replies {
            Ok(r) => r,
            Err(e) => {
                if matches!(e, LockError::OutcomeUnknown { .. }) {
                    self.abandon(attempts, ttl);
                }
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(keys.len());
        let mut failure = None;
        let mut unknown = Vec::new();
        let mut unreachable = None;
        let mut answered = 0usize;
        for ((key, (lock_keys, owner)), reply) in keys.iter().zip(attempts).zip(replies) {
            let reply = match reply {
                // A cluster node that did not answer: its keys are `None`, and whatever an
                // attempt that reached it may have taken is given back in the background.
                Err(e) if self.inner.cluster && is_unreachable(&e) => {
                    unknown.push((lock_keys, owner));
                    unreachable.get_or_insert(e);
                    out.push(None);
                    continue;
                }
                other => other,
            };
            match reply
                .map_err(|e| map_error("acquire_many", Effect::Write("acquire_many"), &e))
                .and_then(|v| parse_token(Some(v)))
            {
                Ok(token) => {
                    answered += 1;
                    out.push(token.map(|t| self.lease(key, owner, t, ttl, sent)));
                }
                Err(e) => {
                    if matches!(e, LockError::OutcomeUnknown { .. }) {
                        unknown.push((lock_keys, owner));
                    }
                    failure.get_or_insert(e);
                    out.push(None);
                }
            }
        }
        if failure.is_none() && answered == 0 {
            failure =
                unreachable.map(|e| map_error("acquire_many", Effect::Write("acquire_many"), &e));
        }
        if let Some(e) = failure {
            // A failed batch holds nothing: give back what it took.
            let taken: Vec<Lease> = out.into_iter().flatten().collect();
            let _ = self.release_many(&taken).await;
            if !unknown.is_empty() {
                self.abandon(unknown, ttl);
            }
            return Err(e);
        }
        if !unknown.is_empty() {
            self.abandon(unknown, ttl);
        }
        Ok(out)
    }

    /// A renew or release batch: one multi-key call per group, one reply per lease.
    pub(super) async fn send_lease_batch(
        &self,
        operation: &'static str,
        script: &'static Lua,
        leases: &[&Lease],
        extra: Extra,
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let (groups, calls) = self.lease_calls(script, leases, extra);
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, leases.len()))
    }

    /// The multi-key calls of a renew or release batch, and the groups of leases they
    /// carry (for [`spread`]).
    pub(super) fn lease_calls(
        &self,
        script: &'static Lua,
        leases: &[&Lease],
        extra: Extra,
    ) -> (Vec<Vec<usize>>, Vec<Call>) {
        let keys: Vec<LockKeys> = leases.iter().map(|l| self.keys(l.key())).collect();
        let groups = self.groups(keys.iter().map(|k| key_slot(k.lock.as_bytes())));
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

    /// Settles the releases of a batch that failed for a reason a single release is sent
    /// again after (see [`Self::release_until_settled`]), one by one: a connection that
    /// dropped, or a node that refused for now.
    pub(super) async fn settle_releases(
        &self,
        replies: &mut [RedisResult<Value>],
        leases: &[&Lease],
    ) {
        let settle = replies.iter_mut().zip(leases).filter_map(|(reply, lease)| {
            let failed = match reply {
                Err(e) if is_resendable(e) => e.clone(),
                _ => return None,
            };
            Some(async move {
                *reply = self
                    .release_until_settled(lease, Some(failed))
                    .await
                    .map(Value::Int);
            })
        });
        futures::future::join_all(settle).await;
    }
}

/// One caller's acquire as it goes in a coalesced batch, with the instant its caller
/// called.
pub(super) struct Acquire {
    pub(super) key: LockKey,
    pub(super) ttl: Duration,
    pub(super) called: Instant,
}

/// Coalesced acquires go as one acquire batch. A lease whose caller has gone (dropped its
/// future) is released in the background, not left to expire.
impl SendBatch<Acquire, Option<Lease>> for RedisBackend {
    const BACKEND: &'static str = NAME;
    const OPERATION: &'static str = "acquire";

    async fn send(self, batch: Vec<Waiting<Acquire, Option<Lease>>>) {
        let attempts: Vec<(LockKeys, OwnerId, Duration)> = batch
            .iter()
            .map(|w| {
                (
                    self.acquire_keys(&w.call.key),
                    OwnerId::random(),
                    w.call.ttl,
                )
            })
            .collect();
        let longest = batch.iter().map(|w| w.call.ttl).max().unwrap_or_default();
        let replies = match self.send_acquires("acquire", &attempts).await {
            Ok(replies) => replies,
            Err(e) => {
                if matches!(e, LockError::OutcomeUnknown { .. }) {
                    self.abandon(
                        attempts.into_iter().map(|(k, o, _)| (k, o)).collect(),
                        longest,
                    );
                }
                for w in batch {
                    let _ = w.answer(Err(duplicate(&e)));
                }
                return;
            }
        };
        let mut unknown = Vec::new();
        let mut orphans = Vec::new();
        for ((w, (keys, owner, _)), reply) in batch.into_iter().zip(attempts).zip(replies) {
            let Acquire { key, ttl, called } = &w.call;
            let outcome = match reply
                .map_err(|e| map_error("acquire", Effect::Write("acquire"), &e))
                .and_then(|v| parse_token(Some(v)))
            {
                Ok(token) => Ok(token.map(|t| self.lease(key, owner, t, *ttl, *called))),
                Err(e) => {
                    if matches!(e, LockError::OutcomeUnknown { .. }) {
                        unknown.push((keys, owner));
                    }
                    Err(e)
                }
            };
            if let Err(Ok(Some(lease))) = w.answer(outcome) {
                orphans.push(lease);
            }
        }
        if !unknown.is_empty() {
            self.abandon(unknown, longest);
        }
        self.release_orphans(orphans);
    }

    /// A lease granted to a caller who went before reading it: released in the background.
    fn unread(&self, answer: Option<Lease>) {
        self.release_orphans(answer.into_iter().collect());
    }
}

impl RedisBackend {
    /// Releases, in the background, the leases of acquires whose callers had gone; left to
    /// expire outside a runtime.
    fn release_orphans(&self, orphans: Vec<Lease>) {
        if orphans.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.clone();
        runtime.spawn(async move {
            let released = backend.release_many(&orphans).await;
            tracing::debug!(
                leases = orphans.len(),
                done = released.is_ok(),
                "released the leases of acquires whose callers had gone"
            );
        });
    }
}

/// Coalesced releases go as one release batch. When the batch's connection drops, each
/// release is settled as a direct one is ([`RedisBackend::release_until_settled`]): asked
/// on the new connection and sent again if it did not run, all within the response
/// timeout.
impl SendBatch<Lease, Release> for RedisBackend {
    const BACKEND: &'static str = NAME;
    const OPERATION: &'static str = "release";

    async fn send(self, batch: Vec<Waiting<Lease, Release>>) {
        let leases: Vec<&Lease> = batch.iter().map(|w| &w.call).collect();
        let (groups, calls) = self.lease_calls(&RELEASE_MANY_SCRIPT, &leases, Extra::Release);
        let request = async {
            let mut replies = match self
                .inner
                .conn
                .batch(&calls, self.inner.response_timeout)
                .await
            {
                Ok(replies) => spread(&groups, replies, leases.len()),
                Err(e) if is_resendable(&e) => leases.iter().map(|_| Err(e.clone())).collect(),
                Err(e) => return Err(e),
            };
            self.settle_releases(&mut replies, &leases).await;
            Ok(replies)
        };
        let replies = self
            .timed("release", Effect::Write("release"), request)
            .await;
        let replies = match replies {
            Ok(replies) => replies,
            Err(e) => {
                for w in batch {
                    let _ = w.answer(Err(duplicate(&e)));
                }
                return;
            }
        };
        for (w, reply) in batch.into_iter().zip(replies) {
            let outcome = reply
                .and_then(|v| Ok(redis::from_redis_value::<i64>(v)?))
                .map(release)
                .map_err(|e| map_error("release", Effect::Write("release"), &e));
            let _ = w.answer(outcome);
        }
    }

    /// An unread release outcome changes nothing: the release ran.
    fn unread(&self, _: Release) {}
}

/// The error of a coalesced batch, once for each of its callers (`LockError` is not `Clone`,
/// nor is its source: each copy keeps the source's text).
fn duplicate(e: &LockError) -> LockError {
    let source = |s: &Option<BoxError>| s.as_ref().map(|s| BoxError::from(s.to_string()));
    match e {
        LockError::OutcomeUnknown {
            backend,
            operation,
            message,
            source: s,
        } => LockError::OutcomeUnknown {
            backend,
            operation,
            message: message.clone(),
            source: source(s),
        },
        LockError::Unavailable {
            backend,
            message,
            source: s,
        } => LockError::Unavailable {
            backend,
            message: message.clone(),
            source: source(s),
        },
        LockError::Config(message) => LockError::Config(message.clone()),
        other => LockError::backend(NAME, other.to_string()),
    }
}

/// One multi-key call per group: `item(i, keys, args)` adds item `i`'s keys and arguments.
fn grouped_calls(
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
pub(super) fn spread(
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
