//! [`EtcdBackend`]: locks as etcd keys attached to one lease each, taken and checked in
//! transactions, with tokens from the clients' clocks kept rising per name by the
//! transactions (see `tokens`).
//!
//! # One lease per lock
//!
//! Every acquisition has a lease of its own with the lock's TTL and attaches the key to it:
//! a spare granted ahead for it, or one granted beside its read (see `spare`).
//! The alternative, etcd's "session" pattern (one lease per TTL value shared by every
//! lock, kept alive by one background loop), saves the grant round trip, but it breaks
//! bounded ownership: a lock whose holder stops renewing it stays alive as long as any
//! other lock on the shared lease is renewed, i.e. as long as the process runs. With one
//! lease per lock, a lock that is not renewed is deleted by etcd when its own TTL runs out.
//!
//! Renewal, and how a lease can never extend another holder's lock, is in `lease`;
//! acquiring in `acquire`; the leases granted ahead in `spare`; what a read of a name finds
//! in `found`; folding a batch's per-item results in `batch`; deleting the token keys of
//! names nobody holds in `retention`.

mod acquire;
mod batch;
mod found;
mod lease;
mod permits;
pub(crate) mod retention;
mod spare;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::wake::ReleaseWatch;
use distlock_core::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal,
};
use etcd_client::{Client, Compare, CompareOp, KeyValue, Txn, TxnOp, TxnOpResponse, TxnResponse};
use tokio::time::Instant;
use tracing::instrument;

use self::batch::{per_item, waves};
use self::found::Found;
use self::lease::EtcdLease;
use self::retention::Sweeper;
use self::spare::Spares;
use crate::error::{Effect, NAME};
use crate::keys::etcd_key;
use crate::members::Members;
use crate::releases::{Follower, ReleaseListener};
use crate::tokens::lock_value;

/// The etcd v3 lock backend. Build one with [`EtcdBackend::builder`].
///
/// - **Keys**: `<prefix>/locks/<name>` holds `<owner id>:<token>` and is attached to the
///   lock's lease; `<prefix>/tokens/<name>` holds the newest token granted for the name (`%`
///   and `/` in the name are percent-encoded, so every prefix and name has its own keys)
///   until the name has been free and its token older than the
///   [token retention](crate::EtcdBuilder::token_retention) (24 h by default);
///   `<prefix>/sweeps/tokens` holds when the next sweep of expired token keys is due.
/// - **Token**: the granting client's wall clock in µs, or one more than the name's newest
///   token if that is higher, put only if no other grant came between (one transaction):
///   strictly increasing per name across releases, expiries, leader changes, restarts and
///   snapshot restores (as long as the clients' clocks read later than the last token
///   granted before the restore), and across the deletion of a token key (as long as no
///   client's clock is behind another's by the retention).
/// - **TTL**: whole seconds, at least the cluster's minimum lease TTL (learned when the
///   backend is built, 2 s with etcd's default election timeout). Anything else is
///   [`LockError::InvalidTtl`]: etcd would silently lengthen a shorter lease.
/// - **Expiry**: etcd checks lease expiry about every 500 ms and, after a leader change,
///   extends every lease by up to one election timeout plus the TTL. A lock can outlive its
///   TTL in etcd; it never ends earlier. The client-side `valid_until` is computed from the
///   moment the lease was requested, so it always ends before the lease does.
/// - **Waiters**: one watch per backend on the deletes of its lock keys wakes a waiter in
///   [`distlock_core::Locker::lock`] when the key is released, revoked or expires (see
///   [`LockBackend::watch_releases`]); the waiter's backoff stays as the fallback.
///
/// Cheap to clone: clones share one connection pool.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    id: BackendId,
    members: Arc<Members>,
    prefix: String,
    releases: ReleaseListener,
    user: Option<String>,
    server_min_ttl: Duration,
    capabilities: Capabilities,
    sweeper: Sweeper,
    spares: Spares,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.inner.members.endpoints())
            .field("prefix", &self.inner.prefix)
            .field("user", &self.inner.user)
            .field("min_ttl", &self.inner.capabilities.min_ttl)
            .field("max_ttl", &self.inner.capabilities.max_ttl)
            .field("request_timeout", &self.inner.members.request_timeout())
            .field("token_retention", &self.inner.sweeper.retention())
            .finish_non_exhaustive()
    }
}

