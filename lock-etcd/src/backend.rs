//! [`EtcdBackend`]: locks as etcd keys attached to one lease each, taken and checked in
//! transactions, with the key's `create_revision` as the fencing token.
//!
//! # One lease per lock
//!
//! Every acquisition grants its own lease with the lock's TTL and attaches the key to it.
//! The alternative, etcd's "session" pattern (one lease per TTL value shared by every
//! lock, kept alive by one background loop), saves the grant round trip, but it breaks
//! bounded ownership: a lock whose holder stops renewing it stays alive as long as any
//! other lock on the shared lease is renewed, i.e. as long as the process runs. With one
//! lease per lock, a lock that is not renewed is deleted by etcd when its own TTL runs out.
//!
//! # Why renewal never extends someone else's lock
//!
//! Renewal checks the key (`create_revision == token` and `value == owner`) and sends one
//! `LeaseKeepAlive` for the lock's own lease, both at once. A key is bound to the lease it
//! was created with for its whole life, so a keep-alive can only ever extend *this*
//! acquisition's key. If that key was deleted (released, or deleted by hand) the keep-alive
//! extends an empty lease, which holds nothing and lapses by itself; a new holder's key has
//! its own lease, which this renewal never touches. A lease that already expired is gone
//! from etcd and cannot be kept alive: the keep-alive answers TTL 0 and renewal is `Lost`.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use lock_api::wake::ReleaseWatch;
use lock_api::{
    BackendId, Capabilities, Fence, FencingToken, Lease, LockBackend, LockError, LockInfo, LockKey,
    OwnerId, Release, Renewal, valid_until,
};
use tokio::time::Instant;
use tracing::{debug, instrument};

use crate::config::EtcdBuilder;
use crate::error::{Effect, NAME};
use crate::keys::etcd_key;
use crate::members::Members;
use crate::releases::ReleaseListener;

/// The etcd v3 lock backend. Build one with [`EtcdBackend::builder`].
///
/// - **Keys**: `<prefix>/locks/<name>` holds the owner id and is attached to the lock's lease
///   (`%` and `/` in the name are percent-encoded, so every prefix and name has its own key).
/// - **Token**: the key's `create_revision`, the cluster-wide revision of the write that
///   created it: strictly increasing across releases, expiries, leader changes and restarts.
/// - **TTL**: whole seconds, at least the cluster's minimum lease TTL (learned when the
///   backend is built, 2 s with etcd's default election timeout). Anything else is
///   [`LockError::InvalidTtl`]: etcd would silently lengthen a shorter lease.
/// - **Expiry**: etcd checks lease expiry about every 500 ms and, after a leader change,
///   extends every lease by up to one election timeout plus the TTL. A lock can outlive its
///   TTL in etcd; it never ends earlier. The client-side `valid_until` is computed from the
///   moment the lease was requested, so it always ends before the lease does.
/// - **Waiters**: one watch per backend on the deletes of its lock keys wakes a waiter in
///   [`lock_api::Locker::lock`] when the key is released, revoked or expires (see
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
}

/// How often renewal asks again when the key is held but the leader does not know its lease.
const KEEP_ALIVE_RETRIES: u32 = 3;
const KEEP_ALIVE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The lease a lock key is attached to, kept in the [`Lease`] so that renew and release
/// need not look it up.
#[derive(Debug, Clone, Copy)]
struct EtcdLease {
    id: i64,
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
            .finish_non_exhaustive()
    }
}

impl EtcdBackend {
    /// Starts configuring a backend.
    pub fn builder() -> EtcdBuilder {
        EtcdBuilder::new()
    }

