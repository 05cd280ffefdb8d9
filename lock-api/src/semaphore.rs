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

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;
use tracing::debug;

use crate::error::LockError;
use crate::guard::{LeaseStatus, LockGuard};
use crate::key::{FencingToken, LockKey};
use crate::lease::{LockInfo, Release};
use crate::locker::{Locker, run_while_held};
use crate::telemetry::Kind;
use crate::waiting::Waiting;

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
/// use distlock::{LockKey, Locker};
///
/// let locker = Locker::new(distlock::connect("memory://").await?)?;
/// // At most two exports of tenant 7 at once, across every worker.
/// let exports = locker.semaphore(&LockKey::new("exports:tenant-7")?, 2)?;
/// let first = exports.try_acquire().await?.expect("a free permit");
/// let second = exports.try_acquire().await?.expect("a free permit");
/// assert!(exports.try_acquire().await?.is_none()); // full: the job goes back to the queue
/// first.release().await?;
/// let rows = exports.with_permit(|permit| {
///     // Fence the export's writes under the permit's slot, not the semaphore's name:
///     // tokens rise per slot, and those of different slots are not ordered.
///     let (slot, token) = (permit.key().clone(), permit.token());
///     async move { 42 }
/// }).await?;
/// assert_eq!(rows, 42);
/// # drop(second);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    locker: Locker,
    name: LockKey,
    slots: Arc<[LockKey]>,
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
            .collect::<Result<Arc<[LockKey]>, LockError>>()?;
        Ok(Semaphore {
            locker: self.clone(),
            name: name.clone(),
            slots,
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
        u32::try_from(self.slots.len()).unwrap_or(MAX_PERMITS)
    }

    /// Its permit slots, `<name>:permit:0` onwards: the keys the store holds for its
    /// permits.
    pub fn slots(&self) -> &[LockKey] {
        &self.slots
    }

    /// Takes a permit if one is free, without waiting; `Ok(None)` when all are held.
    ///
    /// The slots are tried from a random one onwards, so that processes do not all
    /// contend for slot 0; one round trip per held slot where the store has no
    /// [`acquire_any`](crate::LockBackend::acquire_any) of its own.
    ///
    /// # Cancel safety
    /// As [`Locker::try_lock`]: if cancelled after the store granted a slot, the permit is
    /// not renewed and frees itself when its TTL runs out.
    pub async fn try_acquire(&self) -> Result<Option<Permit>, LockError> {
        let start = rand::random_range(0..self.slots.len());
        let order: Vec<LockKey> = self.slots[start..]
            .iter()
            .chain(&self.slots[..start])
            .cloned()
            .collect();
        let sent = Instant::now();
        let backend = self.locker.backend();
        let Some(lease) = backend.acquire_any(&order, self.locker.ttl()).await? else {
            return Ok(None);
        };
        if !self.slots.contains(lease.key()) {
            // Not one of ours: give it back rather than count it as a permit.
            let stray = lease.key().clone();
            if let Err(error) = backend.release(&lease).await {
                debug!(key = %stray, %error, "release of a key granted outside the slots failed");
            }
            return Err(LockError::Backend {
                backend: backend.name(),
                source: format!(
                    "acquire_any granted {stray}, which is not one of the keys asked for"
                )
                .into(),
            });
        }
        let slot = self.slot_of(lease.key());
        Ok(Some(Permit {
            guard: self.locker.guard(lease, sent, Kind::Permit),
            slot,
        }))
    }

    /// The index of `key` among the slots (a key [`Semaphore::try_acquire`] checked).
    fn slot_of(&self, key: &LockKey) -> u32 {
        let slot = self.slots.iter().position(|s| s == key).unwrap_or_default();
        u32::try_from(slot).unwrap_or_default()
    }

    /// Waits for a permit, up to the locker's wait timeout, as [`Locker::lock`] waits for a
    /// lock: where the backend announces releases, a freed permit wakes one waiter of the
    /// semaphore per process at once (each waiter watches every slot), and the locker's
    /// longest backoff is the fallback for a permit freed unannounced (an expired one);
    /// elsewhere it polls with jittered backoff. A `Timeout` names the semaphore.
    ///
    /// # Cancel safety
    /// As [`Locker::lock`]: a cancelled wait leaves no watch behind, and a permit granted
    /// as it was cancelled frees itself when its TTL runs out.
    pub async fn acquire(&self) -> Result<Permit, LockError> {
        let locker = &self.locker;
        let waiting = Waiting::any_of(locker.backend().as_ref(), &self.slots, locker.retry());
        let guard = locker
            .wait_for(
                &self.name,
                Kind::Permit,
                locker.wait_timeout(),
                waiting,
                || async { Ok(self.try_acquire().await?.map(|permit| permit.guard)) },
            )
            .await?;
        let slot = self.slot_of(guard.key());
        Ok(Permit { guard, slot })
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
        let mut out = Vec::with_capacity(self.slots.len());
        for slot in self.slots.iter() {
            out.push(backend.inspect(slot).await?);
        }
        Ok(out)
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name)
            .field("permits", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// One held permit of a [`Semaphore`]: a lease on one of its slots, renewed by the
/// locker's watchdog until released. Dropping it releases it in the background, as
/// dropping a [`LockGuard`] does.
///
/// **Its token** is its slot's fencing token: it strictly increases with every grant of
/// that slot, so a store downstream that fences per slot ([`Permit::key`]) rejects a
/// permit holder that lost its permit to another. Tokens of different slots are not
/// ordered against each other.
#[must_use = "a permit is released as soon as it is dropped"]
pub struct Permit {
    guard: LockGuard,
    slot: u32,
}

impl Permit {
    /// The slot this permit holds, from 0.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot's key: the name to fence the permit's writes under.
    pub fn key(&self) -> &LockKey {
        self.guard.key()
    }

    /// The slot's fencing token for this grant.
    pub fn token(&self) -> FencingToken {
        self.guard.token()
    }

    /// True until the permit is lost, released, or past its local validity deadline.
    pub fn is_held(&self) -> bool {
        self.guard.is_held()
    }

    /// The permit's status, to hand to the job's tasks ([`LeaseStatus::while_held`]).
    pub fn status(&self) -> LeaseStatus {
        self.guard.status()
    }

    /// The lease behind the permit, as a guard.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Stops renewal and gives the permit back. `Release::NotHeld` means it had already
    /// been lost.
    ///
    /// # Cancel safety
    /// As [`LockGuard::release`]: if dropped before the store answers, the permit frees
    /// itself when its TTL runs out.
    pub async fn release(self) -> Result<Release, LockError> {
        self.guard.release().await
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("key", self.key())
            .field("slot", &self.slot)
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish_non_exhaustive()
    }
}
