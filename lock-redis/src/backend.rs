//! [`RedisBackend`]: the [`LockBackend`] on one Redis node or a Redis Cluster, on top of
//! its [`Core`] (the connection, the settings and every operation sent). Each call decides
//! here, once, which way it goes: with replica acknowledgements (an acquire and its
//! `WAIT`), one by one (a cluster), or coalesced with the calls of its kind in flight (a
//! single node; `coalesced` sends those batches).

mod coalesced;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release,
    Renewal,
};
use tokio::time::Instant;

use self::coalesced::{Acquire, PermitAttempt};
use crate::coalesce::Coalescer;
use crate::config::RedisBackendBuilder;
use crate::core::Core;
use crate::error::NAME;
use crate::keys::LockKeys;
use crate::permits::PermitRun;

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
    core: Arc<Core>,
    /// Single acquires, coalesced (single node only).
    acquires: Coalescer<Acquire, Option<Lease>>,
    /// Single releases, coalesced (single node only).
    releases: Coalescer<Lease, Release>,
    /// Permit attempts through a semaphore's index, coalesced (single node only); `None`
    /// answers that the server refused the index.
    permits: Coalescer<PermitAttempt, Option<Option<Lease>>>,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = self.core();
        f.debug_struct("RedisBackend")
            .field("urls", &core.shown_urls)
            .field("cluster", &core.cluster)
            .field("prefix", &core.calls.prefix)
            .field("request_timeout", &core.request_timeout)
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
        &self.core().calls.prefix
    }

    /// The Redis key of `key`, `<prefix>:{<name>}`, which holds `<owner id>:<token>`
    /// while the lock is held; it is also the channel its releases are announced on. A
    /// semaphore's permit slot `<semaphore>:permit:<i>` is
    /// `<prefix>:{<semaphore>}:permit:<i>`: the slots of one semaphore share the hash slot
    /// of its name, on one shard of a Cluster.
    pub fn redis_key(&self, key: &LockKey) -> String {
        LockKeys::new(&self.core().calls.prefix, key).lock
    }

    /// Connects as `b` says (see [`crate::connect`]), with the coalescers of single calls.
    pub(crate) async fn connect(b: RedisBackendBuilder) -> Result<Self, LockError> {
        // A queued call waits for the call in flight ahead of it and then its own batch,
        // each bounded by the request timeout; the third one is slack.
        let coalesced_patience = b.request_timeout * 3;
        let core = crate::connect::connect(b).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                core: Arc::new(core),
                acquires: Coalescer::new(SENT_AT_ONCE, coalesced_patience),
                releases: Coalescer::new(SENT_AT_ONCE, coalesced_patience),
                permits: Coalescer::new(SENT_AT_ONCE, coalesced_patience),
            }),
        })
    }

    /// The connection, the settings and every operation sent.
    pub(crate) fn core(&self) -> &Core {
        &self.inner.core
    }

    /// An acquire followed by `WAIT` in the same round trip; a grant too few replicas
    /// acknowledged within `wait` is released again. Whatever it took is given back in the
    /// background when its future is dropped before it returns, and when it fails after
    /// taking the key.
    async fn acquire_with_replicas(
        &self,
        key: &LockKey,
        ttl: Duration,
        replicas: usize,
        wait: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let Some(mut granted) = self.core().acquire_acked(key, ttl, replicas, wait).await? else {
            return Ok(None);
        };
        let acked = granted.replicas;
        if usize::try_from(acked).unwrap_or(0) < replicas {
            let short = format!(
                "only {acked} of {replicas} replicas acknowledged the lock within {wait:?}"
            );
            return match self.release(&granted.lease).await {
                Ok(_) => {
                    granted.pending.settled();
                    Err(LockError::unavailable(
                        NAME,
                        format!("{short}; it was released"),
                    ))
                }
                // The lock may still be held (until its TTL, or until the cleanup that
                // dropping `pending` starts gets through).
                Err(e) => Err(LockError::outcome_unknown(
                    NAME,
                    "acquire",
                    format!("{short}; releasing it failed ({e})"),
                )),
            };
        }
        granted.pending.settled();
        Ok(Some(granted.lease))
    }

    /// `acquire_many` with replica acknowledgements: each grant needs its own `WAIT`
    /// verdict, so the keys are taken one at a time. A failed batch holds nothing.
    async fn acquire_many_with_replicas(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let mut taken = ReleaseOnDrop {
            core: &self.inner.core,
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
                    return match self.core().release_leases(&taken.leases).await {
                        Ok(_) => {
                            taken.leases.clear();
                            Err(e)
                        }
                        Err(release) => Err(LockError::outcome_unknown(
                            NAME,
                            "acquire_many",
                            format!(
                                "{e}; releasing the {} locks taken before failed ({release})",
                                taken.leases.len()
                            ),
                        )),
                    };
                }
            }
        }
        let mut leases = std::mem::take(&mut taken.leases).into_iter();
        Ok(granted
            .into_iter()
            .map(|g| if g { leases.next() } else { None })
            .collect())
    }
}