    pub(crate) fn from_parts(
        members: Members,
        prefix: String,
        user: Option<String>,
        server_min_ttl: Duration,
        (min_ttl, max_ttl): (Duration, Duration),
    ) -> Self {
        let capabilities = Capabilities::new(Duration::from_secs(1), min_ttl, max_ttl)
            .inspect(true)
            .wakes_waiters(true);
        let members = Arc::new(members);
        Self {
            inner: Arc::new(Inner {
                id: BackendId::next(),
                releases: ReleaseListener::new(members.clone(), prefix.clone()),
                members,
                prefix,
                user,
                server_min_ttl,
                capabilities,
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

    /// The etcd key whose `mod_revision` is the newest token granted for `key`. It outlives
    /// the lock key (which is deleted on release and expiry), so the newest token is still
    /// known when the lock is free.
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

    /// The comparisons that prove `lease` still holds its key.
    fn held_by(&self, lease: &Lease) -> Vec<Compare> {
        let key = self.lock_key(lease.key());
        let token = i64::try_from(lease.token().get()).unwrap_or(i64::MAX);
        vec![
            Compare::create_revision(key.clone(), CompareOp::Equal, token),
            Compare::value(key, CompareOp::Equal, lease.owner().to_string()),
        ]
    }

    /// Revokes a lease in the background: used when the lease holds no lock (a contended
    /// acquire, a released lock) or must not hold one (an acquire whose reply was lost).
    /// Revoking only ever deletes keys attached to *this* lease, so it cannot harm another
    /// holder; if the revoke is lost too, the lease lapses by itself within its TTL.
    fn revoke_in_background(&self, lease_id: i64) {
        let backend = self.clone();
        tokio::spawn(async move { backend.revoke(lease_id).await });
    }

    /// Revokes a lease, deleting the keys attached to it; errors are the caller's to ignore.
    async fn revoke(&self, lease_id: i64) -> Result<(), LockError> {
        self.call(Effect::Write("revoke"), |client| async move {
            client.lease_client().revoke(lease_id).await
        })
        .await
        .map(drop)
    }

    /// The lease a lock key is attached to, and the TTL etcd granted it: from the
    /// [`Lease`]'s handle (its TTL was checked when it was granted), or, for an adopted
    /// lease, read from the key (only while the key still belongs to `lease`) and from
    /// etcd's record of the lease, since the TTL given to `adopt` is only what the caller
    /// believes.
    async fn lease_of(&self, lease: &Lease) -> Result<Option<(i64, Duration)>, LockError> {
        if let Some(handle) = lease.handle::<EtcdLease>() {
            return Ok(Some((handle.id, lease.ttl())));
        }
        let kv = self.get_key(lease.key()).await?;
        let Some(lease_id) = kv
            .filter(|kv| is_held_by(kv, lease))
            .map(|kv| kv.lease())
            .filter(|&id| id != 0)
        else {
            return Ok(None);
        };
        let live = self
            .call(Effect::None, |client| async move {
                client.lease_client().time_to_live(lease_id, None).await
            })
            .await?;
        // An expired lease answers TTL -1 and no granted TTL.
        Ok(u64::try_from(live.granted_ttl())
            .ok()
            .filter(|&granted| granted > 0 && live.ttl() >= 0)
            .map(|granted| (lease_id, Duration::from_secs(granted))))
    }

    async fn get_key(&self, key: &LockKey) -> Result<Option<KeyValue>, LockError> {
        Ok(self.lookup(key).await?.0)
    }

    /// The lock key and the newest token of `key`, read in one transaction.
    async fn lookup(
        &self,
        key: &LockKey,
    ) -> Result<(Option<KeyValue>, Option<FencingToken>), LockError> {
        let txn = Txn::new().and_then([
            TxnOp::get(self.lock_key(key), None),
            TxnOp::get(self.token_key(key), None),
        ]);
        let resp = self.txn(Effect::None, txn).await?;
        let mut found = resp.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
            _ => None,
        });
        let lock = found.next().flatten();
        let newest = found
            .next()
            .flatten()
            .and_then(|kv| u64::try_from(kv.mod_revision()).ok())
            .map(FencingToken);
        Ok((lock, newest))
    }

    /// Grants a lease, then in one transaction puts the key on it if the key does not
    /// exist. Validity counts from `sent`, taken before the grant was requested: the lease
    /// starts counting when etcd grants it, so validity from `sent` ends before it does.
    async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        seconds: i64,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        // A lost grant reply leaves at most an unused lease that lapses: no lock was taken.
        let granted = self
            .call(Effect::None, |client| async move {
                client.lease_client().grant(seconds, None).await
            })
            .await?;
        let lease_id = granted.id();
        if granted.ttl() != seconds {
            self.revoke_in_background(lease_id);
            return Err(LockError::invalid_ttl(
                ttl,
                format!(
                    "etcd granted a {} s lease instead of {seconds} s (its minimum lease TTL \
                     changed?); refusing a lease longer than asked for",
                    granted.ttl()
                ),
            ));
        }

        let owner = OwnerId::random();
        let resp = self
            .txn(
                Effect::Write("acquire"),
                self.acquire_txn(key, owner, lease_id),
            )
            .await;
        self.settle_acquire(key, ttl, owner, lease_id, sent, resp)
    }

    /// If `key` does not exist, puts it with `owner` on the lease, and touches its token key;
    /// otherwise reads the holder.
    fn acquire_txn(&self, key: &LockKey, owner: OwnerId, lease_id: i64) -> Txn {
        let etcd_key = self.lock_key(key);
        Txn::new()
            .when([Compare::create_revision(
                etcd_key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    etcd_key.clone(),
                    owner.to_string(),
                    Some(PutOptions::new().with_lease(lease_id)),
                ),
                TxnOp::put(self.token_key(key), owner.to_string(), None),
            ])
            .or_else([TxnOp::get(etcd_key, None)])
    }

    /// The lease granted by the acquire transaction's reply, if it granted one. Every other
    /// outcome revokes the lease: if the put did happen (a lost reply, a reply without the
    /// revision that would be the token), revoking our own lease deletes the key again, so
    /// no key is held for a TTL by a caller that was told it does not hold it.
    fn settle_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        owner: OwnerId,
        lease_id: i64,
        sent: Instant,
        resp: Result<TxnResponse, LockError>,
    ) -> Result<Option<Lease>, LockError> {
        let revision = resp.and_then(|resp| {
            if resp.succeeded() {
                header_revision(&resp).map(Some)
            } else {
                debug!(
                    holder_token = first_kv(&resp).map(|kv| kv.create_revision()),
                    "contended"
                );
                Ok(None)
            }
        });
        let Ok(Some(revision)) = revision else {
            self.revoke_in_background(lease_id);
            return revision.map(|_| None);
        };
        Ok(Some(
            Lease::new(
                self.inner.id,
                key.clone(),
                owner,
                FencingToken(revision),
                ttl,
                valid_until(sent, ttl),
            )
            .with_handle(Arc::new(EtcdLease { id: lease_id })),
        ))
    }

