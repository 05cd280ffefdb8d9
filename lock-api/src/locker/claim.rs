//! [`Claim`]: a lock taken by one process and held on by another, for a job that must
//! stay unique from the moment it is enqueued (its producer claims the key) until it has
//! started or finished (its worker resumes the claim); and the claim of a queue key that
//! replaces the claim of a job still queued ([`Locker::claim_replacing`]).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::backend::lease::{Lease, Renewal};
use crate::error::LockError;
use crate::key::{FencingToken, LockKey, OwnerId};
use crate::locker::guard::LockGuard;
use crate::locker::{Locker, refuse_permit_slot};
use crate::telemetry::Kind;

/// The prefix of the queue keys [`Locker::claim_replacing`] takes: `queued:<job key>`, a
/// key of its own for the time a job waits in its queue, never a running job's lock.
/// Public so that whatever names queue keys (distlock's tower layer, `queue_key`) and
/// what takes them agree on one prefix.
pub const QUEUE_KEY_PREFIX: &str = "queued:";

/// A key taken by [`Locker::claim`] and not renewed by anyone until a process resumes it
/// with [`Locker::resume`]: what a job's producer puts into the job, for its worker.
///
/// It carries the lease's owner id, which releases it: treat it as a secret of the job,
/// as the job's arguments are (it is not printed by `Debug`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    key: LockKey,
    owner: OwnerId,
    token: FencingToken,
}

impl Claim {
    /// The claimed key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token of the claim's lease, which a resumed guard keeps.
    pub fn token(&self) -> FencingToken {
        self.token
    }
}

