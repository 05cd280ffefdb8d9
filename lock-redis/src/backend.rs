//! [`RedisBackend`]: the [`LockBackend`] on one Redis node or a Redis Cluster.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_api::wake::ReleaseWatch;
use lock_api::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal, valid_until,
};
use parking_lot::Mutex;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, Value};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::debug;

use crate::coalesce::Queue;
use crate::config::{RedisBackendBuilder, redact_url};
use crate::conn::{Call, ClusterState, Conn, key_slot, reply_error};
use crate::keys::LockKeys;
use crate::releases::ReleaseListener;
use crate::scripts::{
    ABANDON_SCRIPT, ACQUIRE_MANY_SCRIPT, ACQUIRE_SCRIPT, FENCE_SCRIPT, RELEASE_MANY_SCRIPT,
    RELEASE_SCRIPT, RENEW_MANY_SCRIPT, RENEW_SCRIPT,
};

pub(crate) const NAME: &str = "redis";

/// Most locks in one multi-key script call. A script runs atomically and holds the server
/// meanwhile, so a long batch is split into several calls (pipelined together).
const CHUNK: usize = 128;

/// The first pause before a release that did not run is sent again; it doubles each time.
const RESEND_PAUSE: Duration = Duration::from_millis(5);

/// The longest TTL a [`RedisBackend`] accepts, whatever
/// [`max_ttl`](RedisBackendBuilder::max_ttl) says: Redis keeps an expiry as a signed 64-bit
/// count of milliseconds since 1970, so `PX` must leave room for the current time.
/// 2^62 ms (about 146 million years) leaves plenty; a longer `max_ttl` fails `build` with
/// [`LockError::Config`].
pub const LONGEST_TTL: Duration = Duration::from_millis(1 << 62);

/// The Redis lock backend: one script (one round trip) per operation, one pipeline per
/// node for batches, on a single node or a Redis Cluster.
///
/// Batches send one multi-key script call per hash slot (per node on a single node), of
/// at most 128 locks each. On a single node, concurrent `acquire` (and `release`) calls
/// coalesce: while one is in flight, the ones that arrive meanwhile wait and then go
/// together as one multi-key call; a caller that finds nothing in flight sends at once.
/// In a cluster single calls are sent one by one (calls on different slots could not
/// share a script anyway).
///
/// Keys: `<prefix>:{<name>}` holds the owner id with the lease's TTL;
/// `<prefix>:{<name>}:fence` holds the newest token, kept for the fence retention
/// ([`RedisBackendBuilder::fence_retention`], default 24 h) from when it is made. A token
/// is the counter plus one, or the server's time in µs when the counter is new, expired or
/// was lost in a restart or failover, so tokens keep increasing across all of these (as
/// long as the server clock does not go back).
///
/// Cheap to clone: clones share the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), lock_api::LockError> {
/// use std::time::Duration;
/// use lock_api::{LockBackend, LockKey};
/// let redis = lock_redis::RedisBackend::builder()
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
    /// How long a new token counter is kept (at least the lease's TTL).
    fence_retention: Duration,
    id: BackendId,
    /// The URLs with passwords hidden, for `Debug`.
    shown_urls: Vec<String>,
    cluster: bool,
    /// Acquires waiting for the one in flight (single node only).
    acquires: Queue<PendingAcquire>,
    /// Releases waiting for the one in flight (single node only).
    releases: Queue<PendingRelease>,
    /// Hears the releases of the keys this instance's waiters watch.
    listener: ReleaseListener,
}

/// An acquire waiting in the coalescing queue, with the instant its caller called.
struct PendingAcquire {
    key: LockKey,
    ttl: Duration,
    called: Instant,
    /// The caller's runtime, where its batch runs (see [`RedisBackend::hand_off`]).
    runtime: Option<Handle>,
    reply: oneshot::Sender<Result<Option<Lease>, LockError>>,
}

/// A release waiting in the coalescing queue.
struct PendingRelease {
    lease: Lease,
    runtime: Option<Handle>,
    reply: oneshot::Sender<Result<Release, LockError>>,
}

/// The two kinds of coalesced calls.
#[derive(Clone, Copy)]
enum Kind {
    Acquire,
    Release,
}

/// Marks a call of `kind` in flight; when it is done (or its future is dropped), the calls
/// queued meanwhile are sent as the next batch.
struct InFlight {
    backend: RedisBackend,
    kind: Kind,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.backend.hand_off(self.kind);
    }
}

