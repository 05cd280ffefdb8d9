//! [`Semaphore`] and [`Permit`]: at most N holders of a name at once, each holding a lease.
//!
//! A semaphore of N permits is N lock keys, its **permit slots** `<name>:permit:0` to
//! `<name>:permit:<N-1>`, and a permit is a lease on one free slot, taken with
//! [`LockBackend::acquire_any`](crate::LockBackend::acquire_any). Everything a lock
//! guarantees therefore holds for each permit: the store keeps no counter that a crashed
//! holder could leave short (a dead holder's slot frees itself when its TTL runs out),
//! release and renewal are owner-checked, the locker's watchdog renews it and reports it
//! lost, and the slot's fencing token strictly increases with every grant of that slot.
//! Nothing is kept for the semaphore as a whole, so nothing outlives its permits.

mod permit;
mod take;

pub use permit::{Permit, Permits};
#[doc(hidden)]
pub use take::first_asked;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::time::{Instant, sleep};

use crate::backend::lease::LockInfo;
use crate::error::LockError;
use crate::key::LockKey;
use crate::locker::waiting::Waiting;
use crate::locker::{Locker, run_while_held};
use crate::telemetry::Kind;
use take::{Taken, Taking};

/// The most permits a semaphore may have: each is a key the store keeps while held, and a
/// full semaphore's waiters watch every one of them.
pub const MAX_PERMITS: u32 = 1024;

/// A named limit of at most `permits` holders at once, on a [`Locker`]'s backend, TTL,
/// wait timeout and watchdog. Cheap to clone.
///
/// Built with [`Locker::semaphore`]. Every process that names the semaphore takes its
/// permits from the same slots; see [`Locker::semaphore`] for what happens when two of
/// them name different numbers of permits.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
/// use distlock::{EnforcementMode, FencedResourceExt, LockKey, Locker, MemoryFencedResource};
///
/// let locker = Locker::new(distlock::connect("memory://").await?)?;
/// let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
/// // At most two exports of tenant 7 at once, across every worker.
/// let exports = locker.semaphore(&LockKey::new("exports:tenant-7")?, 2)?;
/// let first = exports.try_acquire().await?.expect("a free permit");
/// let second = exports.try_acquire().await?.expect("a free permit");
/// assert!(exports.try_acquire().await?.is_none()); // full: the job goes back to the queue
/// first.release().await?;
/// assert_eq!(exports.available().await?, 1); // a snapshot, for dashboards
/// // Two at once, all or none: one is free, so none (and none left held).
/// assert!(exports.try_acquire_many(2).await?.is_none());
/// let written = exports.with_permit(|permit| {
///     // Fence the export's writes with the permit's fence (its slot's key and its token),
///     // not under the semaphore's name: tokens rise per slot, those of different slots
///     // are not ordered.
///     let (fence, ledger) = (permit.fence(), &ledger);
///     async move { ledger.write_under(&fence, b"rows 0-99").await }
/// }).await??;
/// assert!(written.is_admitted());
/// # drop(second);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    locker: Locker,
    name: LockKey,
    /// The permit slots twice over (`<name>:permit:0` to `N-1`, then again), so that the
    /// slots from any one onwards, wrapping to slot 0, are one slice of it: an attempt asks
    /// for them without copying N keys.
    ring: Arc<[LockKey]>,
}