impl EtcdBackend {
    pub(crate) fn from_parts(
        members: Members,
        prefix: String,
        user: Option<String>,
        server_min_ttl: Duration,
        (min_ttl, max_ttl): (Duration, Duration),
        token_retention: Duration,
    ) -> Self {
        let capabilities = Capabilities::new(Duration::from_secs(1), min_ttl, max_ttl)
            .inspect(true)
            .wakes_waiters(true);
        let members = Arc::new(members);
        Self {
            inner: Arc::new(Inner {
                id: BackendId::next(),
                releases: ReleaseListener::new(Follower::new(members.clone(), prefix.clone())),
                members,
                prefix,
                user,
                server_min_ttl,
                capabilities,
                sweeper: Sweeper::new(token_retention),
                spares: Spares::default(),
            }),
        }
    }

    /// The shortest lease TTL the cluster grants, as measured when the backend was built.
    pub fn server_min_ttl(&self) -> Duration {
        self.inner.server_min_ttl
    }

    /// The key prefix (without a trailing `/`).
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The etcd key that holds `key`'s lock: `<prefix>/locks/<name>`, with `%` and `/` in
    /// the name percent-encoded, so that no prefix and name share a key with another pair.
    pub fn lock_key(&self, key: &LockKey) -> String {
        etcd_key(&self.inner.prefix, "locks", key.as_str())
    }

    /// The etcd key that holds the newest token granted for `key`. It outlives the lock key
    /// (which is deleted on release and expiry), so the newest token is still known when the
    /// lock is free, until the [token retention](crate::EtcdBuilder::token_retention) has passed.
    pub fn token_key(&self, key: &LockKey) -> String {
        etcd_key(&self.inner.prefix, "tokens", key.as_str())
    }

    #[cfg(test)]
    pub(crate) fn release_listener(&self) -> &ReleaseListener {
        &self.inner.releases
    }

    /// Runs one etcd call, `op` on a member's client, under the request timeout, on the
    /// next member when an attempt surely never reached the cluster (see [`Members`]).
    pub(crate) async fn call<T, F, Fut>(&self, effect: Effect, op: F) -> Result<T, LockError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.inner.members.call(effect, op).await
    }

    /// Runs one transaction (see [`EtcdBackend::call`]).
    pub(crate) async fn txn(&self, effect: Effect, txn: Txn) -> Result<TxnResponse, LockError> {
        self.call(effect, |client| {
            let txn = txn.clone();
            async move { client.kv_client().txn(txn).await }
        })
        .await
    }

    /// TTL checks with etcd-specific reasons; never rounds.
    fn check_ttl(&self, ttl: Duration) -> Result<i64, LockError> {
        let caps = &self.inner.capabilities;
        if ttl.subsec_nanos() != 0 {
            return Err(LockError::invalid_ttl(
                ttl,
                "etcd leases are granted in whole seconds; this TTL would have to be rounded, \
                 which would change how long the lock is held",
            ));
        }
        if ttl < caps.min_ttl {
            let why = if ttl < self.inner.server_min_ttl {
                format!(
                    "this etcd cluster's minimum lease TTL is {:?} (derived from its election \
                     timeout); it would silently lengthen a shorter lease",
                    self.inner.server_min_ttl
                )
            } else {
                format!("the backend's configured minimum TTL is {:?}", caps.min_ttl)
            };
            return Err(LockError::invalid_ttl(ttl, why));
        }
        caps.check_ttl(ttl)?;
        i64::try_from(ttl.as_secs())
            .map_err(|_| LockError::invalid_ttl(ttl, "the TTL does not fit etcd's lease TTL"))
    }

    fn check_lease(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_backend(self.inner.id, NAME)
    }

    /// The comparison that proves `lease` still holds its key: the key holds its owner id
    /// and token (an owner id is drawn afresh for every acquisition).
    fn held_by(&self, lease: &Lease) -> Compare {
        Compare::value(
            self.lock_key(lease.key()),
            CompareOp::Equal,
            lock_value(lease.owner(), lease.token()),
        )
    }

    /// Gets of `key`'s lock key and token key, in that order (see [`Found::from_reads`]).
    fn reads(&self, key: &LockKey) -> [TxnOp; 2] {
        [
            TxnOp::get(self.lock_key(key), None),
            TxnOp::get(self.token_key(key), None),
        ]
    }

    /// `key`'s lock key and token key, read in one transaction (linearizable, no write).
    async fn lookup(&self, key: &LockKey) -> Result<Found, LockError> {
        let resp = self
            .txn(Effect::None, Txn::new().and_then(self.reads(key)))
            .await?;
        Ok(Found::from_reads(&resp))
    }
}