/// A single acquire on its way: if its future is dropped before the reply, whatever it
/// may have taken is given back in the background (checked against its owner id).
struct AbandonOnDrop<'a> {
    backend: &'a RedisBackend,
    attempt: Option<(LockKeys, OwnerId)>,
    ttl: Duration,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(attempt) = self.attempt.take() {
            self.backend.abandon(vec![attempt], self.ttl);
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

    pub(crate) async fn connect(b: RedisBackendBuilder) -> Result<Self, LockError> {
        let shown_urls: Vec<String> = b.urls.iter().map(|u| redact_url(u)).collect();
        if b.max_ttl > LONGEST_TTL {
            return Err(LockError::Config(format!(
                "max_ttl {:?} is longer than Redis can keep an expiry; at most {LONGEST_TTL:?}",
                b.max_ttl
            )));
        }
        if b.uses_tls() {
            crate::tls::ensure_crypto_provider();
        }
        let certificates = b.tls_root_ca.clone().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem),
        });
        let mut listen_on = Vec::new();
        let conn = if b.cluster {
            for (url, shown) in b.urls.iter().zip(&shown_urls) {
                if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
                    if info.redis_settings().db() != 0 {
                        return Err(LockError::Config(format!(
                            "{shown}: a Redis Cluster has only database 0"
                        )));
                    }
                }
            }
            let nodes = b
                .urls
                .iter()
                .map(|u| parse_url(u))
                .collect::<Result<Vec<_>, _>>()?;
            // A PUBLISH reaches every node of a cluster: release notifications can be
            // heard on any of them.
            for node in &nodes {
                listen_on.push(
                    match certificates.clone() {
                        Some(certificates) => {
                            redis::Client::build_with_tls(node.clone(), certificates)
                        }
                        None => redis::Client::open(node.clone()),
                    }
                    .map_err(|e| config_error(&shown_urls.join(","), &e))?,
                );
            }
            let shown = shown_urls.join(",");
            // Two connections: one that retries (reads, and scripts safe to run twice), one
            // that never sends a request again (see `Conn`).
            let c = cluster_connection(&b, nodes.clone(), certificates.clone(), 2, &shown).await?;
            let once = cluster_connection(&b, nodes, certificates, 0, &shown).await?;
            Conn::Cluster(
                c,
                Arc::new(ClusterState {
                    once,
                    slots: Mutex::new(None),
                }),
            )
        } else {
            let info = parse_url(&b.urls[0])?;
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates),
                None => redis::Client::open(info),
            }
            .map_err(|e| config_error(&shown_urls[0], &e))?;
            listen_on.push(client.clone());
            // The backend applies its own response timeout (to tell an unknown outcome
            // from an unreachable server); the manager only bounds connecting.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(b.connect_timeout))
                .set_response_timeout(None)
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let c = with_timeout(
                b.connect_timeout * 2,
                ConnectionManager::new_with_config(client, config),
            )
            .await
            .map_err(|e| connect_error(&shown_urls[0], e))?;
            Conn::Single(c)
        };
        // Connecting does not prove the credentials: a server with a password accepts the
        // connection and refuses the first command.
        let ping = redis::cmd("PING");
        let probe = match &conn {
            Conn::Single(c) => {
                with_timeout(b.connect_timeout, c.clone().req_packed_command(&ping)).await
            }
            Conn::Cluster(c, _) => {
                with_timeout(b.connect_timeout, c.clone().req_packed_command(&ping)).await
            }
        };
        probe
            .and_then(Value::extract_error)
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        let infos = with_timeout(b.connect_timeout, conn.server_infos())
            .await
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        for info in infos {
            crate::version::check(&info)
                .map_err(|m| LockError::Config(format!("{}: {m}", shown_urls.join(","))))?;
        }
        with_timeout(b.connect_timeout, conn.load_all())
            .await
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        let caps = Capabilities::new(Duration::from_millis(1), b.min_ttl, b.max_ttl)
            .native_batch(true)
            .server_side_ttl(true)
            .inspect(true)
            .wakes_waiters(true);
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                listener: ReleaseListener::new(listen_on, b.prefix.clone(), b.connect_timeout),
                prefix: b.prefix,
                caps,
                response_timeout: b.response_timeout,
                replica_acks: b.replica_acks,
                fence_retention: b.fence_retention,
                id: BackendId::next(),
                shown_urls,
                cluster: b.cluster,
                acquires: Queue::default(),
                releases: Queue::default(),
            }),
        })
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The two Redis keys of `key`: `(<prefix>:{<name>}, <prefix>:{<name>}:fence)`.
    pub fn redis_keys(&self, key: &LockKey) -> (String, String) {
        let k = LockKeys::new(&self.inner.prefix, key);
        (k.lock, k.fence)
    }

    fn keys(&self, key: &LockKey) -> LockKeys {
        LockKeys::new(&self.inner.prefix, key)
    }

    /// Waits for a reply at most the response timeout. No reply in time means the request
    /// may have run: `OutcomeUnknown` for an operation that changes state.
    async fn timed<T>(
        &self,
        operation: &'static str,
        changes_state: bool,
        request: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        match tokio::time::timeout(self.inner.response_timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map_error(operation, changes_state, &e)),
            Err(_) => {
                let message = format!("no reply within {:?}", self.inner.response_timeout);
                Err(if changes_state {
                    LockError::OutcomeUnknown {
                        backend: NAME,
                        operation,
                        message,
                    }
                } else {
                    LockError::unavailable(NAME, message)
                })
            }
        }
    }

    /// Runs a batch under [`Self::timed`]. In a cluster each node's pipeline has the
    /// response timeout of its own (a silent node makes only its items unreachable), so
    /// the whole batch gets twice that, room for the redirected calls sent again after.
    async fn timed_batch(
        &self,
        operation: &'static str,
        calls: &[Call],
    ) -> Result<Vec<redis::RedisResult<Value>>, LockError> {
        let node_timeout = self.inner.response_timeout;
        let request = self.inner.conn.batch(calls, node_timeout);
        if !self.inner.cluster {
            return self.timed(operation, true, request).await;
        }
        match tokio::time::timeout(node_timeout * 2, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map_error(operation, true, &e)),
            Err(_) => Err(LockError::OutcomeUnknown {
                backend: NAME,
                operation,
                message: format!("no reply within {:?}", node_timeout * 2),
            }),
        }
    }

    /// The per-lease replies of a renew or release batch: `Some(script result)`, or `None`
    /// for a lease whose cluster node did not answer while another node did. Any other
    /// per-lease error, or no node answering at all, fails the whole batch.
    fn lease_outcomes(
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
                Err(e) => return Err(map_error(operation, true, &e)),
            }
        }
        match unreachable {
            Some(e) if answered == 0 => Err(map_error(operation, true, &e)),
            _ => Ok(out),
        }
    }

    /// After an acquire whose outcome is unknown: deletes the keys the attempts may have
    /// taken, in the background, checked against their owner ids. Best effort: the keys
    /// expire on their own anyway.
    fn abandon(&self, attempts: Vec<(LockKeys, OwnerId)>, ttl: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let conn = self.inner.conn.clone();
        let node_timeout = self.inner.response_timeout;
        runtime.spawn(async move {
            let calls: Vec<Call> = attempts
                .into_iter()
                .map(|(keys, owner)| Call {
                    script: &ABANDON_SCRIPT,
                    keys: vec![keys.lock],
                    args: vec![owner.to_string()],
                })
                .collect();
            // Requests on the same connection run in order, so this runs after the
            // acquire if that ever reached the server.
            let outcome = tokio::time::timeout(ttl, conn.batch(&calls, node_timeout)).await;
            tracing::debug!(
                keys = calls.len(),
                done = matches!(outcome, Ok(Ok(_))),
                "cleanup after an acquire with an unknown outcome"
            );
        });
    }

    fn acquire_call(&self, keys: &LockKeys, owner: OwnerId, ttl: Duration) -> Call {
        Call {
            script: &ACQUIRE_SCRIPT,
            keys: vec![keys.lock.clone(), keys.fence.clone()],
            args: vec![
                owner.to_string(),
                ttl.as_millis().to_string(),
                self.retention_ms(ttl),
            ],
        }
    }

    /// How long a new token counter is kept, in milliseconds: the configured retention,
    /// never shorter than the lease it is made for.
    fn retention_ms(&self, ttl: Duration) -> String {
        self.inner.fence_retention.max(ttl).as_millis().to_string()
    }

    /// A release or renew call: the lock key and the owner id (with the TTL for a renew).
    fn owner_call(&self, script: &'static redis::Script, lease: &Lease, ttl: bool) -> Call {
        let mut args = vec![lease.owner().to_string()];
        if ttl {
            args.push(lease.ttl().as_millis().to_string());
        }
        Call {
            script,
            keys: vec![self.keys(lease.key()).lock],
            args,
        }
    }

    /// A fence call: both keys (the counter names the newest token of a stale lease).
    fn fence_call(&self, lease: &Lease) -> Call {
        let keys = self.keys(lease.key());
        Call {
            script: &FENCE_SCRIPT,
            keys: vec![keys.lock, keys.fence],
            args: vec![lease.owner().to_string(), lease.token().get().to_string()],
        }
    }

    /// The items of a batch (given by the slots of their keys) grouped into multi-key
    /// script calls: in a cluster a call's keys must share a hash slot; on one node any
    /// keys go together. At most [`CHUNK`] items per call.
    fn groups(&self, slots: impl Iterator<Item = u16>) -> Vec<Vec<usize>> {
        let mut by_slot: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (i, slot) in slots.enumerate() {
            let slot = if self.inner.cluster { slot } else { 0 };
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
    async fn send_acquires(
        &self,
        operation: &'static str,
        attempts: &[(LockKeys, OwnerId, Duration)],
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let groups = self.groups(attempts.iter().map(|(k, ..)| key_slot(k.lock.as_bytes())));
        let longest = attempts
            .iter()
            .map(|(.., ttl)| *ttl)
            .max()
            .unwrap_or_default();
        let retention = self.retention_ms(longest);
        let mut calls = grouped_calls(&ACQUIRE_MANY_SCRIPT, &groups, |i, keys, args| {
            let (k, owner, ttl) = &attempts[i];
            keys.extend([k.lock.clone(), k.fence.clone()]);
            args.extend([owner.to_string(), ttl.as_millis().to_string()]);
        });
        for call in &mut calls {
            call.args.push(retention.clone());
        }
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, attempts.len()))
    }

    /// A renew or release batch: one multi-key call per group, one reply per lease.
    async fn send_lease_batch(
        &self,
        operation: &'static str,
        script: &'static Script,
        leases: &[&Lease],
        with_ttl: bool,
    ) -> Result<Vec<RedisResult<Value>>, LockError> {
        let keys: Vec<LockKeys> = leases.iter().map(|l| self.keys(l.key())).collect();
        let groups = self.groups(keys.iter().map(|k| key_slot(k.lock.as_bytes())));
        let calls = grouped_calls(script, &groups, |i, call_keys, args| {
            let (k, lease) = (&keys[i], leases[i]);
            call_keys.push(k.lock.clone());
            args.push(lease.owner().to_string());
            if with_ttl {
                args.push(lease.ttl().as_millis().to_string());
            }
        });
        let replies = self.timed_batch(operation, &calls).await?;
        Ok(spread(&groups, replies, leases.len()))
    }

    /// One acquire sent directly, with the single-key script.
    async fn acquire_one(
        &self,
        key: &LockKey,
        ttl: Duration,
        called: Instant,
    ) -> Result<Option<Lease>, LockError> {
        let keys = self.keys(key);
        let owner = OwnerId::random();
        let call = self.acquire_call(&keys, owner, ttl);
        let mut pending = AbandonOnDrop {
            backend: self,
            attempt: Some((keys, owner)),
            ttl,
        };
        // A single node's connection that dropped is sent the same call once more, on the
        // connection it makes again: the script answers a resent attempt with the token it
        // already granted, so the call cannot take the key twice, and a restart or a
        // network blip costs one round trip instead of an unknown outcome. (A cluster
        // connection resends on its own.)
        let reply = self
            .timed("acquire", true, async {
                match self.inner.conn.invoke::<Option<u64>>(&call).await {
                    Err(e) if !self.inner.cluster && (e.is_connection_dropped() || e.is_io_error()) => {
                        debug!(error = %e.kind_name(), "acquire: connection lost; sending it again");
                        self.inner.conn.invoke::<Option<u64>>(&call).await
                    }
                    reply => reply,
                }
            })
            .await;
        let attempt = pending.attempt.take();
        match reply {
            Ok(token) => Ok(token.map(|t| self.lease(key, owner, t, ttl, called))),
            Err(e) => {
                if let (LockError::OutcomeUnknown { .. }, Some(attempt)) = (&e, attempt) {
                    self.abandon(vec![attempt], ttl);
                }
                Err(e)
            }
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
            .timed("release", true, self.release_until_settled(lease, None))
            .await?;
        Ok(release(released))
    }

    /// Sends `lease`'s release until its outcome is known, as [`Self::release_one`] says;
    /// `failed` is the error of a send already made (a batch's), if any.
    async fn release_until_settled(
        &self,
        lease: &Lease,
        failed: Option<RedisError>,
    ) -> RedisResult<i64> {
        let call = self.owner_call(&RELEASE_SCRIPT, lease, false);
        let give_up = Instant::now() + self.inner.response_timeout / 2;
        let mut pause = RESEND_PAUSE;
        // The error of the last send when it may have run: ask before sending again.
        let mut unsure: Option<RedisError> = None;
        let mut failed = failed;
        loop {
            if let Some(e) = &unsure {
                match self
                    .inner
                    .conn
                    .invoke::<(i64, u64)>(&self.fence_call(lease))
                    .await
                {
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

    /// Called when the call of `kind` in flight is done: sends the calls queued meanwhile
    /// as one batch, in a task of its own (so it runs even when no caller waits any more),
    /// or marks the queue idle.
    ///
    /// The batch runs on the runtime of one of its callers, not on the one of the call
    /// just done: a backend may be shared by several runtimes, and the one that ends the
    /// call may be shutting down. Its [`InFlight`] mark is made before spawning and moves
    /// into the task: if that runtime drops the task unpolled after all, dropping the mark
    /// hands off again (the batch's callers learn from their closed channels) instead of
    /// leaving the queue busy forever.
    fn hand_off(&self, kind: Kind) {
        let current = Handle::try_current().ok();
        match kind {
            Kind::Acquire => {
                while let Some(batch) = self.inner.acquires.next() {
                    let callers = batch.iter().map(|p| &p.runtime);
                    let Some(runtime) = callers.flatten().next().or(current.as_ref()) else {
                        // Nothing can be sent without a runtime: dropping the batch closes
                        // its callers' channels, which tells them so.
                        continue;
                    };
                    let runtime = runtime.clone();
                    let in_flight = self.in_flight(kind);
                    runtime.spawn(async move {
                        in_flight.backend.acquire_queued(batch).await;
                        drop(in_flight);
                    });
                    return;
                }
            }
            Kind::Release => {
                while let Some(batch) = self.inner.releases.next() {
                    let callers = batch.iter().map(|p| &p.runtime);
                    let Some(runtime) = callers.flatten().next().or(current.as_ref()) else {
                        continue;
                    };
                    let runtime = runtime.clone();
                    let in_flight = self.in_flight(kind);
                    runtime.spawn(async move {
                        in_flight.backend.release_queued(batch).await;
                        drop(in_flight);
                    });
                    return;
                }
            }
        }
    }

    fn in_flight(&self, kind: Kind) -> InFlight {
        InFlight {
            backend: self.clone(),
            kind,
        }
    }

    /// A queued caller's wait for its reply. The call in flight ahead of it and then its
    /// own batch are each bounded by the response timeout; the third one is slack. A
    /// caller that stops waiting loses nothing: a lease granted to it later is released
    /// in the background.
    async fn queued_reply<T>(
        &self,
        operation: &'static str,
        rx: oneshot::Receiver<Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let limit = self.inner.response_timeout * 3;
        match tokio::time::timeout(limit, rx).await {
            Ok(reply) => reply.unwrap_or_else(|_| Err(dropped(operation))),
            Err(_) => Err(LockError::OutcomeUnknown {
                backend: NAME,
                operation,
                message: format!("no reply from the coalesced batch within {limit:?}"),
            }),
        }
    }

    /// Sends queued acquires as one batch and answers each caller. A lease whose caller
    /// has gone (dropped its future) is released in the background, not left to expire.
    async fn acquire_queued(&self, batch: Vec<PendingAcquire>) {
        let attempts: Vec<(LockKeys, OwnerId, Duration)> = batch
            .iter()
            .map(|p| (self.keys(&p.key), OwnerId::random(), p.ttl))
            .collect();
        let longest = batch.iter().map(|p| p.ttl).max().unwrap_or_default();
        let replies = match self.send_acquires("acquire", &attempts).await {
            Ok(replies) => replies,
            Err(e) => {
                if matches!(e, LockError::OutcomeUnknown { .. }) {
                    self.abandon(
                        attempts.into_iter().map(|(k, o, _)| (k, o)).collect(),
                        longest,
                    );
                }
                for p in batch {
                    let _ = p.reply.send(Err(duplicate(&e)));
                }
                return;
            }
        };
        let mut unknown = Vec::new();
        let mut orphans = Vec::new();
        for ((p, (keys, owner, _)), reply) in batch.into_iter().zip(attempts).zip(replies) {
            let outcome = match reply
                .map_err(|e| map_error("acquire", true, &e))
                .and_then(|v| parse_token(Some(v)))
            {
                Ok(token) => Ok(token.map(|t| self.lease(&p.key, owner, t, p.ttl, p.called))),
                Err(e) => {
                    if matches!(e, LockError::OutcomeUnknown { .. }) {
                        unknown.push((keys, owner));
                    }
                    Err(e)
                }
            };
            if let Err(Ok(Some(lease))) = p.reply.send(outcome) {
                orphans.push(lease);
            }
        }
        if !unknown.is_empty() {
            self.abandon(unknown, longest);
        }
        if !orphans.is_empty() {
            let backend = self.clone();
            tokio::spawn(async move {
                let released = backend.release_many(&orphans).await;
                tracing::debug!(
                    leases = orphans.len(),
                    done = released.is_ok(),
                    "released the leases of acquires whose callers had gone"
                );
            });
        }
    }

    /// Sends queued releases as one batch and answers each caller.
    async fn release_queued(&self, batch: Vec<PendingRelease>) {
        let leases: Vec<&Lease> = batch.iter().map(|p| &p.lease).collect();
        let replies = self
            .send_lease_batch("release", &RELEASE_MANY_SCRIPT, &leases, false)
            .await;
        let replies = match replies {
            Ok(replies) => replies,
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Err(duplicate(&e)));
                }
                return;
            }
        };
        for (p, reply) in batch.into_iter().zip(replies) {
            let outcome = reply
                .and_then(|v| Ok(redis::from_redis_value::<i64>(v)?))
                .map(release)
                .map_err(|e| map_error("release", true, &e));
            let _ = p.reply.send(outcome);
        }
    }

    /// Runs `script` on the fenced-resource key of `resource` with `token`.
    pub(crate) async fn run_script<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        script: &'static redis::Script,
        resource: &str,
        token: u64,
    ) -> Result<T, LockError> {
        let call = Call {
            script,
            keys: vec![crate::keys::fenced_resource_key(
                &self.inner.prefix,
                resource,
            )],
            args: vec![token.to_string()],
        };
        self.timed(operation, true, self.inner.conn.invoke(&call))
            .await
    }

    /// Runs `script` on `keys` (all of one hash slot) with `args` sent as bytes, so a
    /// caller's value reaches the script unchanged.
    pub(crate) async fn run_script_on<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        script: &'static Script,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<T, LockError> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let request = async {
            match &self.inner.conn {
                Conn::Single(c) => invocation.invoke_async(&mut c.clone()).await,
                Conn::Cluster(c, _) => invocation.invoke_async(&mut c.clone()).await,
            }
        };
        self.timed(operation, true, request).await
    }

    /// Runs a command that only reads (routed by its first key in a cluster).
    pub(crate) async fn read_command<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T, LockError> {
        self.timed(operation, false, self.inner.conn.command(cmd))
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

    /// An acquire followed by `WAIT` in the same round trip. Whatever it took is given back
    /// in the background when its future is dropped before it returns, and when it fails
    /// after taking the key.
    async fn acquire_with_replicas(
        &self,
        key: &LockKey,
        ttl: Duration,
        replicas: usize,
        wait: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let keys = self.keys(key);
        let owner = OwnerId::random();
        let call = self.acquire_call(&keys, owner, ttl);
        let mut wait_cmd = redis::cmd("WAIT");
        wait_cmd.arg(replicas).arg(wait.as_millis().to_string());
        let mut pending = AbandonOnDrop {
            backend: self,
            attempt: Some((keys, owner)),
            ttl,
        };
        let sent = Instant::now();
        let replies = self
            .timed(
                "acquire",
                true,
                self.inner.conn.invoke_with(&call, &[wait_cmd]),
            )
            .await;
        let mut replies = match replies {
            Ok(r) => r.into_iter(),
            Err(e) => {
                if !matches!(e, LockError::OutcomeUnknown { .. }) {
                    pending.attempt = None;
                }
                return Err(e);
            }
        };
        // The script's own error, or no grant: nothing was taken.
        let Some(token) = parse_token(replies.next()).inspect_err(|_| pending.attempt = None)?
        else {
            pending.attempt = None;
            return Ok(None);
        };
        let acked: i64 = match replies.next().map(Value::extract_error) {
            Some(Ok(v)) => redis::from_redis_value(v).map_err(|e| LockError::backend(NAME, e))?,
            Some(Err(e)) => return Err(map_error("acquire", true, &e)),
            None => 0,
        };
        let lease = self.lease(key, owner, token, ttl, sent);
        if usize::try_from(acked).unwrap_or(0) < replicas {
            let short = format!(
                "only {acked} of {replicas} replicas acknowledged the lock within {wait:?}"
            );
            return match self.release(&lease).await {
                Ok(_) => {
                    pending.attempt = None;
                    Err(LockError::unavailable(
                        NAME,
                        format!("{short}; it was released"),
                    ))
                }
                // The lock may still be held (until its TTL, or until the cleanup that
                // dropping `pending` starts gets through).
                Err(e) => Err(LockError::OutcomeUnknown {
                    backend: NAME,
                    operation: "acquire",
                    message: format!("{short}; releasing it failed ({e})"),
                }),
            };
        }
        pending.attempt = None;
        Ok(Some(lease))
    }
}

