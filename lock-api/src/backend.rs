//! The [`LockBackend`] trait every store implements, and its contract.

pub mod chore;
pub(crate) mod env;
pub(crate) mod failure;
pub(crate) mod lease;
pub(crate) mod redact;
pub mod wake;

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;

use crate::backend::lease::{BackendId, Capabilities, Fence, Lease, LockInfo, Release, Renewal};
use crate::backend::wake::ReleaseWatch;
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};

/// A store that grants leases with fencing tokens.
///
/// Object-safe: use it as `Arc<dyn LockBackend>`. Most code does not call it directly
/// but through [`crate::Locker`], which adds waiting, renewal and guards.
///
/// # Contract
///
/// Every implementation must meet all of these; the `conformance` crate checks them.
///
/// - **Input.** A TTL the store cannot honour exactly (zero, below the minimum, above the
///   maximum, finer than the granularity in [`Capabilities`]) is [`LockError::InvalidTtl`]
///   and changes nothing. A lease from another backend instance is
///   [`LockError::ForeignLease`] and changes nothing.
/// - **Mutual exclusion.** While a lease is held (granted, not released, TTL not run
///   out in the store), `acquire` of the same key returns `Ok(None)`.
/// - **Bounded ownership.** When the TTL runs out in the store without a renewal, the key
///   is free again.
/// - **Fencing.** Every grant of a key carries a token strictly greater than every token
///   granted for that key before, across releases, expiries and, where the store keeps
///   data durably or uses its clock, restarts.
/// - **Owner-checked release.** `release` frees the key only when the lease's owner and
///   token still hold it; otherwise it returns [`Release::NotHeld`] and leaves the current
///   holder's key and TTL untouched. A second release is `NotHeld`, not an error.
/// - **Renewal.** `renew` extends a held lease by its TTL and keeps its token; it returns
///   [`Renewal::Lost`] for a lease that expired or belongs to another owner, and never
///   brings an expired lease back.
/// - **Fence.** `fence` returns [`Fence::Current`] only while the lease is held.
/// - **Validity.** `valid_until` in a lease or renewal is computed with
///   [`crate::valid_until`] from the instant the request was sent.
/// - **Unknown outcomes.** When a request was sent and its reply lost, the call returns
///   [`LockError::OutcomeUnknown`] (or cleans up with an owner-checked release); it never
///   reports a lease it cannot prove was granted.
/// - **Any of several.** `acquire_any` grants at most one of the keys it is given, a free
///   one, with that key's next token, and returns `Ok(None)` only when every key was held.
/// - **Batches.** The `*_many` forms return one result per input, in order, each equal to
///   what the single form would have returned. Where the store is partitioned (a cluster)
///   and only part of it answers, the items it could not ask are
///   [`Renewal::Unreachable`] / [`Release::Unreachable`] (for acquire, `None`) rather than
///   failing the whole batch; the single forms return an error in that case.
#[async_trait]
pub trait LockBackend: Send + Sync + Debug + 'static {
    /// A short name for logs and metrics (`"memory"`, `"redis"`, ...).
    fn name(&self) -> &'static str;

    /// What the store can do.
    fn capabilities(&self) -> Capabilities;

    /// Takes `key` for `ttl` if it is free; `Ok(None)` if someone else holds it.
    ///
    /// # Cancel safety
    /// Not cancel safe: a cancelled acquire may have taken the key, which then frees
    /// itself when the TTL runs out.
    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError>;

    /// Extends a held lease by its TTL, keeping its token.
    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError>;

    /// Frees the key if `lease` still holds it.
    async fn release(&self, lease: &Lease) -> Result<Release, LockError>;

    /// Tells whether `lease` still holds its key with its token.
    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError>;

    /// What the store says about `key`: holder, newest token, remaining TTL.
    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        let _ = key;
        Err(LockError::Unsupported {
            operation: "inspect",
            backend: self.name(),
        })
    }

    /// Starts watching `key` for releases, when the store can announce them
    /// ([`Capabilities::wakes_waiters`]); `None` otherwise, and callers poll.
    ///
    /// The watch is a hint: it may miss a release (a reconnect, a TTL that ran out) or
    /// wake for nothing, so a waiter keeps a backoff as its fallback. A store may announce
    /// only the releases of keys an `acquire` found held while the lease was granted (Redis
    /// does, so a release nobody waits for costs nothing): a waiter watches, then tries,
    /// and waits only after a refused attempt, as [`crate::Locker::lock`] does. Watches of one key
    /// share one subscription per backend instance (see [`crate::backend::wake::ReleaseHub`]);
    /// dropping the last one unsubscribes.
    ///
    /// A backend whose capabilities say it wakes waiters returns `Some`; the default,
    /// for a store that announces no release, is `None`. A wrapper that forwards
    /// [`Self::capabilities`] must forward this and [`Self::watched_keys`] too, or its
    /// waiters silently fall back to polling: the workspace's forwarding impls
    /// ([`crate::Layered`]) deny `clippy::missing_trait_methods`, which fails the build when
    /// one leaves a method to its default.
    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        let _ = key;
        None
    }

    /// One watch of every permit slot of a semaphore, for a waiter that takes whichever
    /// frees first: `slots` are the slots in order, `<name>:permit:0` to
    /// `<name>:permit:<N-1>` (see [`LockKey::permit_slot`]). It is woken as a
    /// [`Self::watch_releases`] of any one slot would be, with the same hints and
    /// fallbacks; watchers of one semaphore in one backend instance share one subscription
    /// per slot, made when the first comes and dropped after the last goes, so a waiter
    /// costs the same whatever N is.
    ///
    /// The default, `None`, has [`crate::Semaphore`] watch each slot with
    /// [`Self::watch_releases`] instead: right, at a cost per waiter that grows with N. A
    /// backend with a [`crate::backend::wake::ReleaseHub`] returns
    /// [`ReleaseHub::watch_permits`](crate::backend::wake::ReleaseHub::watch_permits). A
    /// wrapper forwards it as it forwards [`Self::watch_releases`].
    fn watch_permit_releases(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        let _ = slots;
        None
    }

    /// The keys this instance's waiters are watching for releases right now: what it is
    /// subscribed to. Empty for a backend that does not announce releases (the default),
    /// and once no one waits (a cancelled waiter leaves nothing behind).
    fn watched_keys(&self) -> Vec<LockKey> {
        Vec::new()
    }

    /// The instance [`Self::adopt`] rebuilds leases as, for a backend whose store names a
    /// lease by its key, owner id and token alone: nothing private rides on a lease, so one
    /// rebuilt from those acts on the store as the original does. `None` (the default) for
    /// a backend that cannot adopt, or that adopts on terms of its own.
    fn adopts_as(&self) -> Option<BackendId> {
        None
    }

    /// Rebuilds a lease from its owner id and token, for tools that act on a lease held by
    /// another process (`lockctl release`). The result is an ordinary lease of this
    /// instance: release, renew and fence still check it in the store (its owner id,
    /// which is random per acquisition, and its token where the store compares it; Redis
    /// renews and releases by owner id alone and fences by both).
    /// Backends whose leases carry a private handle (a pinned session) cannot do this.
    ///
    /// The default, for a backend that names [`Self::adopts_as`], checks the TTL against
    /// [`Self::capabilities`] and sends nothing; the lease's `valid_until` is now, since
    /// this process never saw the grant. Without it the call is
    /// [`LockError::Unsupported`].
    fn adopt(
        &self,
        key: &LockKey,
        owner: OwnerId,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        let Some(instance) = self.adopts_as() else {
            return Err(LockError::Unsupported {
                operation: "adopt",
                backend: self.name(),
            });
        };
        self.capabilities().check_ttl(ttl)?;
        Ok(Lease::adopted(instance, key.clone(), owner, token, ttl))
    }

    /// Deletes everything the store keeps for `key`, its fencing counter included, for
    /// test and check runs that clean up the keys they made under their own prefix.
    ///
    /// Never purge a key that is still in use: its tokens would start again from the
    /// store's floor, and fencing downstream would reject the new holders.
    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        let _ = key;
        Err(LockError::Unsupported {
            operation: "purge",
            backend: self.name(),
        })
    }

    /// Takes one free key of `keys`, trying them in order: a lease on the first it finds
    /// free, or `Ok(None)` when every key is held. It takes at most one key, and never one
    /// outside `keys`; an empty list is `Ok(None)`. This is how a [`crate::Semaphore`]
    /// takes a permit: its keys are the permit slots.
    ///
    /// The default asks [`LockBackend::acquire`] key by key, one round trip per held key
    /// ([`acquire_first_free`]: a key it cannot reach is passed over, and its error
    /// returned only when no other key was free); a store that can look at several keys
    /// in one request overrides it. Every key it
    /// finds held counts as a refused acquire of that key (a store that announces only
    /// waited releases marks it).
    ///
    /// # Cancel safety
    /// As [`LockBackend::acquire`]: a cancelled call may have taken one key, which then
    /// frees itself when its TTL runs out.
    async fn acquire_any(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        acquire_first_free(keys, |key| self.acquire(key, ttl)).await
    }

    /// [`LockBackend::acquire`] for many keys; one result per key, in order.
    ///
    /// If the call fails part way, the keys it already took are released (best effort)
    /// before the error is returned.
    ///
    /// # Cancel safety
    /// As [`LockBackend::acquire`], for each key: a cancelled call may have taken some of
    /// them, which then free themselves when the TTL runs out (a backend may give them
    /// back sooner, and says so).
    async fn acquire_many(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        acquire_each(self, keys, |key| self.acquire(key, ttl)).await
    }

    /// [`LockBackend::renew`] for many leases; one result per lease, in order.
    ///
    /// A batch holding a lease of another instance fails with
    /// [`LockError::ForeignLease`] and renews nothing: leases of two instances fail before
    /// any call, and of leases of one instance, the first call says whether they are
    /// foreign before anything changed.
    async fn renew_many(&self, leases: &[Lease]) -> Result<Vec<Renewal>, LockError> {
        one_instance(self.name(), leases)?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(self.renew(lease).await?);
        }
        Ok(out)
    }

    /// [`LockBackend::release`] for many leases; one result per lease, in order.
    ///
    /// A batch holding a lease of another instance fails with
    /// [`LockError::ForeignLease`] and releases nothing: leases of two instances fail
    /// before any call, and of leases of one instance, the first call says whether they
    /// are foreign before anything changed.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Release>, LockError> {
        one_instance(self.name(), leases)?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(self.release(lease).await?);
        }
        Ok(out)
    }
}