impl Claim {
    /// The claim of a lease just granted.
    fn of(lease: &Lease) -> Self {
        Self {
            key: lease.key().clone(),
            owner: lease.owner(),
            token: lease.token(),
        }
    }
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Locker {
    /// Takes `key` for `ttl` and hands it over as a [`Claim`] instead of a guard: nothing
    /// renews it until a process [resumes](Locker::resume) it, so `ttl` must cover the
    /// time until then (a job's longest wait in its queue). `None` when the key is held
    /// (claimed for a job already enqueued: do not enqueue this one). A TTL the store
    /// cannot honour is an error before anything is sent.
    ///
    /// # Cancel safety
    /// As [`Locker::try_lock`]: dropped after the store granted it, the claim is lost and
    /// the key frees itself when `ttl` runs out.
    pub async fn claim(&self, key: &LockKey, ttl: Duration) -> Result<Option<Claim>, LockError> {
        refuse_permit_slot(key)?;
        self.backend().capabilities().check_ttl(ttl)?;
        let granted = self.backend().acquire(key, ttl).await?;
        Ok(granted.as_ref().map(Claim::of))
    }

    /// Goes on holding a [`Claim`] made by any process: renews its lease with this
    /// locker's TTL and returns a guard the watchdog renews from then on, with the claim's
    /// token, or `None` when the claim's lease has ended (its TTL ran out, or the key
    /// went to another holder since). Unsupported ([`LockError::Unsupported`]) on a
    /// backend whose leases carry a private handle (PostgreSQL advisory locks, bound to
    /// the session that took them).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before the renewal's reply, the claim is left as it was
    /// (renewed or not), to run out at its TTL or be resumed again.
    pub async fn resume(&self, claim: &Claim) -> Result<Option<LockGuard>, LockError> {
        let lease = self
            .backend()
            .adopt(&claim.key, claim.owner, claim.token, self.ttl())?;
        let sent = Instant::now();
        match self.backend().renew(&lease).await? {
            Renewal::Renewed { valid_until } => Ok(Some(self.guard(
                lease.with_valid_until(valid_until),
                sent,
                Kind::Lock,
            ))),
            Renewal::Lost => Ok(None),
            Renewal::Unreachable => Err(LockError::unavailable(
                self.backend().name(),
                format!(
                    "the store did not answer the renewal of the claim on {}",
                    claim.key
                ),
            )),
        }
    }

    /// Claims the queue key `key` (`queued:<job key>`) for `ttl` as [`Locker::claim`]
    /// does, and when another producer's claim holds it, ends that claim first: the
    /// job enqueued under it is superseded by this one, what sidekiq-unique-jobs calls
    /// `on_conflict: :replace`. The superseded job stays in its queue; its worker, under
    /// `LockLayer::claimed(.., Until::ExecutingOrReplaced)` (the `distlock` facade), finds
    /// a newer claim on the key and drops it as done without running it.
    ///
    /// The store has no "replace": the claim it finds is ended with an owner-checked
    /// release of that very lease (its owner id and token, read with
    /// [`LockBackend::inspect`](crate::LockBackend::inspect)), and the key then acquired
    /// as by [`Locker::claim`]. So the new claim's token is above the superseded one's by
    /// the store's fencing contract (every grant's token is above every earlier grant's
    /// of the key, across releases), and the store's mutual exclusion holds throughout:
    /// two claims of one key are never held at once. (A
    /// [`purge`](crate::LockBackend::purge) would delete the key's token with it: on a
    /// store that keeps tokens only as counters, the memory store's, the next claim's
    /// token would start again at 1, no higher than the one it supersedes.)
    ///
    /// The release and the acquire are two requests, and another producer may take the
    /// key between them: `None` then, and nothing was claimed. Of several replacers that
    /// find one claim, at most one gets the key (the release of that claim succeeds once,
    /// and the acquire after it once); the others get `None`, and may call again to
    /// replace the winner's claim in turn. A replacer that calls after another's has
    /// returned replaces that one's claim, so the last job enqueued is the one that runs.
    /// A worker that checks the superseded job's claim between the two requests finds it
    /// ended with no newer claim and runs the job, as it would have had it checked a
    /// moment earlier.
    ///
    /// Only queue keys: a name that does not start with `queued:` is refused with
    /// [`LockError::InvalidKey`], as is a permit slot's name (see [`Locker::claim`]),
    /// before anything is sent. What holds a job's own key is its lock (a running job's,
    /// or under `Until::Executed` the claim the running job resumed as its lock), and
    /// ending it would let a second run of the key start beside the first; only a claim
    /// that guards a job's wait in its queue, not its run (`Until::Executing`,
    /// `Until::ExecutingOrReplaced`), may be taken over, and those live on the job's
    /// queue key. Keep every lock and `Until::Executed` job key out of the `queued:`
    /// names.
    ///
    /// A TTL the store cannot honour is [`LockError::InvalidTtl`], and a store that
    /// cannot inspect a key or adopt a lease (PostgreSQL advisory locks)
    /// [`LockError::Unsupported`], both before anything is sent.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// use distlock::{LockKey, Locker};
    ///
    /// let locker = Locker::new(distlock::connect("memory://").await?)?;
    /// let queued = LockKey::new("queued:report:7")?;
    /// let ttl = Duration::from_secs(600);
    /// let first = locker.claim(&queued, ttl).await?.expect("a free key");
    /// // A newer report 7: it replaces the one in the queue.
    /// let newer = locker.claim_replacing(&queued, ttl).await?.expect("replaced");
    /// assert!(newer.token() > first.token());
    /// assert!(locker.resume(&first).await?.is_none(), "the first claim has ended");
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// As [`Locker::claim`]. Dropped after the release but before the acquire, the
    /// superseded claim has ended and none was taken: the superseded job then runs as one
    /// whose claim ran out.
    pub async fn claim_replacing(
        &self,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Claim>, LockError> {
        refuse_permit_slot(key)?;
        if !key.as_str().starts_with(QUEUE_KEY_PREFIX) {
            return Err(LockError::InvalidKey {
                reason: format!(
                    "{key} is not a queue key ({QUEUE_KEY_PREFIX}<job key>): a claim is \
                     replaced only on the key a job holds while it waits in its queue"
                ),
            });
        }
        let backend = self.backend();
        let capabilities = backend.capabilities();
        capabilities.check_ttl(ttl)?;
        let unsupported = |operation| LockError::Unsupported {
            operation,
            backend: backend.name(),
        };
        if !capabilities.inspect {
            return Err(unsupported("inspect"));
        }
        if backend.adopts_as().is_none() {
            return Err(unsupported("adopt"));
        }
        if let Some(lease) = backend.acquire(key, ttl).await? {
            return Ok(Some(Claim::of(&lease)));
        }
        let found = backend.inspect(key).await?;
        if let (Some(owner), Some(token)) = (found.owner, found.token) {
            let superseded = backend.adopt(key, owner, token, ttl)?;
            // `NotHeld`: it ran out, or another replacer ended it first; either way the
            // acquire below says whether this one gets the key.
            backend.release(&superseded).await?;
        }
        let granted = backend.acquire(key, ttl).await?;
        Ok(granted.as_ref().map(Claim::of))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{Claim, QUEUE_KEY_PREFIX};
    use crate::backend::LockBackend;
    use crate::backend::lease::Capabilities;
    use crate::error::LockError;
    use crate::key::LockKey;
    use crate::layer::Layered;
    use crate::locker::Locker;
    use crate::memory::{Faults, MemoryBackend};

    const TTL: Duration = Duration::from_secs(60);

    fn queued(job: &str) -> LockKey {
        LockKey::new(format!("{QUEUE_KEY_PREFIX}{job}")).unwrap()
    }

    fn locker(backend: impl LockBackend) -> Locker {
        Locker::new(Arc::new(backend)).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_replacing_claim_supersedes_the_queued_one_under_a_higher_token() {
        let store = MemoryBackend::new();
        let (producer, worker) = (locker(store.client()), locker(store.client()));
        let key = queued("report:1");
        let first = producer
            .claim(&key, TTL)
            .await
            .unwrap()
            .expect("a free key");
        assert!(producer.claim(&key, TTL).await.unwrap().is_none());

        let newer = producer
            .claim_replacing(&key, TTL)
            .await
            .unwrap()
            .expect("the queued job's claim replaced");
        assert!(newer.token() > first.token(), "{newer:?} after {first:?}");
        let found = store.inspect(&key).await.unwrap();
        assert_eq!(found.owner, Some(newer.owner));
        assert_eq!(found.token, Some(newer.token()));
        // The superseded claim has ended; the newer one holds as any claim does.
        assert!(worker.resume(&first).await.unwrap().is_none());
        let resumed = worker
            .resume(&newer)
            .await
            .unwrap()
            .expect("the newer claim");
        assert_eq!(resumed.token(), newer.token());
        resumed.release().await.unwrap();

        // A free key, and one whose claim ran out, are claimed as `claim` does.
        let free = producer.claim_replacing(&queued("report:2"), TTL).await;
        assert!(free.unwrap().is_some());
        let short = Duration::from_millis(100);
        let lapsed = producer.claim(&key, short).await.unwrap().unwrap();
        tokio::time::advance(short * 2).await;
        let after = producer.claim_replacing(&key, TTL).await.unwrap().unwrap();
        assert!(after.token() > lapsed.token());
    }

    #[tokio::test(start_paused = true)]
    async fn of_replacers_racing_for_one_claim_one_gets_the_key() {
        let store = MemoryBackend::new();
        let key = queued("report:3");
        let first = locker(store.client())
            .claim(&key, TTL)
            .await
            .unwrap()
            .unwrap();
        // Every call of each replacer takes 1 ms: their requests go in step, so all of
        // them find the first claim and release it (all but one find it released), then
        // all acquire.
        let replacer = || {
            let slow = Arc::new(Faults::default());
            slow.delay(Duration::from_millis(1));
            locker(Layered::new(Arc::new(store.client()), slow))
        };
        let replacers = [replacer(), replacer(), replacer()];
        let raced = futures::future::join_all(
            replacers
                .iter()
                .map(|replacer| replacer.claim_replacing(&key, TTL)),
        )
        .await;
        let won: Vec<Claim> = raced.into_iter().filter_map(|r| r.unwrap()).collect();
        assert_eq!(won.len(), 1, "{won:?}");
        let found = store.inspect(&key).await.unwrap();
        assert_eq!(found.owner, Some(won[0].owner));
        assert!(won[0].token() > first.token());
        // The loser may call again: it replaces the winner's claim in turn.
        let again = replacers[0].claim_replacing(&key, TTL).await.unwrap();
        let again = again.expect("the winner's claim replaced");
        assert!(again.token() > won[0].token());
        assert_eq!(store.inspect(&key).await.unwrap().owner, Some(again.owner));
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_not_a_queue_key_or_a_ttl_the_store_takes_is_refused_before_sending() {
        let store = MemoryBackend::new();
        let counted = Arc::new(Faults::default());
        let producer = locker(Layered::new(Arc::new(store.client()), counted.clone()));
        // A job's own key, held as its lock: never taken over.
        let job_key = LockKey::new("report:4").unwrap();
        let lock = producer.try_lock(&job_key).await.unwrap().unwrap();
        let sent = counted.calls();
        let refused = producer.claim_replacing(&job_key, TTL).await;
        assert!(
            matches!(refused, Err(LockError::InvalidKey { .. })),
            "{refused:?}"
        );
        let slot = queued("report:4:permit:0");
        let refused = producer.claim_replacing(&slot, TTL).await;
        assert!(
            matches!(refused, Err(LockError::InvalidKey { .. })),
            "{refused:?}"
        );
        for ttl in [
            Duration::ZERO,
            Duration::from_micros(1500),
            Duration::from_secs(2 * 24 * 3600),
        ] {
            let refused = producer.claim_replacing(&queued("report:4"), ttl).await;
            assert!(
                matches!(refused, Err(LockError::InvalidTtl { .. })),
                "{ttl:?}: {refused:?}"
            );
        }
        assert_eq!(counted.calls(), sent, "a refused call reached the store");
        let still = store.inspect(&job_key).await.unwrap();
        assert!(still.owner.is_some(), "the job's lock was ended");
        assert_eq!(still.token, Some(lock.token()));

        // A store that cannot show who holds a key: nothing to replace by.
        let blind = MemoryBackend::with_capabilities(Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(3),
            Duration::from_secs(3600),
        ));
        let counted = Arc::new(Faults::default());
        let producer = locker(Layered::new(Arc::new(blind), counted.clone()));
        let refused = producer.claim_replacing(&queued("report:4"), TTL).await;
        assert!(
            matches!(
                refused,
                Err(LockError::Unsupported {
                    operation: "inspect",
                    ..
                })
            ),
            "{refused:?}"
        );
        assert_eq!(counted.calls(), 0);
    }
}