/// Leases a batch has taken so far: released in the background if the batch's future is
/// dropped before it hands them over.
struct ReleaseOnDrop<'a> {
    backend: &'a RedisBackend,
    leases: Vec<Lease>,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        if leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.backend.clone();
        runtime.spawn(async move {
            let released = backend.release_many(&leases).await;
            tracing::debug!(
                leases = leases.len(),
                done = released.is_ok(),
                "released the leases of a batch whose caller had gone"
            );
        });
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
        let mut queued = None;
        let direct = self.inner.acquires.join(|| {
            let (reply, rx) = oneshot::channel();
            queued = Some(rx);
            PendingAcquire {
                key: key.clone(),
                ttl,
                called,
                runtime: Handle::try_current().ok(),
                reply,
            }
        });
        match queued {
            Some(rx) if !direct => self.queued_reply("acquire", rx).await,
            _ => {
                let _in_flight = self.in_flight(Kind::Acquire);
                self.acquire_one(key, ttl, called).await
            }
        }
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        let call = self.owner_call(&RENEW_SCRIPT, lease, true);
        let sent = Instant::now();
        let renewed: i64 = self
            .timed("renew", true, self.inner.conn.invoke(&call))
            .await?;
        Ok(renewal(renewed, sent, lease.ttl()))
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        if self.inner.cluster {
            return self.release_one(lease).await;
        }
        let mut queued = None;
        let direct = self.inner.releases.join(|| {
            let (reply, rx) = oneshot::channel();
            queued = Some(rx);
            PendingRelease {
                lease: lease.clone(),
                runtime: Handle::try_current().ok(),
                reply,
            }
        });
        match queued {
            Some(rx) if !direct => self.queued_reply("release", rx).await,
            _ => {
                let _in_flight = self.in_flight(Kind::Release);
                self.release_one(lease).await
            }
        }
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        lease.check_backend(self.inner.id, NAME)?;
        let call = self.fence_call(lease);
        let (current, newest): (i64, u64) = self
            .timed("fence", false, self.inner.conn.invoke(&call))
            .await?;
        Ok(if current == 1 {
            Fence::Current
        } else {
            Fence::Stale {
                current: FencingToken(newest),
            }
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let keys = self.keys(key);
        let mut pipe = redis::pipe();
        pipe.get(&keys.lock).pttl(&keys.lock).get(&keys.fence);
        let conn = self.inner.conn.clone();
        let (owner, pttl, token): (Option<String>, i64, Option<u64>) = self
            .timed("inspect", false, async move {
                match conn {
                    Conn::Single(mut c) => pipe.query_async(&mut c).await,
                    Conn::Cluster(mut c, _) => pipe.query_async(&mut c).await,
                }
            })
            .await?;
        Ok(LockInfo {
            owner: owner.as_deref().and_then(|o| OwnerId::parse(o).ok()),
            token: token.map(FencingToken),
            remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
        })
    }

    /// A lease of this instance for `owner` and `token`, for tools that act on a lock held
    /// by another process. Nothing is sent: renew, release and fence check owner and token
    /// in their scripts, so a wrong pair is [`Renewal::Lost`] / [`Release::NotHeld`] /
    /// [`Fence::Stale`] and changes nothing. Its `valid_until` is now: this process never
    /// saw the grant, so it cannot claim any validity before a renewal.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.inner.listener.watch(key)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.listener.watched_keys()
    }

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

    /// Deletes the lock key and the fence key (the token counter) with one `DEL`: the two
    /// keys share a hash slot, so this is one command on one node, also in a cluster.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let keys = self.keys(key);
        let mut del = redis::cmd("DEL");
        del.arg(&keys.lock).arg(&keys.fence);
        let _deleted: i64 = self
            .timed("purge", true, self.inner.conn.command(&del))
            .await?;
        Ok(())
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
            // Each grant needs its own WAIT verdict: take them one at a time.
            let mut taken = ReleaseOnDrop {
                backend: self,
                leases: Vec::new(),
            };
            let mut granted: Vec<bool> = Vec::with_capacity(keys.len());
            for key in keys {
                match self.acquire(key, ttl).await {
                    Ok(lease) => {
                        granted.push(lease.is_some());
                        taken.leases.extend(lease);
                    }
                    Err(e) => {
                        // A failed batch holds nothing: give back what it took (what this
                        // cannot give back, dropping `taken` tries again in the background).
                        return match self.release_many(&taken.leases).await {
                            Ok(_) => {
                                taken.leases.clear();
                                Err(e)
                            }
                            Err(release) => Err(LockError::OutcomeUnknown {
                                backend: NAME,
                                operation: "acquire_many",
                                message: format!(
                                    "{e}; releasing the {} locks taken before failed ({release})",
                                    taken.leases.len()
                                ),
                            }),
                        };
                    }
                }
            }
            let mut leases = std::mem::take(&mut taken.leases).into_iter();
            return Ok(granted
                .into_iter()
                .map(|g| if g { leases.next() } else { None })
                .collect());
        }
        let with_ttl: Vec<(LockKeys, OwnerId, Duration)> = keys
            .iter()
            .map(|k| (self.keys(k), OwnerId::random(), ttl))
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
                .map_err(|e| map_error("acquire_many", true, &e))
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
            failure = unreachable.map(|e| map_error("acquire_many", true, &e));
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
            .send_lease_batch("renew_many", &RENEW_MANY_SCRIPT, &all, true)
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
            .send_lease_batch("release_many", &RELEASE_MANY_SCRIPT, &all, false)
            .await?;
        if self.inner.cluster {
            // Items a node refused for now, or whose connection dropped, are settled one by
            // one, as a single release is: a restarted or failed-over node's connection is
            // often not ready for the batch that finds it gone.
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
        Ok(self
            .lease_outcomes("release_many", replies)?
            .into_iter()
            .map(|outcome| outcome.map_or(Release::Unreachable, release))
            .collect())
    }
}

