//! The coalesced path of `acquire`, a semaphore's permit attempts (`acquire_any` over its
//! slots) and `release` on a single node: how a batch of single calls that the
//! [`Coalescer`](crate::coalesce::Coalescer) gathered is sent (one multi-key script call,
//! or one per semaphore, through [`Core`]) and each of its callers answered.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{BoxError, Effect, Lease, LockError, LockKey, OwnerId, Release};
use tokio::time::Instant;

use crate::coalesce::{SendBatch, Waiting};
use crate::core::{Core, Extra, parse_token, release, spread};
use crate::error::{NAME, is_resendable, map_error, may_have_written};
use crate::keys::{LockKeys, Mark};
use crate::permits::PermitRun;
use crate::scripts::RELEASE_MANY_SCRIPT;

/// One caller's acquire as it goes in a coalesced batch, with the instant its caller
/// called.
pub(crate) struct Acquire {
    pub(crate) key: LockKey,
    pub(crate) ttl: Duration,
    pub(crate) called: Instant,
}

/// Coalesced acquires go as one acquire batch. A lease whose caller has gone (dropped its
/// future) is released in the background, not left to expire.
impl SendBatch<Acquire, Option<Lease>> for Arc<Core> {
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
                if may_have_written(&e) {
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
                    if may_have_written(&e) {
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
        release_orphans(&self, orphans);
    }

    /// A lease granted to a caller who went before reading it: released in the background.
    fn unread(&self, answer: Option<Lease>) {
        release_orphans(self, answer.into_iter().collect());
    }
}

/// One caller's permit attempt as it goes in a coalesced batch: the run of slots it asks
/// for, its TTL and mark, and the instant its caller called.
pub(crate) struct PermitAttempt {
    pub(crate) run: PermitRun,
    pub(crate) ttl: Duration,
    pub(crate) mark: Mark,
    pub(crate) called: Instant,
}

/// A permit attempt waiting in a batch: answered `Some(lease or none)`, or `None` when the
/// server refused the index.
type WaitingPermit = Waiting<PermitAttempt, Option<Option<Lease>>>;

/// Coalesced permit attempts go as one `acquire_permit.lua` call per semaphore, the
/// attempts served in the order they came. Each caller is answered `Some(lease or none)`,
/// or `None` when the server refused this user the index's commands (nothing was taken:
/// the caller takes the slot keys without the index). A lease whose caller has gone is
/// released in the background, not left to expire.
impl SendBatch<PermitAttempt, Option<Option<Lease>>> for Arc<Core> {
    const BACKEND: &'static str = NAME;
    const OPERATION: &'static str = "acquire";

    async fn send(self, batch: Vec<WaitingPermit>) {
        let mut semaphores: Vec<Vec<WaitingPermit>> = Vec::new();
        for w in batch {
            match semaphores
                .iter_mut()
                .find(|s| s[0].call.run.index == w.call.run.index)
            {
                Some(same) => same.push(w),
                None => semaphores.push(vec![w]),
            }
        }
        futures::future::join_all(semaphores.into_iter().map(|s| send_permits(&self, s))).await;
    }

    fn unread(&self, answer: Option<Option<Lease>>) {
        release_orphans(self, answer.flatten().into_iter().collect());
    }
}

/// Sends the permit attempts of one semaphore as one call, and answers their callers.
async fn send_permits(core: &Arc<Core>, attempts: Vec<WaitingPermit>) {
    let owners: Vec<OwnerId> = attempts.iter().map(|_| OwnerId::random()).collect();
    let replies = {
        let sent: Vec<_> = attempts
            .iter()
            .zip(&owners)
            .map(|(w, &owner)| (&w.call.run, owner, w.call.ttl, w.call.mark))
            .collect();
        core.acquire_permits(&attempts[0].call.run, &sent).await
    };
    let replies = match replies {
        Some(Ok(replies)) => replies,
        Some(Err(e)) => {
            for w in attempts {
                let _ = w.answer(Err(duplicate(&e)));
            }
            return;
        }
        None => {
            for w in attempts {
                let _ = w.answer(Ok(None));
            }
            return;
        }
    };
    let mut orphans = Vec::new();
    for ((w, owner), reply) in attempts.into_iter().zip(owners).zip(replies) {
        let PermitAttempt {
            run, ttl, called, ..
        } = &w.call;
        let outcome = match reply {
            None => Ok(Some(None)),
            Some((slot, token)) => match run.slot_key(slot) {
                Some(key) => Ok(Some(Some(core.lease(&key, owner, token, *ttl, *called)))),
                None => Err(core.not_asked(run, owner, slot, *ttl)),
            },
        };
        if let Err(Ok(Some(Some(lease)))) = w.answer(outcome) {
            orphans.push(lease);
        }
    }
    release_orphans(core, orphans);
}

/// Releases, in the background, the leases of acquires whose callers had gone; left to
/// expire outside a runtime.
fn release_orphans(core: &Arc<Core>, orphans: Vec<Lease>) {
    if orphans.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let core = core.clone();
    runtime.spawn(async move {
        let released = core.release_leases(&orphans).await;
        tracing::debug!(
            leases = orphans.len(),
            done = released.is_ok(),
            "released the leases of acquires whose callers had gone"
        );
    });
}

/// Coalesced releases go as one release batch. When the batch's connection drops, each
/// release is settled as a direct one is ([`Core::release_until_settled`]): asked
/// on the new connection and sent again if it did not run, all within the request
/// timeout.
impl SendBatch<Lease, Release> for Arc<Core> {
    const BACKEND: &'static str = NAME;
    const OPERATION: &'static str = "release";

    async fn send(self, batch: Vec<Waiting<Lease, Release>>) {
        let leases: Vec<&Lease> = batch.iter().map(|w| &w.call).collect();
        let (groups, calls) = self
            .calls
            .lease_calls(&RELEASE_MANY_SCRIPT, &leases, Extra::Release);
        let request = async {
            let mut replies = match self.conn.batch(&calls, self.request_timeout).await {
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
