//! [`Core`]: what a Redis backend holds (the connection to one node or a cluster, its
//! settings, what the server allows) and every operation it sends: the single-key
//! scripts, the multi-key batches (one script call per hash slot, one pipeline per node),
//! the acquire followed by `WAIT`, and the cleanup after an acquire whose outcome is
//! unknown. [`crate::RedisBackend`] implements the trait on top of it, choosing for each
//! call which of these it takes. Below it: `calls` (a lock's keys, the keys and arguments
//! of each script call, and how a batch's items are grouped and its replies spread back),
//! `cleanup` (the resends of the cleanup), `reply` (what the scripts' replies mean) and
//! `acked` (the connections of acquires with `WAIT`).

mod acked;
mod calls;
mod cleanup;
mod reply;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distlock_core::{
    BackendId, Capabilities, DriverFailure, Effect, FailureKind, Fence, FencingToken, Lease,
    LockError, LockInfo, LockKey, OwnerId, Release, Renewal, valid_until,
};
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use redis::{RedisError, RedisResult, Value};
use tokio::time::Instant;
use tracing::{debug, warn};

pub use self::acked::ACKED_CONNECTIONS;
pub(crate) use self::acked::{AckedConn, AckedConns, Connector};
pub(crate) use self::calls::{Calls, Extra, spread};
use self::calls::{lease_outcomes, resent};
use self::cleanup::RESEND_PAUSE;
pub(crate) use self::reply::{parse_token, release, renewal};
use crate::conn::{Call, Conn};
use crate::error::{
    KindName, NAME, is_refused_for_now, is_refused_in_script, is_resendable, is_unreachable,
    map_error, may_have_written,
};
use crate::keys::{LockKeys, Mark, parse_held};
use crate::permits::PermitRun;
use crate::releases::ReleaseListener;
use crate::scripts::{
    FENCE_SCRIPT, Lua, RELEASE_MANY_SCRIPT, RELEASE_SCRIPT, RENEW_MANY_SCRIPT, RENEW_SCRIPT,
};

/// The connection of a Redis backend, its settings, and every operation it sends. Made
/// by `connect`; shared by the clones of a [`crate::RedisBackend`].
pub(crate) struct Core {
    pub(crate) conn: Conn,
    /// The keys and the calls of its scripts.
    pub(crate) calls: Calls,
    pub(crate) caps: Capabilities,
    pub(crate) request_timeout: Duration,
    pub(crate) replica_acks: Option<(usize, Duration)>,
    /// The connections acquires with `WAIT` go over (with `replica_acks` only).
    pub(crate) acked: Option<Arc<AckedConns>>,
    pub(crate) id: BackendId,
    /// The URLs with passwords hidden, for `Debug`.
    pub(crate) shown_urls: Vec<String>,
    pub(crate) cluster: bool,
    /// Hears the releases of the keys this instance's waiters watch.
    pub(crate) listener: ReleaseListener,
    /// Set once the server refused this user a command of a semaphore's index: permit
    /// attempts then take the slot keys without it (see [`Core::acquire_permits`]).
    pub(crate) index_refused: AtomicBool,
}

/// An acquire on its way: if its future is dropped before the reply, whatever it may have
/// taken is given back in the background (checked against its owner id). One attempt,
/// or one per key an `acquire_any` may have taken.
pub(crate) struct AbandonOnDrop<'a> {
    core: &'a Core,
    attempts: Vec<(LockKeys, OwnerId)>,
    /// Permit attempts through a semaphore's index: their run and owner id, from which
    /// `abandon_permit.lua` finds the slot each took (the calls are built only if needed).
    permits: Vec<(&'a PermitRun, OwnerId)>,
    ttl: Duration,
    /// The connection of its own the attempt went over, if any: the cleanup goes over it
    /// too, so that it runs after the attempt.
    over: Option<AckedConn>,
}

impl<'a> AbandonOnDrop<'a> {
    /// Holds `attempts` of locks, given back over the shared connection unless settled.
    fn new(core: &'a Core, attempts: Vec<(LockKeys, OwnerId)>, ttl: Duration) -> Self {
        Self {
            core,
            attempts,
            permits: Vec::new(),
            ttl,
            over: None,
        }
    }