/// One multi-key call per group: `item(i, keys, args)` adds item `i`'s keys and arguments.
fn grouped_calls(
    script: &'static Script,
    groups: &[Vec<usize>],
    mut item: impl FnMut(usize, &mut Vec<String>, &mut Vec<String>),
) -> Vec<Call> {
    groups
        .iter()
        .map(|group| {
            let mut keys = Vec::with_capacity(group.len() * 2);
            let mut args = Vec::with_capacity(group.len() * 3);
            for &i in group {
                item(i, &mut keys, &mut args);
            }
            Call { script, keys, args }
        })
        .collect()
}

/// One reply per item from the replies of the grouped calls: a call's array is split over
/// its items (an error inside it is its item's own); a call's error is each of its items' error.
fn spread(
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

/// The error of a coalesced batch, once for each of its callers (`LockError` is not `Clone`).
fn duplicate(e: &LockError) -> LockError {
    match e {
        LockError::OutcomeUnknown {
            backend,
            operation,
            message,
        } => LockError::OutcomeUnknown {
            backend,
            operation,
            message: message.clone(),
        },
        LockError::Unavailable { backend, message } => LockError::Unavailable {
            backend,
            message: message.clone(),
        },
        LockError::Config(message) => LockError::Config(message.clone()),
        other => LockError::backend(NAME, other.to_string()),
    }
}

/// The error of a queued call whose batch was dropped unanswered (its runtime shut down).
fn dropped(operation: &'static str) -> LockError {
    LockError::OutcomeUnknown {
        backend: NAME,
        operation,
        message: "the batch was dropped before its reply".into(),
    }
}

fn renewal(renewed: i64, sent: Instant, ttl: Duration) -> Renewal {
    if renewed == 1 {
        Renewal::Renewed {
            valid_until: valid_until(sent, ttl),
        }
    } else {
        Renewal::Lost
    }
}

fn release(released: i64) -> Release {
    if released == 1 {
        Release::Released
    } else {
        Release::NotHeld
    }
}

fn parse_token(reply: Option<Value>) -> Result<Option<u64>, LockError> {
    let Some(reply) = reply else {
        return Err(LockError::backend(NAME, "the acquire script sent no reply"));
    };
    let reply = reply
        .extract_error()
        .map_err(|e| map_error("acquire", true, &e))?;
    redis::from_redis_value::<Option<u64>>(reply).map_err(|e| LockError::backend(NAME, e))
}

async fn cluster_connection(
    b: &RedisBackendBuilder,
    nodes: Vec<redis::ConnectionInfo>,
    certificates: Option<redis::TlsCertificates>,
    retries: u32,
    shown_urls: &str,
) -> Result<ClusterConnection, LockError> {
    let mut client = ClusterClientBuilder::new(nodes)
        .connection_timeout(b.connect_timeout)
        .response_timeout(b.response_timeout)
        .retries(retries);
    if let Some(certificates) = certificates {
        client = client.certs(certificates);
    }
    let client = client.build().map_err(|e| config_error(shown_urls, &e))?;
    with_timeout(b.connect_timeout, client.get_async_connection())
        .await
        .map_err(|e| connect_error(shown_urls, e))
}

async fn with_timeout<T>(
    limit: Duration,
    f: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no connection within {limit:?}"),
        )))
    })
}