    /// Checks the key and keeps its lease alive, both in flight at once (see the module docs).
    async fn renew_sent(&self, lease: &Lease, sent: Instant) -> Result<Renewal, LockError> {
        let Some((lease_id, granted_ttl)) = self.lease_of(lease).await? else {
            return Ok(Renewal::Lost);
        };
        let check = Txn::new().when(self.held_by(lease));
        let (check, kept) = tokio::join!(
            self.txn(Effect::None, check),
            self.keep_alive_once(lease_id)
        );
        if !check?.succeeded() {
            return Ok(Renewal::Lost);
        }
        if kept? {
            return Ok(Renewal::Renewed {
                valid_until: valid_until(sent, granted_ttl),
            });
        }
        // The key was held at a linearizable read, yet the leader did not know its lease:
        // a leader that has not applied the grant yet (in a cluster, the member that
        // answered the grant may apply it first). Ask again; a lease that really expired
        // stays unknown and the renewal is `Lost`.
        for _ in 0..KEEP_ALIVE_RETRIES {
            tokio::time::sleep(KEEP_ALIVE_RETRY_PAUSE).await;
            let retry_sent = Instant::now();
            if self.keep_alive_once(lease_id).await? {
                return Ok(Renewal::Renewed {
                    valid_until: valid_until(retry_sent, granted_ttl),
                });
            }
        }
        Ok(Renewal::Lost)
    }

    /// One `LeaseKeepAlive` round trip: `Ok(false)` when etcd does not know the lease.
    async fn keep_alive_once(&self, lease_id: i64) -> Result<bool, LockError> {
        self.call(Effect::Write("renew"), |client| async move {
            match client.lease_client().keep_alive(lease_id).await {
                Ok(_) => Ok(true),
                Err(e) if is_lease_gone(&e) => Ok(false),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Releases the leases this backend took, on the error path of a batch.
    async fn give_back(&self, leases: Vec<Lease>) {
        let releases = leases.iter().map(|lease| self.release(lease));
        let _ = futures::future::join_all(releases).await;
    }
}

/// Folds a batch's results, one per item, as the batch contract says: an item whose call
/// failed with a retryable error (no member answered it, or its reply was lost) becomes
/// `unreachable`, provided another item's call answered. Second comes the error to fail the
/// whole batch with, if any: the first error retrying cannot fix or, when no call answered,
/// the first error.
fn per_item<T: Clone>(
    results: Vec<Result<T, LockError>>,
    unreachable: T,
) -> (Vec<T>, Option<LockError>) {
    let answered = results.iter().any(Result::is_ok);
    let mut failure: Option<LockError> = None;
    let items = results
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|e| {
                let fatal = !e.is_retryable();
                let first_fatal = fatal && failure.as_ref().is_none_or(LockError::is_retryable);
                if first_fatal || (!answered && failure.is_none()) {
                    failure = Some(e);
                }
                unreachable.clone()
            })
        })
        .collect();
    (items, failure)
}

/// Splits a batch into waves of indices in which every key appears at most once: the
/// `n`-th lease of a key goes in wave `n`, so calls on one key keep their order.
fn waves(leases: &[Lease]) -> Vec<Vec<usize>> {
    let mut seen: std::collections::HashMap<&LockKey, usize> = std::collections::HashMap::new();
    let mut waves: Vec<Vec<usize>> = Vec::new();
    for (i, lease) in leases.iter().enumerate() {
        let n = seen.entry(lease.key()).or_insert(0);
        if waves.len() <= *n {
            waves.push(Vec::new());
        }
        waves[*n].push(i);
        *n += 1;
    }
    waves
}

fn is_held_by(kv: &KeyValue, lease: &Lease) -> bool {
    u64::try_from(kv.create_revision()).ok() == Some(lease.token().get())
        && kv.value() == lease.owner().to_string().as_bytes()
}

fn header_revision(resp: &TxnResponse) -> Result<u64, LockError> {
    resp.header()
        .and_then(|h| u64::try_from(h.revision()).ok())
        .filter(|&r| r > 0)
        .ok_or_else(|| LockError::backend(NAME, "etcd's transaction reply has no revision"))
}

fn first_kv(resp: &TxnResponse) -> Option<KeyValue> {
    resp.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
        _ => None,
    })
}