impl Locker {
    /// A semaphore called `name` with `permits` permits (1 to [`MAX_PERMITS`]).
    ///
    /// Its permit slots are the keys `<name>:permit:<i>`; a locker refuses a lock of a
    /// name of that form ([`LockError::InvalidKey`]), which would be one of its permits.
    /// Fails with [`LockError::Config`] for zero or more than [`MAX_PERMITS`] permits, and
    /// with [`LockError::InvalidKey`] when a slot's name is longer than
    /// [`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES); nothing is sent.
    ///
    /// **Two processes that name different numbers of permits** share the slots they
    /// both name: one that names 3 takes only slots 0 to 2, one that names 5 takes any of
    /// 0 to 4. So at most the largest number named is ever held at once, and a process
    /// never takes a permit while its own number of slots is full. To lower a limit in a
    /// rolling deploy, lower it everywhere: the old processes keep to the old one.
    pub fn semaphore(&self, name: &LockKey, permits: u32) -> Result<Semaphore, LockError> {
        if permits == 0 || permits > MAX_PERMITS {
            return Err(LockError::Config(format!(
                "a semaphore needs 1 to {MAX_PERMITS} permits, not {permits}"
            )));
        }
        let slots = (0..permits)
            .map(|slot| LockKey::new(format!("{name}:permit:{slot}")))
            .collect::<Result<Vec<LockKey>, LockError>>()?;
        let ring = slots.iter().chain(&slots).cloned().collect();
        Ok(Semaphore {
            locker: self.clone(),
            name: name.clone(),
            ring,
        })
    }
}

impl Semaphore {
    /// The semaphore's name.
    pub fn name(&self) -> &LockKey {
        &self.name
    }

    /// How many permits it has.
    pub fn permits(&self) -> u32 {
        u32::try_from(self.slots().len()).unwrap_or(MAX_PERMITS)
    }

    /// Its permit slots, `<name>:permit:0` onwards: the keys the store holds for its
    /// permits.
    pub fn slots(&self) -> &[LockKey] {
        &self.ring[..self.ring.len() / 2]
    }

    /// Takes a permit if one is free, without waiting; `Ok(None)` when all are held.
    ///
    /// The slots are tried from a random one onwards, so that processes do not all
    /// contend for slot 0, except where the store keeps an index of them
    /// ([`Capabilities::permit_index`](crate::Capabilities::permit_index), Redis): there the
    /// lowest free slot is found in one look, and taken. One round trip per held slot
    /// where the store has no [`acquire_any`](crate::LockBackend::acquire_any) of its own.
    ///
    /// "All held" is what one atomic look saw on Redis (one script). Where the slots are
    /// asked one by one (advisory locks) or taken from a snapshot (etcd, the lease table),
    /// it is what the walk saw: while other holders move from slot to slot, a walk can
    /// find each slot held as it passes though one was free all along. `acquire` asks
    /// again; a caller of `try_acquire` that must not miss a free permit does too.
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped while the store is asked, the call finishes in a task of
    /// its own and gives back the slot it took, on every backend.
    pub async fn try_acquire(&self) -> Result<Option<Permit>, LockError> {
        Ok(self
            .take(1)
            .await?
            .and_then(|taken| taken.into_iter().next()))
    }

    /// Takes `k` permits if `k` are free, all or none, without waiting: `Ok(None)` when
    /// fewer than `k` are free (any it took on the way are given back first, so it never
    /// holds a partial set). Each permit is on its own slot with its own token.
    ///
    /// Fails with [`LockError::Config`] for `k` zero or above [`Semaphore::permits`];
    /// nothing is sent. It asks the store once per permit taken where the store has an
    /// [`acquire_any`](crate::LockBackend::acquire_any) of its own, and once per slot at
    /// most otherwise.
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped while the store is asked, the call finishes in a task of
    /// its own and gives back every slot it took, on every backend.
    pub async fn try_acquire_many(&self, k: u32) -> Result<Option<Permits>, LockError> {
        self.check_many(k)?;
        Ok(self.take(k).await?.map(Permits::new))
    }