fn parse_url(url: &str) -> Result<redis::ConnectionInfo, LockError> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| config_error(&redact_url(url), &e))
}

fn config_error(shown_url: &str, e: &RedisError) -> LockError {
    // The client library's message may quote the URL: only its kind is kept.
    LockError::Config(format!("invalid Redis URL {shown_url}: {}", e.category()))
}

fn connect_error(shown_url: &str, e: RedisError) -> LockError {
    if is_auth_error(&e) {
        return LockError::Config(format!(
            "{shown_url}: the server refused the credentials ({})",
            e.kind_name()
        ));
    }
    if let Some(tls) = crate::tls::tls_failure(&e) {
        // An untrusted certificate or a TLS/plain mismatch does not go away by retrying.
        return LockError::Config(format!("{shown_url}: TLS handshake failed: {tls}"));
    }
    LockError::unavailable(
        NAME,
        format!("cannot connect to {shown_url}: {}", e.kind_name()),
    )
}

/// True for the errors of a node that could not be asked or did not answer: a cluster
/// batch reports its items unreachable instead of failing as a whole.
fn is_unreachable(e: &RedisError) -> bool {
    !is_auth_error(e)
        && (e.is_connection_refusal()
            || e.is_timeout()
            || e.is_connection_dropped()
            || e.is_io_error()
            || is_refused_for_now(e))
}

