//! [`RedisBackend`]: the [`LockBackend`] on one Redis node or a Redis Cluster: the type,
//! its single calls and the trait impl. The rest of it lives in the submodules: `connect`
//! (building one), `batch` (multi-key script calls per hash slot, one pipeline per node;
//! the batches of coalesced single calls among them), `coalesce` (the coalescer: single
//! calls that arrive while one is in flight go together as one batch), `reply` (what the
//! scripts' replies mean) and `replicas` (`WAIT` after each acquire, over connections of
//! their own).

mod batch;
mod coalesce;
mod connect;
mod replicas;
mod reply;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, DriverFailure, Effect, FailureKind, Fence, FencingToken, Lease,
    LockBackend, LockError, LockInfo, LockKey, OwnerId, Release, Renewal, valid_until,
};
use futures::FutureExt;
use redis::RedisError;
use tokio::time::Instant;
use tracing::debug;

use self::batch::Acquire;
use self::coalesce::Coalescer;
use self::reply::{release, renewal};
use crate::config::RedisBackendBuilder;
use crate::conn::{Call, Conn, key_slot};
use crate::error::{KindName, is_refused_for_now, is_resendable, is_unreachable, map_error};
use crate::keys::{LockKeys, Mark, parse_held};
use crate::releases::ReleaseListener;
use crate::scripts::{
    ABANDON_SCRIPT, ACQUIRE_ANY_SCRIPT, ACQUIRE_SCRIPT, FENCE_SCRIPT, Lua, RELEASE_MANY_SCRIPT,
    RELEASE_SCRIPT, RENEW_MANY_SCRIPT, RENEW_SCRIPT,
};

pub use self::replicas::ACKED_CONNECTIONS;

pub(crate) const NAME: &str = "redis";

/// The first pause before a release that did not run is sent again; it doubles each time.
const RESEND_PAUSE: Duration = Duration::from_millis(5);

/// How many response timeouts the cleanup after an acquire with an unknown outcome may
/// take in all (see [`RedisBackend::abandon`]).
const CLEANUP_TIMEOUTS: u32 = 2;

/// The longest TTL a [`RedisBackend`] accepts, whatever
/// [`max_ttl`](RedisBackendBuilder::max_ttl) says: Redis keeps an expiry as a signed 64-bit
/// count of milliseconds since 1970, so `PX` must leave room for the current time.
/// 2^62 ms (about 146 million years) leaves plenty; a longer `max_ttl` fails `build` with
/// [`LockError::Config`].
pub const LONGEST_TTL: Duration = Duration::from_millis(1 << 62);

/// How many single calls (or batches of them) of one kind (`acquire`, `release`) a
/// backend on a single node has on their way at once; calls that come while that many
/// are in flight wait for one of them to return and go together as one multi-key script
/// call (docs/DESIGN.md has the measurements behind 4).
pub const SENT_AT_ONCE: usize = 4;