    /// The attempt's outcome is known: nothing is given back when this is dropped.
    pub(crate) fn settled(&mut self) {
        self.attempts.clear();
        self.permits.clear();
    }
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if !self.attempts.is_empty() {
            let attempts = std::mem::take(&mut self.attempts);
            self.core.abandon_over(self.over.take(), attempts, self.ttl);
        }
        if !self.permits.is_empty() {
            let calls = self
                .permits
                .drain(..)
                .map(|(run, owner)| self.core.calls.abandon_permit_call(run, owner))
                .collect();
            self.core.give_back(self.over.take(), calls, self.ttl);
        }
    }
}

/// A grant whose `WAIT` came back: the lease, how many replicas acknowledged it, and the
/// attempt, given back if dropped before [`AbandonOnDrop::settled`].
pub(crate) struct Acked<'a> {
    pub(crate) lease: Lease,
    pub(crate) replicas: i64,
    pub(crate) pending: AbandonOnDrop<'a>,
}

impl Core {
    /// [`Self::keys`] for an acquire, marked as [`Self::mark`] says.
    pub(crate) fn acquire_keys(&self, key: &LockKey) -> LockKeys {
        LockKeys {
            mark: self.mark(std::slice::from_ref(key)),
            ..self.calls.keys(key)
        }
    }

    /// How an acquire of one of `keys` marks it waited for (see `acquire.lua`): never when
    /// this backend hears no release (wake-ups off, or its listener refused), granted
    /// marked when other waiters of this process watch one of them, and otherwise marked
    /// only if held.
    pub(crate) fn mark(&self, keys: &[LockKey]) -> Mark {
        let listener = &self.listener;
        if !listener.hears_releases() {
            Mark::Never
        } else if keys.iter().any(|k| listener.others_wait(k)) {
            Mark::Granted
        } else {
            Mark::WhenHeld
        }
    }

    /// Waits for a reply at most the request timeout. No reply in time means the request
    /// may have run: `OutcomeUnknown` for an operation that changes state.
    ///
    /// Not an `async fn`, nor an `async` block: either would keep `request` twice in its
    /// state (as it came and inside the timeout), doubling the size of every call's future.
    pub(crate) fn timed<T>(
        &self,
        operation: &'static str,
        effect: Effect,
        request: impl Future<Output = Result<T, RedisError>>,
    ) -> impl Future<Output = Result<T, LockError>> {
        self.timed_within(self.request_timeout, operation, effect, request)
    }

    /// [`Self::timed`] with a limit of its own (a cluster's batch waits longer).
    fn timed_within<T>(
        &self,
        limit: Duration,
        operation: &'static str,
        effect: Effect,
        request: impl Future<Output = Result<T, RedisError>>,
    ) -> impl Future<Output = Result<T, LockError>> {
        tokio::time::timeout(limit, request)
            .map(move |reply| Self::reply_or_error(reply, operation, effect, limit))
    }