/// True for the errors after which a release is tried again: it did not run (refused for
/// now), or its connection dropped and the store is asked whether it ran. Not a timeout:
/// a node that answers that slowly is not asked again.
fn is_resendable(e: &RedisError) -> bool {
    is_unreachable(e) && !e.is_timeout()
}

/// True for the errors of a request that did not run and may succeed later: no
/// connection to its cluster node, or a server that refuses it for now: a replica or a
/// demoted master (READONLY), a failover or resharding under way (MASTERDOWN,
/// CLUSTERDOWN, TRYAGAIN), a dataset being loaded (LOADING), a long script (BUSY), or
/// memory full (OOM). A script meets READONLY and OOM at its first write, so it has
/// changed nothing either.
fn is_refused_for_now(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ClusterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ) | ErrorKind::ClusterConnectionNotFound
    ) || e.code().is_some_and(|c| c == "BUSY" || c == "OOM")
}

fn is_auth_error(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm)
    ) || e.code().is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH")
}

/// Turns a client error into the public error, without the store's type or credentials.
fn map_error(operation: &'static str, changes_state: bool, e: &RedisError) -> LockError {
    if is_auth_error(e) {
        return LockError::Config(format!(
            "the Redis server refused the credentials ({})",
            e.kind_name()
        ));
    }
    if e.is_connection_refusal() {
        return LockError::unavailable(NAME, format!("{operation}: connection refused"));
    }
    if e.is_timeout() || e.is_connection_dropped() || e.is_io_error() {
        let message = format!("{operation}: connection lost ({e})");
        return if changes_state {
            LockError::OutcomeUnknown {
                backend: NAME,
                operation,
                message,
            }
        } else {
            LockError::unavailable(NAME, message)
        };
    }
    if is_refused_for_now(e) {
        return LockError::unavailable(NAME, format!("{operation}: {e}"));
    }
    LockError::backend(NAME, e.clone())
}

trait KindName {
    fn kind_name(&self) -> String;
}

impl KindName for RedisError {
    /// The error's category and code, never its free text (which may quote a URL).
    fn kind_name(&self) -> String {
        match self.code() {
            Some(code) => format!("{}: {code}", self.category()),
            None => self.category().to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(reply: &str) -> RedisError {
        redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .and_then(Value::extract_error)
            .expect_err("an error reply")
    }

    #[test]
    fn transient_server_refusals_are_retryable_unavailable() {
        for reply in [
            "READONLY You can't write against a read only replica.",
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "CLUSTERDOWN The cluster is down",
        ] {
            let err = map_error("acquire", true, &server_error(reply));
            assert!(
                matches!(err, LockError::Unavailable { .. }) && err.is_retryable(),
                "{reply}: {err:?}"
            );
        }
        let err = map_error("acquire", true, &server_error("ERR unknown command"));
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    }
}