fn is_held_by(kv: &KeyValue, lease: &Lease) -> bool {
    kv.value() == lock_value(lease.owner(), lease.token()).as_bytes()
}

fn first_kv(resp: &TxnResponse) -> Option<KeyValue> {
    resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
        _ => None,
    })
}

#[async_trait]
impl LockBackend for EtcdBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities.clone()
    }

    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        let seconds = self.check_ttl(ttl)?;
        self.acquire_sent(key, ttl, seconds, Instant::now()).await
    }

    /// A semaphore's slots (all `<name>:permit:<digits>` of one name): one range read of
    /// their keys, then `acquire` on the first it shows free, in order, so a refusal is one
    /// round trip whatever their number. Any other list is asked key by key.
    #[instrument(level = "debug", skip_all, fields(backend = NAME, keys = keys.len()))]
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let seconds = self.check_ttl(ttl)?;
        match self.slots_prefix(keys) {
            Some(prefix) => self.acquire_free_slot(keys, prefix, ttl, seconds).await,
            None => {
                distlock_core::acquire_first_free(keys, |key| {
                    self.acquire_sent(key, ttl, seconds, Instant::now())
                })
                .await
            }
        }
    }

    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.check_lease(lease)?;
        self.renew_sent(lease, Instant::now()).await
    }

    /// Deletes the key if `lease` still holds it (owner and token compared in one
    /// transaction), then revokes the lock's now empty lease in the background.
    ///
    /// The answer comes from the transaction alone, so it is exact. The revoke is off the
    /// caller's path: it only frees etcd's memory early, since the lease holds no key any
    /// more; if it is lost, the lease lapses within its TTL.
    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.check_lease(lease)?;
        let etcd_key = self.lock_key(lease.key());
        let txn = Txn::new().when([self.held_by(lease)]).and_then([
            TxnOp::get(etcd_key.clone(), None),
            TxnOp::delete(etcd_key, None),
        ]);
        let resp = self.txn(Effect::Write("release"), txn).await?;
        if !resp.succeeded() {
            return Ok(Release::NotHeld);
        }
        let lease_id = lease
            .handle::<EtcdLease>()
            .map(|h| h.id)
            .or_else(|| first_kv(&resp).map(|kv| kv.lease()))
            .filter(|&id| id != 0);
        if let Some(lease_id) = lease_id {
            self.revoke_in_background(lease_id);
        }
        Ok(Release::Released)
    }

    /// Deletes the lock key and the token key in one transaction, then revokes the lock's
    /// lease if it had one. The revoke is best effort and awaited, so that a process that
    /// exits right after purging leaves no lease behind; a lease it misses holds no key
    /// any more and lapses within its TTL.
    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let lock_key = self.lock_key(key);
        let txn = Txn::new().and_then([
            TxnOp::get(lock_key.clone(), None),
            TxnOp::delete(lock_key, None),
            TxnOp::delete(self.token_key(key), None),
        ]);
        let resp = self.txn(Effect::Write("purge"), txn).await?;
        if let Some(lease_id) = first_kv(&resp).map(|kv| kv.lease()).filter(|&id| id != 0) {
            let _ = self.revoke(lease_id).await;
        }
        Ok(())
    }

    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.check_lease(lease)?;
        let found = self.lookup(lease.key()).await?;
        if found.lock().is_some_and(|kv| is_held_by(kv, lease)) {
            return Ok(Fence::Current);
        }
        let holder = found.holder().map(|(_, token)| token);
        let current = [found.newest(), holder, Some(lease.token())]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(lease.token());
        Ok(Fence::Stale { current })
    }

    /// The holder, the newest token and the remaining lease TTL (whole seconds, rounded
    /// down by etcd).
    #[instrument(level = "debug", skip(self), fields(backend = NAME))]
    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let found = self.lookup(key).await?;
        let newest = found.newest();
        let Some(kv) = found.lock() else {
            return Ok(LockInfo {
                owner: None,
                token: newest,
                remaining: None,
            });
        };
        let holder = found.holder();
        let remaining = if kv.lease() == 0 {
            None
        } else {
            let lease_id = kv.lease();
            let ttl = self
                .call(Effect::None, |client| async move {
                    client.lease_client().time_to_live(lease_id, None).await
                })
                .await?;
            u64::try_from(ttl.ttl()).ok().map(Duration::from_secs)
        };
        Ok(LockInfo {
            owner: holder.map(|(owner, _)| owner),
            token: newest.max(holder.map(|(_, token)| token)),
            remaining,
        })
    }

    /// Acquires every key concurrently (their requests share the connection), with the
    /// validity of every lease counted from the instant the batch started. A key listed
    /// twice is taken at most once: later copies get `None`, as one-by-one calls would.
    ///
    /// A key whose calls failed with a retryable error while another key's answered is
    /// `None` (whatever its attempt may have put is revoked); an error retrying cannot
    /// fix, or no key answering, fails the batch, and the keys it took are given back.
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let seconds = self.check_ttl(ttl)?;
        let sent = Instant::now();
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        let firsts: Vec<&LockKey> = keys.iter().filter(|k| seen.insert(*k)).collect();
        let attempts = firsts
            .iter()
            .map(|key| self.acquire_sent(key, ttl, seconds, sent));
        let (taken, failure) = per_item(futures::future::join_all(attempts).await, None);
        if let Some(e) = failure {
            // A failed batch holds nothing.
            self.give_back(taken.into_iter().flatten().collect()).await;
            return Err(e);
        }
        let mut taken: std::collections::HashMap<&LockKey, Lease> = firsts
            .into_iter()
            .zip(taken)
            .filter_map(|(key, lease)| Some((key, lease?)))
            .collect();
        Ok(keys.iter().map(|key| taken.remove(key)).collect())
    }

    /// Renews every lease concurrently, each counted from the instant the batch started.
    /// Repeated keys go in later waves, so each answers as in one-by-one calls. A lease
    /// whose calls failed with a retryable error while another lease's answered is
    /// [`Renewal::Unreachable`]; an error retrying cannot fix, or no lease answering,
    /// fails the batch.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        for lease in leases {
            self.check_lease(lease)?;
        }
        let sent = Instant::now();
        let mut results: Vec<Result<Renewal, LockError>> =
            leases.iter().map(|_| Ok(Renewal::Lost)).collect();
        for wave in waves(leases) {
            let renewals = wave.iter().map(|&i| self.renew_sent(&leases[i], sent));
            for (&i, renewal) in wave.iter().zip(futures::future::join_all(renewals).await) {
                results[i] = renewal;
            }
        }
        match per_item(results, Renewal::Unreachable) {
            (_, Some(e)) => Err(e),
            (renewals, None) => Ok(renewals),
        }
    }

    /// Releases every lease concurrently. Repeated keys go in later waves, so a second
    /// release of the same lease is `NotHeld` as in one-by-one calls. A lease whose call
    /// failed with a retryable error while another lease's answered is
    /// [`Release::Unreachable`]; an error retrying cannot fix, or no lease answering,
    /// fails the batch.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        for lease in leases {
            self.check_lease(lease)?;
        }
        let mut results: Vec<Result<Release, LockError>> =
            leases.iter().map(|_| Ok(Release::NotHeld)).collect();
        for wave in waves(leases) {
            let releases = wave.iter().map(|&i| self.release(&leases[i]));
            for (&i, release) in wave.iter().zip(futures::future::join_all(releases).await) {
                results[i] = release;
            }
        }
        match per_item(results, Release::Unreachable) {
            (_, Some(e)) => Err(e),
            (releases, None) => Ok(releases),
        }
    }

    /// Watches `key` through the backend's one release watch, which starts with the first
    /// watched key. `None` outside a tokio runtime.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.inner.releases.watch(key)
    }

    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.inner.releases.watch_permits(slots)
    }

    /// The keys waiters on this backend (and its clones) are watching for releases.
    fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.releases.watched_keys()
    }

    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        self.check_ttl(ttl)?;
        // An adopted lease carries no lease id: renew and release read it from the key,
        // and only while the key still holds this owner and token. Renewal counts validity
        // with the TTL etcd granted the lease, whatever `ttl` says.
        Ok(Lease::adopted(
            self.inner.id,
            key.clone(),
            owner,
            token,
            ttl,
        ))
    }
}