    /// What [`Self::timed_within`] makes of a reply, or of none within `limit`.
    fn reply_or_error<T>(
        reply: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
        operation: &'static str,
        effect: Effect,
        limit: Duration,
    ) -> Result<T, LockError> {
        match reply {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map_error(operation, effect, &e)),
            Err(_) => {
                let message = format!("no reply within {limit:?}");
                Err(DriverFailure::new(FailureKind::ReplyLost, message).into_error(NAME, effect))
            }
        }
    }

    /// After an acquire whose outcome is unknown: deletes the keys the attempts may have
    /// taken, in the background, checked against their owner ids. Best effort: the keys
    /// expire on their own anyway. Bounded: each try waits at most the request timeout,
    /// a try whose connection dropped is made again, and so are the keys a server refused
    /// for now (a replica, a dataset loading, a busy script); the cleanup gives up after
    /// two request timeouts (or the TTL, if shorter), so a hung server
    /// does not keep a task per attempt alive for the lease's TTL.
    pub(crate) fn abandon(&self, attempts: Vec<(LockKeys, OwnerId)>, ttl: Duration) {
        self.abandon_over(None, attempts, ttl);
    }

    /// [`Self::abandon`] over `over`, the connection the attempts went over, when it is not
    /// the shared one.
    fn abandon_over(
        &self,
        over: Option<AckedConn>,
        attempts: Vec<(LockKeys, OwnerId)>,
        ttl: Duration,
    ) {
        let calls = attempts
            .into_iter()
            .map(|(keys, owner)| self.calls.abandon_call(keys, owner))
            .collect();
        self.give_back(over, calls, ttl);
    }

    /// Sends the abandon `calls` in the background, over `over` if given (see
    /// [`Self::abandon`]).
    fn give_back(&self, over: Option<AckedConn>, calls: Vec<Call>, ttl: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let conn = over
            .as_ref()
            .map_or_else(|| self.conn.clone(), |c| c.conn().clone());
        let node_timeout = self.request_timeout;
        runtime.spawn(async move {
            // Kept until the cleanup is done: it is not handed to another call meanwhile.
            let _over = over;
            cleanup::give_back(&conn, calls, ttl, node_timeout).await;
        });
    }

    /// One acquire sent directly, with the single-key script.
    pub(crate) async fn acquire_one(
        &self,
        key: &LockKey,
        ttl: Duration,
        called: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let keys = self.acquire_keys(key);
        let owner = OwnerId::random();
        let call = self.calls.acquire_call(&keys, owner, ttl);
        let mut pending = AbandonOnDrop::new(self, vec![(keys, owner)], ttl);
        let reply = self
            .timed(
                "acquire",
                Effect::Write("acquire"),
                self.invoke_resending::<Option<u64>>(&call),
            )
            .await;
        let attempts = std::mem::take(&mut pending.attempts);
        match reply {
            Ok(token) => Ok(token.map(|t| self.lease(key, owner, t, ttl, called))),
            Err(e) => {
                if let LockError::OutcomeUnknown { .. } = e {
                    self.abandon(attempts, ttl);
                }
                Err(e)
            }
        }
    }

    /// One free key of `keys` (two or more, of one hash slot), whose Redis keys are
    /// `locks` (see [`Calls::one_script`]), with one script; see
    /// [`LockBackend::acquire_any`].
    pub(crate) async fn acquire_any_one(
        &self,
        keys: &[LockKey],
        locks: Vec<LockKeys>,
        ttl: Duration,
        called: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let owner = OwnerId::random();
        // A semaphore's waiters watch every slot.
        let mark = self.mark(keys);
        let call = self.calls.acquire_any_call(&locks, owner, ttl, mark);
        let attempts = locks.into_iter().map(|k| (k, owner)).collect();
        let mut pending = AbandonOnDrop::new(self, attempts, ttl);
        let reply = self.send_any::<Option<(usize, u64)>>(&call, None).await;
        let attempts = std::mem::take(&mut pending.attempts);
        match reply {
            Ok(None) => Ok(None),
            Ok(Some((taken, token))) => {
                // The script counts keys from 1, as Lua does.
                let key = taken
                    .checked_sub(1)
                    .and_then(|i| keys.get(i))
                    .ok_or_else(|| {
                        LockError::backend(
                            NAME,
                            format!("the acquire_any script named key {taken} of {}", keys.len()),
                        )
                    })?;
                Ok(Some(self.lease(key, owner, token, ttl, called)))
            }
            Err(e) => {
                if let LockError::OutcomeUnknown { .. } = e {
                    self.abandon(attempts, ttl);
                }
                Err(e)
            }
        }
    }

    /// One free slot of a semaphore's run `run` of slots (named by `keys`), through the
    /// semaphore's index, with one script (`acquire_permit.lua`); see
    /// [`LockBackend::acquire_any`].
    ///
    /// `None` when the server refused this user one of the index's commands, as
    /// [`Self::acquire_permits`] says.
    pub(crate) async fn acquire_permit_one(
        &self,
        keys: &[LockKey],
        run: &PermitRun,
        ttl: Duration,
        called: Instant,
    ) -> Option<Result<Option<Lease>, LockError>> {
        let owner = OwnerId::random();
        // A semaphore's waiters watch every slot: the first slot says whether any does.
        let mark = self.mark(&keys[..1]);
        let replies = self
            .acquire_permits(run, &[(run, owner, ttl, mark)])
            .await?;
        Some(replies.and_then(|replies| {
            let Some((slot, token)) = replies.into_iter().next().flatten() else {
                return Ok(None);
            };
            match run.slot_key(slot) {
                Some(key) => Ok(Some(self.lease(&key, owner, token, ttl, called))),
                None => Err(self.not_asked(run, owner, slot, ttl)),
            }
        }))
    }

    /// Permit attempts on the semaphore of `run` (each over a run of its slots, by an
    /// owner, for a TTL, marking as it says), with one script call (`acquire_permit.lua`)
    /// served in order: per attempt, the slot it took and its token.
    ///
    /// `None` when the server refused this user one of the index's commands (`NOPERM`:
    /// an ACL user set up before the index): the script is refused before it writes any
    /// slot key, so nothing was taken, and the caller takes the slot keys without the
    /// index. The first refusal is logged once; from then on [`Self::index_refused`] says
    /// so and the index is not tried again. If the outcome is unknown (or the future
    /// dropped before it is known), what the attempts may have taken is given back in the
    /// background, found by their owner ids.
    pub(crate) async fn acquire_permits(
        &self,
        run: &PermitRun,
        attempts: &[(&PermitRun, OwnerId, Duration, Mark)],
    ) -> Option<Result<Vec<Option<(u32, u64)>>, LockError>> {
        let call = self
            .calls
            .acquire_permit_call(run, attempts.iter().copied());
        let mut pending = AbandonOnDrop {
            core: self,
            attempts: Vec::new(),
            permits: attempts
                .iter()
                .map(|&(run, owner, ..)| (run, owner))
                .collect(),
            ttl: attempts.iter().map(|a| a.2).max().unwrap_or_default(),
            over: None,
        };
        let mut refused = None;
        let reply = self
            .send_any::<Vec<Option<(u32, u64)>>>(&call, Some(&mut refused))
            .await;
        if let Some(kind) = refused {
            pending.settled();
            if !self.index_refused.swap(true, Ordering::Relaxed) {
                warn!(
                    error = %kind,
                    "the server refuses this user a command of the semaphores' index; \
                     semaphore attempts read the slot keys one by one instead (grant the \
                     user the index's commands, as the README's ACL line does)"
                );
            }
            return None;
        }
        let reply = reply.and_then(|replies| {
            if replies.len() == attempts.len() {
                Ok(replies)
            } else {
                Err(LockError::outcome_unknown(
                    NAME,
                    "acquire",
                    format!(
                        "the acquire_permit script answered {} of {} attempts",
                        replies.len(),
                        attempts.len()
                    ),
                ))
            }
        });
        if !matches!(reply, Err(LockError::OutcomeUnknown { .. })) {
            pending.settled();
        }
        Some(reply)
    }

    /// The error of a permit attempt the script answered with `slot`, not one of its
    /// run's; the slot is given back in the background.
    pub(crate) fn not_asked(
        &self,
        run: &PermitRun,
        owner: OwnerId,
        slot: u32,
        ttl: Duration,
    ) -> LockError {
        self.give_back(None, vec![self.calls.abandon_permit_call(run, owner)], ttl);
        LockError::backend(
            NAME,
            format!(
                "the acquire_permit script took slot {slot}, not one of the {} asked for",
                run.len()
            ),
        )
    }

    /// Whether the server refused this user a command of a semaphore's index (see
    /// [`Self::acquire_permits`]).
    pub(crate) fn index_refused(&self) -> bool {
        self.index_refused.load(Ordering::Relaxed)
    }

    /// Whether a semaphore's slots are asked through its index: not with `replica_acks`
    /// (each slot is then asked on its own, so that each grant waits for its replicas),
    /// nor once the server refused this user the index's commands. What
    /// `Capabilities::permit_index` says.
    pub(crate) fn permit_index(&self) -> bool {
        self.replica_acks.is_none() && !self.index_refused()
    }

    /// Sends an any-of acquire's `call` (`acquire_any.lua`, answering `{i, token}` or nil,
    /// or `acquire_permit.lua`, answering that per attempt). Sent again after a dropped
    /// connection, here (never by a cluster's retrying connection: the scripts run once, see
    /// `ACQUIRE_ANY_SCRIPT`), with the flag that makes the script look first for the key
    /// this attempt took (see `acquire_any.lua`).
    ///
    /// With `refused`, a command of the script refused by the user's ACL is not an
    /// error: its kind is put there instead (and the reply is `T::default()`).
    async fn send_any<T: redis::FromRedisValue + Default>(
        &self,
        call: &Call,
        refused: Option<&mut Option<String>>,
    ) -> Result<T, LockError> {
        self.timed("acquire", Effect::Write("acquire"), async {
            let reply = match self.conn.invoke::<T>(call).await {
                Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                    debug!(error = %e.kind_name(), "acquire_any: connection lost; sending it again");
                    let mut again = call.clone();
                    again.args.push(b"R".to_vec());
                    let reply = Box::pin(self.conn.invoke::<T>(&again)).await;
                    resent(e, reply)
                }
                reply => reply,
            };
            match (reply, refused) {
                (Err(e), Some(refused)) if is_refused_in_script(&e) => {
                    *refused = Some(e.kind_name());
                    Ok(T::default())
                }
                (reply, _) => reply,
            }
        })
        .await
    }

    /// Sends an acquire script's `call` on the shared connection. A single node's
    /// connection that dropped is sent the same call once more, on the connection it makes
    /// again: the acquire scripts answer a resent attempt with the grant it already made,
    /// so the call cannot take a key twice, and a restart or a network blip costs one
    /// round trip instead of an unknown outcome. (A cluster connection resends on its own.)
    async fn invoke_resending<T: redis::FromRedisValue>(
        &self,
        call: &Call,
    ) -> Result<T, RedisError> {
        match self.conn.invoke::<T>(call).await {
            Err(e) if !self.cluster && (e.is_connection_dropped() || e.is_io_error()) => {
                debug!(error = %e.kind_name(), "acquire: connection lost; sending it again");
                // Boxed: a rare path should not double the size of every call.
                let reply = Box::pin(self.conn.invoke::<T>(call)).await;
                resent(e, reply)
            }
            reply => reply,
        }
    }

    /// One release. A release whose connection dropped either ran before the drop or
    /// never will: if the store still shows the lease as the holder afterwards (asked on
    /// the connection made again), it did not run and is sent once more. Sending it again
    /// blindly could report `NotHeld` for a release that did run. A release the node
    /// refused for now (a failover or restart under way: CLUSTERDOWN, TRYAGAIN, LOADING,
    /// no connection to the node yet) did not run either, and is sent again.
    ///
    /// Both are tried again after a short pause, for half the request timeout at most:
    /// a connection made again after a restart or a failover is not always ready for the
    /// very next request.
    pub(crate) async fn release_one(&self, lease: &Lease) -> Result<Release, LockError> {
        let released = self
            .timed(
                "release",
                Effect::Write("release"),
                self.release_until_settled(lease, None),
            )
            .await?;
        Ok(release(released))
    }

    /// Sends `lease`'s release until its outcome is known, as [`Self::release_one`] says;
    /// `failed` is the error of a send already made (a batch's), if any.
    pub(crate) async fn release_until_settled(
        &self,
        lease: &Lease,
        failed: Option<RedisError>,
    ) -> redis::RedisResult<i64> {
        let call = self
            .calls
            .lease_call(&RELEASE_SCRIPT, lease, Extra::Release);
        let give_up = Instant::now() + self.request_timeout / 2;
        let mut pause = RESEND_PAUSE;
        // The error of the last send when it may have run: ask before sending again.
        let mut unsure: Option<RedisError> = None;
        let mut failed = failed;
        loop {
            if let Some(e) = &unsure {
                // Boxed: a rare path should not double the size of every release.
                let fence_call = self.calls.lease_call(&FENCE_SCRIPT, lease, Extra::Token);
                match Box::pin(self.conn.invoke::<(i64, u64)>(&fence_call)).await {
                    // Still held: the release did not run.
                    Ok((1, _)) => unsure = None,
                    // Gone: it ran, or the lease ran out; nobody can say which.
                    Ok(_) => return Err(e.clone()),
                    Err(asked) if Instant::now() + pause < give_up && is_unreachable(&asked) => {
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                        continue;
                    }
                    Err(_) => return Err(e.clone()),
                }
            }
            let reply = match failed.take() {
                Some(e) => Err(e),
                None => self.conn.invoke(&call).await,
            };
            let e = match reply {
                Err(e) if Instant::now() + pause < give_up && is_resendable(&e) => e,
                reply => return reply,
            };
            debug!(error = %e.kind_name(), "release: not run, or no reply; trying again");
            if !is_refused_for_now(&e) {
                unsure = Some(e);
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }

    /// Runs `script` on the fenced-resource key of `resource` with `token`.
    pub(crate) async fn run_script<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        script: &'static Lua,
        resource: &str,
        token: u64,
    ) -> Result<T, LockError> {
        let call = Call {
            script,
            keys: vec![crate::keys::fenced_resource_key(
                &self.calls.prefix,
                resource,
            )],
            args: vec![token.to_string().into()],
        };
        self.timed(operation, Effect::Write(operation), self.conn.invoke(&call))
            .await
    }

    /// Runs `script` on `keys` (all of one hash slot) with `args` sent as bytes, so a
    /// caller's value reaches the script unchanged. A script that [runs once] is never
    /// sent again after a connection error.
    ///
    /// [runs once]: crate::scripts::Lua::runs_once
    pub(crate) async fn run_script_on<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        script: &'static Lua,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<T, LockError> {
        let call = Call {
            script,
            keys: keys.to_vec(),
            args: args.iter().map(|a| a.to_vec()).collect(),
        };
        self.timed(operation, Effect::Write(operation), self.conn.invoke(&call))
            .await
    }

    /// Runs a command that only reads (routed by its first key in a cluster).
    pub(crate) async fn read_command<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T, LockError> {
        self.timed(operation, Effect::None, self.conn.command(cmd))
            .await
    }

    pub(crate) fn lease(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: u64,
        ttl: Duration,
        sent: Instant,
    ) -> Lease {
        Lease::new(
            self.id,
            key.clone(),
            owner,
            FencingToken(token),
            ttl,
            valid_until(sent, ttl),
        )
    }

    /// Runs a batch under [`Self::timed_within`]. In a cluster each node's pipeline has the
    /// request timeout of its own (a silent node makes only its items unreachable), so
    /// the whole batch gets twice that, room for the redirected calls sent again after.
    pub(crate) async fn timed_batch(
        &self,
        operation: &'static str,
        calls: &[Call],
    ) -> Result<Vec<redis::RedisResult<Value>>, LockError> {
        let node_timeout = self.request_timeout;
        let limit = if self.cluster {
            node_timeout * 2
        } else {
            node_timeout
        };
        let request = self.conn.batch(calls, node_timeout);
        self.timed_within(limit, operation, Effect::Write(operation), request)
            .await
    }

    /// An acquire batch: one [`ACQUIRE_MANY_SCRIPT`] call per group, one reply per attempt
    /// (in the order of `attempts`). The outer error means nothing is known of any attempt.
    pub(crate) async fn send_acquires(
        &self,
        operation: &'static str,
        attempts: &[(LockKeys, OwnerId, Duration)],
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let (groups, calls) = self.calls.acquire_calls(attempts);
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, attempts.len()))
    }

    /// `acquire_many` without replica acknowledgements. On one node each multi-key call
    /// (at most [`calls::CHUNK`] keys) goes out as soon as it is built, so the server runs
    /// one call while the client builds the next and reads the replies of the one before
    /// (built whole and sent as one pipeline, a batch of 1,000 kept the server idle while
    /// the client built it); in a cluster, one pipeline per node. In a cluster, the keys of
    /// a node that did not answer while another did are `None` (what their attempts may
    /// have taken is given back in the background); any other failure fails the batch,
    /// and the keys it took are released. A call that failed after it may have run (its
    /// reply lost, or an error that stopped its script part way, such as a key of another
    /// type or one the user may not write) has its attempts given back by owner id: a
    /// script stopped part way keeps what it wrote before the error.
    pub(crate) async fn acquire_batch(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let sent = Instant::now();
        let parts: Vec<AcquirePart<'_>> = if self.calls.slotted {
            vec![self.acquire_part(keys, ttl).await]
        } else {
            keys.chunks(calls::CHUNK)
                .map(|part| self.acquire_part(part, ttl))
                .collect::<FuturesOrdered<_>>()
                .collect()
                .await
        };
        let mut failure = None;
        let mut unknown = Vec::new();
        // Each attempt with its reply; `None` for the attempts of a part nothing is known
        // of (given back when their reply may have been lost).
        let mut replied = Vec::with_capacity(keys.len());
        for (mut pending, replies) in parts {
            // Settled here: from now on nothing waits before the leases are returned,
            // except a failed batch's release, which has a guard of its own.
            let attempts = std::mem::take(&mut pending.attempts);
            match replies {
                Ok(replies) => replied.extend(attempts.into_iter().zip(replies).map(Some)),
                Err(e) => {
                    replied.extend(attempts.iter().map(|_| None));
                    if may_have_written(&e) {
                        unknown.extend(attempts);
                    }
                    failure.get_or_insert(e);
                }
            }
        }
        let mut out = Vec::with_capacity(keys.len());
        let mut unreachable = None;
        let mut answered = 0usize;
        for (key, replied) in keys.iter().zip(replied) {
            let Some(((lock_keys, owner), reply)) = replied else {
                out.push(None);
                continue;
            };
            let reply = match reply {
                // A cluster node that did not answer: its keys are `None`, and whatever an
                // attempt that reached it may have taken is given back in the background.
                Err(e) if self.cluster && is_unreachable(&e) => {
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
                    if may_have_written(&e) {
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
        if !unknown.is_empty() {
            self.abandon(unknown, ttl);
        }
        if let Some(e) = failure {
            // A failed batch holds nothing: give back what it took, in the background if
            // this future is dropped before the release returns.
            let taken: Vec<Lease> = out.into_iter().flatten().collect();
            let given_back = taken
                .iter()
                .map(|lease| (self.calls.keys(lease.key()), lease.owner()))
                .collect();
            let mut pending = AbandonOnDrop::new(self, given_back, ttl);
            let _ = self.release_leases(&taken).await;
            pending.settled();
            return Err(e);
        }
        Ok(out)
    }

    /// One part of an acquire batch: an attempt with a new owner id for each of `keys`,
    /// sent as [`Self::send_acquires`] sends them, and held by a guard that gives them
    /// back in the background if it is dropped before the batch settles them (the batch's
    /// future dropped while this part, or another, is on its way).
    async fn acquire_part(&self, keys: &[LockKey], ttl: Duration) -> AcquirePart<'_> {
        let with_ttl: Vec<(LockKeys, OwnerId, Duration)> = keys
            .iter()
            .map(|k| (self.acquire_keys(k), OwnerId::random(), ttl))
            .collect();
        let (groups, calls) = self.calls.acquire_calls(&with_ttl);
        let attempts = with_ttl.into_iter().map(|(k, o, _)| (k, o)).collect();
        let pending = AbandonOnDrop::new(self, attempts, ttl);
        let replies = self
            .timed_batch("acquire_many", &calls)
            .await
            .map(|replies| spread(&groups, replies, pending.attempts.len()));
        (pending, replies)
    }

    /// A renew or release batch: one multi-key call per group, one reply per lease.
    pub(crate) async fn send_lease_batch(
        &self,
        operation: &'static str,
        script: &'static Lua,
        leases: &[&Lease],
        extra: Extra,
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let (groups, calls) = self.calls.lease_calls(script, leases, extra);
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, leases.len()))
    }

    /// Settles the releases of a batch that failed for a reason a single release is sent
    /// again after (see [`Self::release_until_settled`]), one by one: a connection that
    /// dropped, or a node that refused for now.
    pub(crate) async fn settle_releases(
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

    /// An acquire followed by `WAIT` in the same round trip: `None` when the key is held,
    /// otherwise the grant with the number of replicas that acknowledged it, still
    /// pending (see [`Acked`]). Whatever it took is given back in the background when its
    /// future is dropped before it returns, and when it fails after taking the key.
    pub(crate) async fn acquire_acked(
        &self,
        key: &LockKey,
        ttl: Duration,
        replicas: usize,
        wait: Duration,
    ) -> Result<Option<Acked<'_>>, LockError> {
        let Some(pool) = &self.acked else {
            return Err(LockError::backend(NAME, "no connections for replica_acks"));
        };
        // Nothing is sent yet: no connection free within the request timeout is a plain
        // failure.
        let acked = self.timed("acquire", Effect::None, pool.take()).await?;
        let keys = self.acquire_keys(key);
        let owner = OwnerId::random();
        let call = self.calls.acquire_call(&keys, owner, ttl);
        let mut wait_cmd = redis::cmd("WAIT");
        wait_cmd.arg(replicas).arg(wait.as_millis().to_string());
        let conn = acked.conn().clone();
        let mut pending = AbandonOnDrop::new(self, vec![(keys, owner)], ttl);
        pending.over = Some(acked);
        let sent = Instant::now();
        let replies = self
            .timed(
                "acquire",
                Effect::Write("acquire"),
                conn.invoke_with(&call, &[wait_cmd]),
            )
            .await;
        let mut replies = match replies {
            Ok(r) => r.into_iter(),
            Err(e) => {
                // The connection is dropped with `pending` (after the cleanup, if any):
                // a request of it may still be pending.
                if !matches!(e, LockError::OutcomeUnknown { .. }) {
                    pending.attempts.clear();
                }
                return Err(e);
            }
        };
        // Every reply came back: the connection can serve the next acquire.
        if let Some(acked) = pending.over.take() {
            acked.put_back();
        }
        // The script's own error, or no grant: nothing was taken.
        let Some(token) = parse_token(replies.next()).inspect_err(|_| pending.attempts.clear())?
        else {
            pending.attempts.clear();
            return Ok(None);
        };
        let acked: i64 = match replies.next().map(Value::extract_error) {
            Some(Ok(v)) => redis::from_redis_value(v).map_err(|e| LockError::backend(NAME, e))?,
            Some(Err(e)) => return Err(map_error("acquire", Effect::Write("acquire"), &e)),
            None => 0,
        };
        let lease = self.lease(key, owner, token, ttl, sent);
        Ok(Some(Acked {
            lease,
            replicas: acked,
            pending,
        }))
    }

    /// `renew`'s one script.
    pub(crate) async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        let call = self.calls.lease_call(&RENEW_SCRIPT, lease, Extra::Ttl);
        let sent = Instant::now();
        let renewed: i64 = self
            .timed("renew", Effect::Write("renew"), self.conn.invoke(&call))
            .await?;
        Ok(renewal(renewed, sent, lease.ttl()))
    }

    /// `fence`'s one script.
    pub(crate) async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        let call = self.calls.lease_call(&FENCE_SCRIPT, lease, Extra::Token);
        let (current, newest): (i64, u64) = self
            .timed("fence", Effect::None, self.conn.invoke(&call))
            .await?;
        Ok(if current == 1 {
            Fence::Current
        } else {
            Fence::Stale {
                current: FencingToken(newest),
            }
        })
    }

    /// The holder, its token and what is left of its TTL, from the lock key (`GET` and
    /// `PTTL` in one pipeline).
    pub(crate) async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let keys = self.calls.keys(key);
        let mut pipe = redis::pipe();
        pipe.get(&keys.lock).pttl(&keys.lock);
        let (held, pttl): (Option<String>, i64) = self
            .timed("inspect", Effect::None, self.conn.pipeline(&pipe))
            .await?;
        let (owner, token) = held.as_deref().and_then(parse_held).unzip();
        Ok(LockInfo {
            owner,
            token,
            remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
        })
    }

    /// Deletes the lock key with one `DEL`, whoever holds it.
    pub(crate) async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let keys = self.calls.keys(key);
        let mut del = redis::cmd("DEL");
        del.arg(&keys.lock);
        // A permit slot's semaphore index goes with it (same hash tag, one DEL): the next
        // attempt rebuilds what it needs from the slot keys.
        if let Some(index) = crate::permits::index_keys(&self.calls.prefix, key) {
            del.arg(&index);
        }
        let _deleted: i64 = self
            .timed("purge", Effect::Write("purge"), self.conn.command(&del))
            .await?;
        Ok(())
    }

    /// A renew batch (see [`crate::RedisBackend`]'s `renew_many`).
    pub(crate) async fn renew_leases(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let sent = Instant::now();
        let all: Vec<&Lease> = leases.iter().collect();
        let replies = self
            .send_lease_batch("renew_many", &RENEW_MANY_SCRIPT, &all, Extra::Ttl)
            .await?;
        Ok(lease_outcomes(self.cluster, "renew_many", replies)?
            .into_iter()
            .zip(leases)
            .map(|(outcome, lease)| match outcome {
                Some(n) => renewal(n, sent, lease.ttl()),
                None => Renewal::Unreachable,
            })
            .collect())
    }

    /// A release batch (see [`crate::RedisBackend`]'s `release_many`).
    pub(crate) async fn release_leases(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let all: Vec<&Lease> = leases.iter().collect();
        let mut replies = self
            .send_lease_batch("release_many", &RELEASE_MANY_SCRIPT, &all, Extra::Release)
            .await?;
        if self.cluster {
            // Items a node refused for now, or whose connection dropped, are settled one by
            // one, as a single release is: a restarted or failed-over node's connection is
            // often not ready for the batch that finds it gone.
            self.settle_releases(&mut replies, &all).await;
        }
        Ok(lease_outcomes(self.cluster, "release_many", replies)?
            .into_iter()
            .map(|outcome| outcome.map_or(Release::Unreachable, release))
            .collect())
    }
}

/// A part of an acquire batch: its attempts, held until the batch settles them, and their
/// replies in the same order (or the error that left nothing known of any of them).
type AcquirePart<'a> = (
    AbandonOnDrop<'a>,
    Result<Vec<RedisResult<Value>>, LockError>,
);