/// The Redis lock backend: one script (one round trip) per operation, one pipeline per
/// node for batches, on a single node or a Redis Cluster.
///
/// Batches send one multi-key script call per hash slot (per node on a single node), of
/// at most 128 locks each. On a single node, concurrent `acquire` (and `release`) calls
/// coalesce into such calls, without a timer (at most [`SENT_AT_ONCE`] of a kind on their
/// way; the crate docs say how); in a cluster single calls are sent one by one (calls on
/// different slots could not share a script anyway).
///
/// Keys: `<prefix>:{<name>}` holds `<owner id>:<token>` with the lease's TTL, and
/// nothing of it is kept once it is released or expired. A token is one more than the
/// highest granted on the server (on a Cluster, in the key's hash slot), kept in a
/// high-water key that never expires, or the server's clock in µs when that is higher:
/// state first, the clock only as a floor. So tokens keep increasing when the server's
/// clock steps back, and, when the state is lost or behind (a restart with or without
/// persistence, `FLUSHALL`, a failover to a replica that missed the last grants), as long
/// as the clock of the server that grants next has moved past what was lost
/// (docs/DESIGN.md has the argument, and what two faults at once can do).
///
/// Cheap to clone: clones share the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::LockError> {
/// use std::time::Duration;
/// use distlock::{LockBackend, LockKey};
/// let redis = distlock::redis::RedisBackend::builder()
///     .url("redis://127.0.0.1:6379/")
///     .build()
///     .await?;
/// let lease = redis.acquire(&LockKey::new("job:42")?, Duration::from_secs(30)).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    prefix: String,
    caps: Capabilities,
    response_timeout: Duration,
    replica_acks: Option<(usize, Duration)>,
    /// The connections acquires with `WAIT` go over (with `replica_acks` only).
    acked: Option<Arc<replicas::AckedConns>>,
    id: BackendId,
    /// The URLs with passwords hidden, for `Debug`.
    shown_urls: Vec<String>,
    cluster: bool,
    /// Hash slots divide the keys: a cluster, or a single node that runs in cluster mode
    /// (`redis_mode:cluster`; it answers for the keys of its slots and refuses a script
    /// whose keys span slots). Batches are then grouped by slot, and tokens counted per
    /// slot (see [`RedisBackend::high_water`]).
    slotted: bool,
    /// Releases are announced with `SPUBLISH` (a cluster of Redis 7.0 or newer), not
    /// `PUBLISH`.
    sharded: bool,
    /// The server lets this user announce releases (see `releases::announcements_refused`).
    announces: bool,
    /// Single acquires, coalesced (single node only).
    acquires: Coalescer<Acquire, Option<Lease>>,
    /// Single releases, coalesced (single node only).
    releases: Coalescer<Lease, Release>,
    /// Hears the releases of the keys this instance's waiters watch.
    listener: ReleaseListener,
}

/// An acquire on its way: if its future is dropped before the reply, whatever it may have
/// taken is given back in the background (checked against its owner id). One attempt,
/// or one per key an `acquire_any` may have taken.
struct AbandonOnDrop<'a> {
    backend: &'a RedisBackend,
    attempts: Vec<(LockKeys, OwnerId)>,
    ttl: Duration,
    /// The connection of its own the attempt went over, if any: the cleanup goes over it
    /// too, so that it runs after the attempt.
    over: Option<replicas::AckedConn>,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if !self.attempts.is_empty() {
            let attempts = std::mem::take(&mut self.attempts);
            self.backend
                .abandon_over(self.over.take(), attempts, self.ttl);
        }
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("urls", &self.inner.shown_urls)
            .field("cluster", &self.inner.cluster)
            .field("prefix", &self.inner.prefix)
            .field("response_timeout", &self.inner.response_timeout)
            .finish_non_exhaustive()
    }
}