#[async_trait]
impl LockBackend for RedisBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// What the builder found, and [`Capabilities::permit_index`] as `acquire_any` decides
    /// it: false with `replica_acks`, and once the server refused this user the index's
    /// commands (permit attempts then take the slot keys without it).
    fn capabilities(&self) -> Capabilities {
        let core = self.core();
        core.caps.clone().permit_index(core.permit_index())
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        let core = self.core();
        core.caps.check_ttl(ttl)?;
        if let Some((replicas, wait)) = core.replica_acks {
            return self.acquire_with_replicas(key, ttl, replicas, wait).await;
        }
        let called = Instant::now();
        if core.cluster {
            return core.acquire_one(key, ttl, called).await;
        }
        let batched = || Acquire {
            key: key.clone(),
            ttl,
            called,
        };
        self.inner
            .acquires
            .run(&self.inner.core, batched, || {
                core.acquire_one(key, ttl, called)
            })
            .await
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        lease.check_backend(self.core().id, NAME)?;
        self.core().renew(lease).await
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        let core = self.core();
        lease.check_backend(core.id, NAME)?;
        if core.cluster {
            return core.release_one(lease).await;
        }
        self.inner
            .releases
            .run(
                &self.inner.core,
                || lease.clone(),
                || core.release_one(lease),
            )
            .await
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        lease.check_backend(self.core().id, NAME)?;
        self.core().fence(lease).await
    }

    /// The holder, its token and what is left of its TTL, from the lock key. A free key
    /// has no token: nothing of the key is kept after a release or an expiry (the next
    /// grant's token is above the high-water key its hash slot shares).
    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        self.core().inspect(key).await
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.core().listener.watch(key)
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.core().listener.watch_permits(slots)
    }

    fn watched_keys(&self) -> Vec<LockKey> {
        self.core().listener.watched_keys()
    }

    /// Adopted leases are this instance's: renew, release and fence check owner and token
    /// in their scripts, so a wrong pair is [`Renewal::Lost`] / [`Release::NotHeld`] /
    /// [`Fence::Stale`] and changes nothing.
    fn adopts_as(&self) -> Option<BackendId> {
        Some(self.core().id)
    }

    /// Deletes the lock key with one `DEL`, whoever holds it. The next grant's token is
    /// still above the purged one: a `DEL` and a new grant take longer than a microsecond.
    /// A semaphore's permit slot is deleted with its semaphore's index (the next attempts
    /// rebuild it from the slot keys).
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.core().purge(key).await
    }

    /// One script over every key (`acquire_any.lua`): one round trip however many of
    /// them are held, on a single node and, where the keys share one hash slot, on a
    /// Cluster (a semaphore's permit slots do: see [`RedisBackend::redis_key`]). A run of
    /// one semaphore's slots, as a `Semaphore` asks, goes through the semaphore's index
    /// (`acquire_permit.lua`, reading no slot key one by one) and, on a single node, is
    /// coalesced with the permit attempts that arrive together, as `acquire` calls are.
    /// Keys of several hash slots, and every call with
    /// [`replica_acks`](crate::RedisBackendBuilder::replica_acks) (each grant waits for its
    /// replicas), are asked key by key, as the trait's default does.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.core().caps.check_ttl(ttl)?;
        let core = self.core();
        if keys.len() > 1 && core.replica_acks.is_none() {
            if core.permit_index()
                && let Some(run) = PermitRun::of(&core.calls.prefix, keys)
            {
                // A semaphore's slots: through its index, whatever their number, unless
                // the server refuses this user the index's commands; on a single node
                // coalesced with the other permit attempts in flight.
                let called = Instant::now();
                let taken = if core.cluster {
                    core.acquire_permit_one(keys, &run, ttl, called).await
                } else {
                    let batched = || PermitAttempt {
                        run: run.clone(),
                        ttl,
                        mark: core.mark(&keys[..1]),
                        called,
                    };
                    self.inner
                        .permits
                        .run(&self.inner.core, batched, || async {
                            core.acquire_permit_one(keys, &run, ttl, called)
                                .await
                                .transpose()
                        })
                        .await
                        .transpose()
                };
                if let Some(taken) = taken {
                    return taken;
                }
            }
            if let Some(locks) = core.calls.one_script(keys) {
                // Sent directly: a coalesced batch takes one key per caller.
                return core.acquire_any_one(keys, locks, ttl, Instant::now()).await;
            }
        }
        distlock_core::acquire_first_free(keys, |key| self.acquire(key, ttl)).await
    }

    /// One multi-key script call per 128 keys, as `acquire_many` says (see
    /// [`RedisBackend`]); with [`replica_acks`](crate::RedisBackendBuilder::replica_acks),
    /// key by key, each grant waiting for its replicas.
    ///
    /// # Cancel safety
    /// A call whose future is dropped holds nothing for long: what each of its script
    /// calls on its way may have taken is given back in the background, checked against
    /// its owner ids, as a dropped `acquire`'s is; so are the grants of a failed batch
    /// whose release was on its way.
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.core().caps.check_ttl(ttl)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.core().replica_acks.is_some() {
            return self.acquire_many_with_replicas(keys, ttl).await;
        }
        self.core().acquire_batch(keys, ttl).await
    }

    /// One pipeline per node, of one multi-key script call per hash slot (all leases on a
    /// single node), 128 leases at most per call. In a cluster, a lease whose node did not
    /// answer while another node did is [`Renewal::Unreachable`] (the watchdog retries it until its
    /// `valid_until`); when no node answers, the whole call fails, as the single form does.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        for lease in leases {
            lease.check_backend(self.core().id, NAME)?;
        }
        self.core().renew_leases(leases).await
    }

    /// One pipeline per node, of one multi-key script call per hash slot (all leases on a
    /// single node), 128 leases at most per call. In a cluster, a lease whose node did not
    /// answer while another node did is [`Release::Unreachable`] (it frees itself when its TTL runs
    /// out); when no node answers, the whole call fails, as the single form does.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        for lease in leases {
            lease.check_backend(self.core().id, NAME)?;
        }
        self.core().release_leases(leases).await
    }
}

/// Leases a batch has taken so far: released in the background if the batch's future is
/// dropped before it hands them over.
struct ReleaseOnDrop<'a> {
    core: &'a Arc<Core>,
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
        let core = self.core.clone();
        runtime.spawn(async move {
            let released = core.release_leases(&leases).await;
            tracing::debug!(
                leases = leases.len(),
                done = released.is_ok(),
                "released the leases of a batch whose caller had gone"
            );
        });
    }
}