fn is_lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
        etcd_client::Error::GRpcStatus(s) => s.message().contains("requested lease not found"),
        _ => false,
    }
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
        let txn = Txn::new().when(self.held_by(lease)).and_then([
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
        let (lock, newest) = self.lookup(lease.key()).await?;
        if lock.as_ref().is_some_and(|kv| is_held_by(kv, lease)) {
            return Ok(Fence::Current);
        }
        let holder = lock.and_then(|kv| u64::try_from(kv.create_revision()).ok());
        let current = [newest, holder.map(FencingToken), Some(lease.token())]
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
        let (lock, newest) = self.lookup(key).await?;
        let Some(kv) = lock else {
            return Ok(LockInfo {
                owner: None,
                token: newest,
                remaining: None,
            });
        };
        let owner = std::str::from_utf8(kv.value())
            .ok()
            .and_then(|v| OwnerId::parse(v).ok());
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
        let held = u64::try_from(kv.create_revision()).ok().map(FencingToken);
        Ok(LockInfo {
            owner,
            token: newest.max(held),
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

#[cfg(test)]
mod tests {
    use harness::etcd::EtcdServer;
    use harness::require;

    use super::*;

    fn unavailable() -> LockError {
        LockError::unavailable(NAME, "no member answered")
    }

    #[test]
    fn batch_items_that_failed_retryably_are_unreachable_while_others_answered() {
        let results = vec![
            Ok(Release::Released),
            Err(unavailable()),
            Ok(Release::NotHeld),
        ];
        let (items, failure) = per_item(results, Release::Unreachable);
        assert_eq!(
            items,
            [Release::Released, Release::Unreachable, Release::NotHeld]
        );
        assert!(failure.is_none(), "{failure:?}");
    }

    #[test]
    fn a_batch_fails_when_no_item_answered_or_an_error_cannot_be_retried() {
        let (_, failure) =
            per_item::<Option<()>>(vec![Err(unavailable()), Err(unavailable())], None);
        assert!(matches!(failure, Some(LockError::Unavailable { .. })));
        let config = LockError::Config("refused".into());
        let (_, failure) = per_item(vec![Ok(None), Err(unavailable()), Err(config)], None::<()>);
        assert!(matches!(failure, Some(LockError::Config(_))), "{failure:?}");
    }

    /// A reply that says the put happened but carries no revision cannot become a lease;
    /// the key it put must not stay held until its lease runs out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_acquire_reply_without_a_revision_revokes_the_lease_it_put_the_key_on() {
        let server = require(EtcdServer::start().await);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .build()
            .await
            .unwrap();
        let key = LockKey::new("no-revision").unwrap();
        let ttl = Duration::from_secs(30);
        let granted = backend
            .call(Effect::None, |client| async move {
                client.lease_client().grant(30, None).await
            })
            .await
            .unwrap();
        let owner = OwnerId::random();
        let sent = Instant::now();
        let mut resp = backend
            .txn(
                Effect::Write("acquire"),
                backend.acquire_txn(&key, owner, granted.id()),
            )
            .await
            .unwrap();
        assert!(resp.succeeded(), "the key was free and is now put");
        resp.take_header();

        let settled = backend.settle_acquire(&key, ttl, owner, granted.id(), sent, Ok(resp));
        assert!(
            matches!(settled, Err(LockError::Backend { .. })),
            "{settled:?}"
        );
        // Freed by the revoke, long before the 30 s lease would lapse.
        let deadline = Instant::now() + Duration::from_secs(10);
        while backend.inspect(&key).await.unwrap().owner.is_some() {
            assert!(
                Instant::now() < deadline,
                "the key is still held on the unrevoked lease"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let taken = backend.acquire(&key, Duration::from_secs(2)).await.unwrap();
        assert!(taken.is_some(), "the key is free to take");
    }
}