impl RedisBackend {
    /// Options for a new backend; see [`RedisBackendBuilder`].
    pub fn builder() -> RedisBackendBuilder {
        RedisBackendBuilder::default()
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key of `key`, `<prefix>:{<name>}`, which holds `<owner id>:<token>`
    /// while the lock is held; it is also the channel its releases are announced on.
    pub fn redis_key(&self, key: &LockKey) -> String {
        LockKeys::new(&self.inner.prefix, key).lock
    }

    fn keys(&self, key: &LockKey) -> LockKeys {
        LockKeys::new(&self.inner.prefix, key)
    }

    /// The high-water key that `lock` shares with the other locks of its hash slot (on a
    /// Cluster) or of the server, which the acquire and fence scripts read (see
    /// `acquire.lua`).
    pub(super) fn high_water(&self, lock: &str) -> String {
        crate::keys::high_water_key(
            &self.inner.prefix,
            self.inner.slotted.then(|| key_slot(lock.as_bytes())),
        )
    }

    /// [`Self::keys`] for an acquire, marked as [`Self::mark`] says.
    fn acquire_keys(&self, key: &LockKey) -> LockKeys {
        LockKeys {
            mark: self.mark(std::slice::from_ref(key)),
            ..self.keys(key)
        }
    }

    /// How an acquire of one of `keys` marks it waited for (see `acquire.lua`): never when
    /// this backend hears no release (wake-ups off, or its listener refused), granted
    /// marked when other waiters of this process watch one of them, and otherwise marked
    /// only if held.
    fn mark(&self, keys: &[LockKey]) -> Mark {
        let listener = &self.inner.listener;
        if !listener.hears_releases() {
            Mark::Never
        } else if keys.iter().any(|k| listener.others_wait(k)) {
            Mark::Granted
        } else {
            Mark::WhenHeld
        }
    }

    /// Waits for a reply at most the response timeout. No reply in time means the request
    /// may have run: `OutcomeUnknown` for an operation that changes state.
    ///
    /// Not an `async fn`, nor an `async` block: either would keep `request` twice in its
    /// state (as it came and inside the timeout), doubling the size of every call's future.
    fn timed<T>(
        &self,
        operation: &'static str,
        effect: Effect,
        request: impl Future<Output = Result<T, RedisError>>,
    ) -> impl Future<Output = Result<T, LockError>> {
        self.timed_within(self.inner.response_timeout, operation, effect, request)
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
    /// expire on their own anyway. Bounded: each try waits at most the response timeout,
    /// a try whose connection dropped is made again, and so are the keys a server refused
    /// for now (a replica, a dataset loading, a busy script); the cleanup gives up after
    /// [`CLEANUP_TIMEOUTS`] response timeouts (or the TTL, if shorter), so a hung server
    /// does not keep a task per attempt alive for the lease's TTL.
    fn abandon(&self, attempts: Vec<(LockKeys, OwnerId)>, ttl: Duration) {
        self.abandon_over(None, attempts, ttl);
    }

    /// [`Self::abandon`] over `over`, the connection the attempts went over, when it is not
    /// the shared one.
    fn abandon_over(
        &self,
        over: Option<replicas::AckedConn>,
        attempts: Vec<(LockKeys, OwnerId)>,
        ttl: Duration,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let conn = over
            .as_ref()
            .map_or_else(|| self.inner.conn.clone(), |c| c.conn().clone());
        let node_timeout = self.inner.response_timeout;
        let announce = self.announce_arg();
        runtime.spawn(async move {
            // Kept until the cleanup is done: it is not handed to another call meanwhile.
            let _over = over;
            let mut calls: Vec<Call> = attempts
                .into_iter()
                .map(|(keys, owner)| Call {
                    script: &ABANDON_SCRIPT,
                    keys: vec![keys.lock],
                    args: [Some(owner.to_string().into()), announce.clone()]
                        .into_iter()
                        .flatten()
                        .collect(),
                })
                .collect();
            let keys = calls.len();
            // Requests on the same connection run in order, so this runs after the
            // acquire if that ever reached the server. A hung server gets one try: the
            // cleanup must not outlive its caller by more than a few response timeouts.
            let give_up = Instant::now() + ttl.min(node_timeout * CLEANUP_TIMEOUTS);
            let mut pause = RESEND_PAUSE;
            let done = loop {
                let left = give_up.saturating_duration_since(Instant::now());
                let reply =
                    tokio::time::timeout(left.min(node_timeout), conn.batch(&calls, node_timeout))
                        .await;
                let again = match reply {
                    // The items that did not run (refused for now: a replica, a dataset
                    // loading, a busy script; or their connection dropped) are sent again.
                    Ok(Ok(replies)) => {
                        calls = calls
                            .into_iter()
                            .zip(replies)
                            .filter_map(|(call, reply)| {
                                matches!(&reply, Err(e) if is_resendable(e)).then_some(call)
                            })
                            .collect();
                        if calls.is_empty() {
                            break true;
                        }
                        true
                    }
                    // A connection that dropped: the one made again may serve the next try.
                    Ok(Err(e)) => is_resendable(&e),
                    Err(_) => false,
                };
                if !again || Instant::now() + pause >= give_up {
                    break false;
                }
                tokio::time::sleep(pause).await;
                pause *= 2;
            };
            tracing::debug!(
                keys,
                done,
                "cleanup after an acquire with an unknown outcome"
            );
        });
    }

    fn acquire_call(&self, keys: &LockKeys, owner: OwnerId, ttl: Duration) -> Call {
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

    /// A renew, release or fence call: the lock key (and for a fence the high-water key it
    /// shares), the value the lease holds it with, and `extra` (see [`Extra`]).
    fn lease_call(&self, script: &'static Lua, lease: &Lease, extra: Extra) -> Call {
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

    /// The last argument of the release and abandon scripts: `S` makes them announce with
    /// `SPUBLISH`, on the key's shard only, and `-` not at all (the server refuses this
    /// user's announcements: each would be an `ACL LOG` entry); without it they `PUBLISH`.
    pub(super) fn announce_arg(&self) -> Option<Vec<u8>> {
        if !self.inner.announces {
            return Some(b"-".to_vec());
        }
        self.inner.sharded.then(|| b"S".to_vec())
    }

    /// One acquire sent directly, with the single-key script.
    async fn acquire_one(
        &self,
        key: &LockKey,
        ttl: Duration,
        called: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let keys = self.acquire_keys(key);
        let owner = OwnerId::random();
        let call = self.acquire_call(&keys, owner, ttl);
        let mut pending = AbandonOnDrop {
            backend: self,
            attempts: vec![(keys, owner)],
            ttl,
            over: None,
        };
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

    /// One free key of `keys` (two or more) with one script on a single node; see
    /// [`LockBackend::acquire_any`].
    async fn acquire_any_one(
        &self,
        keys: &[LockKey],
        ttl: Duration,
        called: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let owner = OwnerId::random();
        let locks: Vec<LockKeys> = keys.iter().map(|k| self.keys(k)).collect();
        // A semaphore's waiters watch every slot.
        let mark = self.mark(keys);
        let call = Call {
            script: &ACQUIRE_ANY_SCRIPT,
            // On a single node: one high-water key for all.
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
        };
        let mut pending = AbandonOnDrop {
            backend: self,
            attempts: locks.into_iter().map(|k| (k, owner)).collect(),
            ttl,
            over: None,
        };
        // Sent again after a dropped connection, with the flag that makes the script look
        // for the slot this attempt took first (see `acquire_any.lua`).
        let reply = self
            .timed("acquire", Effect::Write("acquire"), async {
                match self.inner.conn.invoke::<Option<(usize, u64)>>(&call).await {
                    Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                        debug!(error = %e.kind_name(), "acquire_any: connection lost; sending it again");
                        let mut again = call.clone();
                        again.args.push(b"R".to_vec());
                        let reply =
                            Box::pin(self.inner.conn.invoke::<Option<(usize, u64)>>(&again)).await;
                        resent(e, reply)
                    }
                    reply => reply,
                }
            })
            .await;
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

    /// Sends an acquire script's `call` on the shared connection. A single node's
    /// connection that dropped is sent the same call once more, on the connection it makes
    /// again: the acquire scripts answer a resent attempt with the grant it already made,
    /// so the call cannot take a key twice, and a restart or a network blip costs one
    /// round trip instead of an unknown outcome. (A cluster connection resends on its own.)
    async fn invoke_resending<T: redis::FromRedisValue>(
        &self,
        call: &Call,
    ) -> Result<T, RedisError> {
        match self.inner.conn.invoke::<T>(call).await {
            Err(e) if !self.inner.cluster && (e.is_connection_dropped() || e.is_io_error()) => {
                debug!(error = %e.kind_name(), "acquire: connection lost; sending it again");
                // Boxed: a rare path should not double the size of every call.
                let reply = Box::pin(self.inner.conn.invoke::<T>(call)).await;
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
    /// Both are tried again after a short pause, for half the response timeout at most:
    /// a connection made again after a restart or a failover is not always ready for the
    /// very next request.
    async fn release_one(&self, lease: &Lease) -> Result<Release, LockError> {
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
    async fn release_until_settled(
        &self,
        lease: &Lease,
        failed: Option<RedisError>,
    ) -> redis::RedisResult<i64> {
        let call = self.lease_call(&RELEASE_SCRIPT, lease, Extra::Release);
        let give_up = Instant::now() + self.inner.response_timeout / 2;
        let mut pause = RESEND_PAUSE;
        // The error of the last send when it may have run: ask before sending again.
        let mut unsure: Option<RedisError> = None;
        let mut failed = failed;
        loop {
            if let Some(e) = &unsure {
                // Boxed: a rare path should not double the size of every release.
                let fence_call = self.lease_call(&FENCE_SCRIPT, lease, Extra::Token);
                match Box::pin(self.inner.conn.invoke::<(i64, u64)>(&fence_call)).await {
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
                None => self.inner.conn.invoke(&call).await,
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
                &self.inner.prefix,
                resource,
            )],
            args: vec![token.to_string().into()],
        };
        self.timed(
            operation,
            Effect::Write(operation),
            self.inner.conn.invoke(&call),
        )
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
        self.timed(
            operation,
            Effect::Write(operation),
            self.inner.conn.invoke(&call),
        )
        .await
    }

    /// Runs a command that only reads (routed by its first key in a cluster).
    pub(crate) async fn read_command<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T, LockError> {
        self.timed(operation, Effect::None, self.inner.conn.command(cmd))
            .await
    }

    fn lease(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: u64,
        ttl: Duration,
        sent: Instant,
    ) -> Lease {
        Lease::new(
            self.inner.id,
            key.clone(),
            owner,
            FencingToken(token),
            ttl,
            valid_until(sent, ttl),
        )
    }
}

#[async_trait]
impl LockBackend for RedisBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps.clone()
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.inner.caps.check_ttl(ttl)?;
        if let Some((replicas, wait)) = self.inner.replica_acks {
            return self.acquire_with_replicas(key, ttl, replicas, wait).await;
        }
        let called = Instant::now();
        if self.inner.cluster {
            return self.acquire_one(key, ttl, called).await;
        }
        let batched = || Acquire {
            key: key.clone(),
            ttl,
            called,
        };
        self.inner
            .acquires
            .run(self, batched, || self.acquire_one(key, ttl, called))
            .await
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        let call = self.lease_call(&RENEW_SCRIPT, lease, Extra::Ttl);
        let sent = Instant::now();
        let renewed: i64 = self
            .timed(
                "renew",
                Effect::Write("renew"),
                self.inner.conn.invoke(&call),
            )
            .await?;
        Ok(renewal(renewed, sent, lease.ttl()))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        if self.inner.cluster {
            return self.release_one(lease).await;
        }
        self.inner
            .releases
            .run(self, || lease.clone(), || self.release_one(lease))
            .await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        let call = self.lease_call(&FENCE_SCRIPT, lease, Extra::Token);
        let (current, newest): (i64, u64) = self
            .timed("fence", Effect::None, self.inner.conn.invoke(&call))
            .await?;
        Ok(if current == 1 {
            Fence::Current
        } else {
            Fence::Stale {
                current: FencingToken(newest),
            }
        })
    }

    /// The holder, its token and what is left of its TTL, from the lock key. A free key
    /// has no token: nothing of the key is kept after a release or an expiry (the next
    /// grant's token is above the high-water key its hash slot shares).
    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let keys = self.keys(key);
        let mut pipe = redis::pipe();
        pipe.get(&keys.lock).pttl(&keys.lock);
        let (held, pttl): (Option<String>, i64) = self
            .timed("inspect", Effect::None, self.inner.conn.pipeline(&pipe))
            .await?;
        let (owner, token) = held.as_deref().and_then(parse_held).unzip();
        Ok(LockInfo {
            owner,
            token,
            remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
        })
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.inner.listener.watch(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.listener.watched_keys()
    }

    /// A lease of this instance for `owner` and `token`, for tools that act on a lock held
    /// by another process. Nothing is sent: renew, release and fence check owner and token
    /// in their scripts, so a wrong pair is [`Renewal::Lost`] / [`Release::NotHeld`] /
    /// [`Fence::Stale`] and changes nothing. Its `valid_until` is now: this process never
    /// saw the grant, so it cannot claim any validity before a renewal.
    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        self.inner.caps.check_ttl(ttl)?;
        Ok(Lease::adopted(
            self.inner.id,
            key.clone(),
            owner,
            token,
            ttl,
        ))
    }

    /// Deletes the lock key with one `DEL`, whoever holds it. The next grant's token is
    /// still above the purged one: a `DEL` and a new grant take longer than a microsecond.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let keys = self.keys(key);
        let mut del = redis::cmd("DEL");
        del.arg(&keys.lock);
        let _deleted: i64 = self
            .timed(
                "purge",
                Effect::Write("purge"),
                self.inner.conn.command(&del),
            )
            .await?;
        Ok(())
    }

    /// One script over every key on a single node (`acquire_any.lua`): one round trip
    /// however many of them are held. On a cluster the names live in hash slots of their
    /// own, and with [`replica_acks`](crate::RedisBackendBuilder::replica_acks) each grant
    /// waits for its replicas: there it asks key by key, as the trait's default does.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.inner.caps.check_ttl(ttl)?;
        if keys.len() > 1 && !self.inner.cluster && self.inner.replica_acks.is_none() {
            // Sent directly: a coalesced batch takes one key per caller.
            return self.acquire_any_one(keys, ttl, Instant::now()).await;
        }
        for key in keys {
            if let Some(lease) = self.acquire(key, ttl).await? {
                return Ok(Some(lease));
            }
        }
        Ok(None)
    }

    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.inner.caps.check_ttl(ttl)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.inner.replica_acks.is_some() {
            return self.acquire_many_with_replicas(keys, ttl).await;
        }
        self.acquire_batch(keys, ttl).await
    }

    /// One pipeline per node, of one multi-key script call per hash slot (all leases on a
    /// single node), 128 leases at most per call. In a cluster, a lease whose node did not
    /// answer while another node did is [`Renewal::Unreachable`] (the watchdog retries it until its
    /// `valid_until`); when no node answers, the whole call fails, as the single form does.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        for lease in leases {
            lease.check_backend(self.inner.id, NAME)?;
        }
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let sent = Instant::now();
        let all: Vec<&Lease> = leases.iter().collect();
        let replies = self
            .send_lease_batch("renew_many", &RENEW_MANY_SCRIPT, &all, Extra::Ttl)
            .await?;
        Ok(self
            .lease_outcomes("renew_many", replies)?
            .into_iter()
            .zip(leases)
            .map(|(outcome, lease)| match outcome {
                Some(n) => renewal(n, sent, lease.ttl()),
                None => Renewal::Unreachable,
            })
            .collect())
    }

    /// One pipeline per node, of one multi-key script call per hash slot (all leases on a
    /// single node), 128 leases at most per call. In a cluster, a lease whose node did not
    /// answer while another node did is [`Release::Unreachable`] (it frees itself when its TTL runs
    /// out); when no node answers, the whole call fails, as the single form does.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        for lease in leases {
            lease.check_backend(self.inner.id, NAME)?;
        }
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let all: Vec<&Lease> = leases.iter().collect();
        let mut replies = self
            .send_lease_batch("release_many", &RELEASE_MANY_SCRIPT, &all, Extra::Release)
            .await?;
        if self.inner.cluster {
            // Items a node refused for now, or whose connection dropped, are settled one by
            // one, as a single release is: a restarted or failed-over node's connection is
            // often not ready for the batch that finds it gone.
            self.settle_releases(&mut replies, &all).await;
        }
        Ok(self
            .lease_outcomes("release_many", replies)?
            .into_iter()
            .map(|outcome| outcome.map_or(Release::Unreachable, release))
            .collect())
    }
}

/// What a lease call sends besides the value the lease holds its key with.
#[derive(Clone, Copy)]
pub(super) enum Extra {
    /// The lease's TTL in milliseconds (renewals).
    Ttl,
    /// The lease's token, and the high-water key as a second key (fence checks).
    Token,
    /// Nothing per lease, and after the leases the announcing command
    /// ([`RedisBackend::announce_arg`]): releases.
    Release,
}

/// `<owner id>:<token>`, what the lock key holds while `lease` holds it, and the argument
/// `extra` adds after it, if any.
pub(super) fn lease_args(lease: &Lease, extra: Extra) -> (String, Option<String>) {
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
fn resent<T>(first: RedisError, again: redis::RedisResult<T>) -> redis::RedisResult<T> {
    again.map_err(|e| {
        debug!(error = %e.kind_name(), "the acquire sent again failed too; its outcome is unknown");
        first
    })
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