/// The first key of `keys` that `acquire` (one key's acquire) finds free, asked key by
/// key in order; `Ok(None)` when every key is held. A key that cannot be asked
/// ([`LockError::Unavailable`]: nothing was applied) is passed over, so one unreachable
/// node of a cluster does not refuse a free key on another; its error is returned only
/// when no other key was free. Any other error ends the call at once: after
/// [`LockError::OutcomeUnknown`] the key may have been taken, and asking on could take a
/// second one. The default of [`LockBackend::acquire_any`], and what a backend that
/// overrides it calls where its own one-request form cannot serve (a cluster whose keys
/// live on several nodes, say).
pub async fn acquire_first_free<'k, F, Fut>(
    keys: &'k [LockKey],
    mut acquire: F,
) -> Result<Option<Lease>, LockError>
where
    F: FnMut(&'k LockKey) -> Fut,
    Fut: Future<Output = Result<Option<Lease>, LockError>>,
{
    let mut unreachable = None;
    for key in keys {
        match acquire(key).await {
            Ok(Some(lease)) => return Ok(Some(lease)),
            Ok(None) => {}
            Err(e @ LockError::Unavailable { .. }) => {
                unreachable.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    unreachable.map_or(Ok(None), Err)
}

/// `acquire` (one key's acquire) for each of `keys` in turn; one result per key, in
/// order. If one fails, the keys already taken are given back with `backend`'s
/// [`release_many`](LockBackend::release_many) (best effort: one it cannot give back frees
/// itself when its TTL runs out) before the error is returned, so a failed batch holds
/// nothing. The default of [`LockBackend::acquire_many`], and what a backend calls whose
/// batch is one acquire after another.
pub async fn acquire_each<'k, B, F, Fut>(
    backend: &B,
    keys: &'k [LockKey],
    mut acquire: F,
) -> Result<Vec<Option<Lease>>, LockError>
where
    B: LockBackend + ?Sized,
    F: FnMut(&'k LockKey) -> Fut,
    Fut: Future<Output = Result<Option<Lease>, LockError>>,
{
    let mut out: Vec<Option<Lease>> = Vec::with_capacity(keys.len());
    for key in keys {
        match acquire(key).await {
            Ok(lease) => out.push(lease),
            Err(e) => {
                let taken: Vec<Lease> = out.into_iter().flatten().collect();
                let _ = backend.release_many(&taken).await;
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// What lets the default batch forms keep "a batch with a foreign lease changes nothing"
/// without knowing this instance's id: leases granted by two instances include a foreign
/// one, so the batch fails before acting; leases of one instance are all this backend's
/// or all foreign, and the single call on the first says which before anything changed.
/// `backend` is the name the error carries.
fn one_instance(backend: &'static str, leases: &[Lease]) -> Result<(), LockError> {
    match leases.split_first() {
        Some((first, rest)) if rest.iter().any(|l| l.backend_id() != first.backend_id()) => {
            Err(LockError::ForeignLease { backend })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;
    use crate::backend::lease::BackendId;

    fn keys(n: usize) -> Vec<LockKey> {
        (0..n)
            .map(|i| LockKey::new(format!("k:{i}")).unwrap())
            .collect()
    }

    /// `acquire_first_free` over keys whose acquires answer `answers` in turn; what it
    /// returns (`Some(i)`: key i was granted) and how many keys it asked.
    async fn first_free(
        answers: Vec<Result<bool, LockError>>,
    ) -> (Result<Option<String>, LockError>, usize) {
        let keys = keys(answers.len());
        let answers = Mutex::new(VecDeque::from(answers));
        let asked = Mutex::new(0);
        let id = BackendId::next();
        let got = acquire_first_free(&keys, |key| {
            *asked.lock().unwrap() += 1;
            let answer = answers.lock().unwrap().pop_front().unwrap();
            let lease = answer.map(|free| {
                free.then(|| {
                    let token = FencingToken(1);
                    Lease::adopted(
                        id,
                        key.clone(),
                        OwnerId::random(),
                        token,
                        Duration::from_secs(1),
                    )
                })
            });
            async move { lease }
        })
        .await;
        let asked = *asked.lock().unwrap();
        (got.map(|lease| lease.map(|l| l.key().to_string())), asked)
    }

    fn unreachable() -> LockError {
        LockError::unavailable("test", "node down")
    }

    #[tokio::test]
    async fn an_unreachable_key_is_passed_over_and_its_error_kept_for_when_none_is_free() {
        let (got, asked) = first_free(vec![Err(unreachable()), Ok(false), Ok(true)]).await;
        assert_eq!(got.unwrap().as_deref(), Some("k:2"));
        assert_eq!(asked, 3);

        let (got, asked) = first_free(vec![Ok(false), Err(unreachable()), Ok(false)]).await;
        assert!(matches!(got, Err(LockError::Unavailable { .. })), "{got:?}");
        assert_eq!(asked, 3);

        let (got, _) = first_free(vec![Ok(false), Ok(false)]).await;
        assert_eq!(got.unwrap(), None);
    }

    #[tokio::test]
    async fn a_key_whose_outcome_is_unknown_ends_the_call() {
        let unknown = LockError::outcome_unknown("test", "acquire", "reply lost");
        let (got, asked) = first_free(vec![Err(unknown), Ok(true)]).await;
        assert!(
            matches!(got, Err(LockError::OutcomeUnknown { .. })),
            "{got:?}"
        );
        assert_eq!(asked, 1, "a second key could be taken beside the first");
    }
}