    /// Waits for a permit, up to the locker's wait timeout, as [`Locker::lock`] waits for a
    /// lock: where the backend announces releases, a freed permit wakes one waiter of the
    /// semaphore per process at once (each waiter watches every slot), and the locker's
    /// longest backoff is the fallback for a permit freed unannounced (an expired one);
    /// elsewhere it polls with jittered backoff. A `Timeout` names the semaphore.
    ///
    /// **Not fair**: waiters are not served in the order they came. A freed permit goes
    /// to whichever attempt reaches the store first, a `try_acquire` caller included, so
    /// under a steady stream of takers a waiter can wait until its timeout; see the
    /// crate's README for what a waiter can expect.
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled wait leaves no watch behind, and an attempt in flight when
    /// it is cancelled finishes in a task of its own and gives back the slot it took, on
    /// every backend.
    pub async fn acquire(&self) -> Result<Permit, LockError> {
        self.acquire_within(self.locker.wait_timeout()).await
    }

    /// [`Semaphore::acquire`] with a wait of its own instead of the locker's wait timeout:
    /// `Err(LockError::Timeout)` naming the semaphore once `wait` has passed without a
    /// permit, holding nothing. The deadline holds even when a call to the store hangs.
    /// A zero `wait` still makes one attempt, which fails at its first await on the store
    /// (ask once with [`Semaphore::try_acquire`] instead); a wait too long to be a
    /// deadline ([`Duration::MAX`]) is [`LockError::Config`], nothing sent.
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`]; a wait that times out gives back what its last attempt
    /// took, as a cancelled one does.
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<Permit, LockError> {
        self.acquire_within(Some(wait)).await
    }

    /// Waits for `k` permits at once, all or none, up to the locker's wait timeout, as
    /// [`Semaphore::acquire`] waits for one: an attempt that finds fewer than `k` free
    /// gives back what it took and waits for a release. Fails with [`LockError::Config`]
    /// for `k` zero or above [`Semaphore::permits`], nothing sent.
    ///
    /// Not fair, and a caller asking for many is served after callers asking for few
    /// whenever fewer than `k` come free at once: under steady demand for single permits
    /// it can wait until its timeout.
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`]: nothing is left held, on every backend.
    pub async fn acquire_many(&self, k: u32) -> Result<Permits, LockError> {
        self.acquire_many_within(k, self.locker.wait_timeout())
            .await
    }

    /// [`Semaphore::acquire_many`] with a wait of its own (see
    /// [`Semaphore::acquire_timeout`]).
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire_many`]; a wait that times out leaves nothing held.
    pub async fn acquire_many_timeout(&self, k: u32, wait: Duration) -> Result<Permits, LockError> {
        self.acquire_many_within(k, Some(wait)).await
    }

    /// The number of permits free right now: the slots the store shows without a holder,
    /// read one by one with [`LockBackend::inspect`](crate::LockBackend::inspect) (one
    /// round trip per slot; [`LockError::Unsupported`] where the backend cannot inspect).
    ///
    /// **A snapshot**: it may be out of date before it returns (slots are read one after
    /// the other, and others take and release permits meanwhile), so it is for logs,
    /// metrics and dashboards, not a check before an acquire: take a permit with
    /// [`Semaphore::try_acquire`] instead. A slot whose holder died counts as held until
    /// its TTL runs out in the store.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn available(&self) -> Result<u32, LockError> {
        let free = self
            .holders()
            .await?
            .iter()
            .filter(|h| h.owner.is_none())
            .count();
        Ok(u32::try_from(free).unwrap_or(MAX_PERMITS))
    }

    /// Refuses a number of permits this semaphore can never grant at once.
    fn check_many(&self, k: u32) -> Result<(), LockError> {
        if k == 0 || k > self.permits() {
            return Err(LockError::Config(format!(
                "semaphore {} has {} permits: ask for 1 to {} at once, not {k}",
                self.name,
                self.permits(),
                self.permits()
            )));
        }
        Ok(())
    }

    /// One attempt at `k` permits (checked): all of them, or `None` holding nothing.
    async fn take(&self, k: u32) -> Result<Option<Vec<Permit>>, LockError> {
        Ok(self.attempt(k).await?.ok())
    }

    /// One attempt at `k` permits (checked): all of them, or how many it took and gave
    /// back because fewer than `k` were free.
    async fn attempt(&self, k: u32) -> Result<Result<Vec<Permit>, usize>, LockError> {
        let sent = Instant::now();
        let k = usize::try_from(k).unwrap_or(usize::MAX);
        let backend = self.locker.backend().clone();
        let leases = match Taking::new(backend, self.ring.clone(), k, self.locker.ttl()).await? {
            Taken::All(leases) => leases,
            Taken::TooFew { given_back } => return Ok(Err(given_back)),
        };
        Ok(Ok(leases
            .into_iter()
            .map(|lease| {
                let slot = self.slot_of(lease.key());
                Permit {
                    guard: self.locker.guard(lease, sent, Kind::Permit),
                    slot,
                }
            })
            .collect()))
    }

    /// The index of `key` among the slots (a key [`Taking`] checked: one of them).
    fn slot_of(&self, key: &LockKey) -> u32 {
        key.permit_slot()
            .and_then(|(_, slot)| slot.parse().ok())
            .unwrap_or_default()
    }

    /// [`Semaphore::acquire`] up to `wait` (`None`: no deadline).
    async fn acquire_within(&self, wait: Option<Duration>) -> Result<Permit, LockError> {
        let mut permits = self.wait_for(1, wait).await?;
        Ok(permits.pop().expect("one permit asked for, one granted"))
    }

    /// [`Semaphore::acquire_many`] up to `wait` (`None`: no deadline).
    async fn acquire_many_within(
        &self,
        k: u32,
        wait: Option<Duration>,
    ) -> Result<Permits, LockError> {
        self.check_many(k)?;
        Ok(Permits::new(self.wait_for(k, wait).await?))
    }

    /// Waits for `k` permits (checked) up to `wait`, as [`Locker::lock`] waits.
    ///
    /// An attempt that took some slots and gave them back (fewer than `k` free) waits
    /// the locker's growing jittered backoff before it says so: its own give-back is a
    /// release its watch hears, and would otherwise wake it at once, again and again.
    async fn wait_for(&self, k: u32, wait: Option<Duration>) -> Result<Vec<Permit>, LockError> {
        let locker = &self.locker;
        let waiting = Waiting::permits(locker.backend().as_ref(), self.slots(), locker.retry());
        let gave_back = AtomicU32::new(0);
        let attempt = || async {
            match self.attempt(k).await? {
                Ok(permits) => Ok(Some(permits)),
                Err(0) => Ok(None),
                Err(_) => {
                    let n = gave_back.fetch_add(1, Ordering::Relaxed);
                    sleep(locker.retry().backoff(n)).await;
                    Ok(None)
                }
            }
        };
        locker
            .wait_for(&self.name, Kind::Permit, wait, waiting, attempt)
            .await
    }

    /// Waits for a permit, runs the job under it, and releases it, as
    /// [`Locker::with_lock`] does with a lock: once the permit is lost the job is dropped
    /// before its next step and `Err(LockError::Lost)` is returned.
    ///
    /// # Cancel safety
    /// Cancelling drops the job and the permit (release on drop, best effort).
    pub async fn with_permit<F, Fut, T>(&self, job: F) -> Result<T, LockError>
    where
        F: FnOnce(&Permit) -> Fut,
        Fut: Future<Output = T>,
    {
        let permit = self.acquire().await?;
        let work = job(&permit);
        run_while_held(permit.guard, work).await
    }

    /// What the store says about each slot, in slot order: its holder, newest token and
    /// time left. A slot with no owner is a free permit.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    pub async fn holders(&self) -> Result<Vec<LockInfo>, LockError> {
        let backend = self.locker.backend();
        let mut out = Vec::with_capacity(self.slots().len());
        for slot in self.slots() {
            out.push(backend.inspect(slot).await?);
        }
        Ok(out)
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name)
            .field("permits", &self.slots().len())
            .finish_non_exhaustive()
    }
}
