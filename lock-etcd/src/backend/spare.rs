//! Spare leases: leases granted ahead of the acquires that use them, so that the grant, a
//! consensus write, is off an acquire's path.
//!
//! # Single use
//!
//! A spare lease holds no key. An acquire takes one, and if its transaction puts the lock
//! key on it, the lease belongs to that lock alone: it is renewed with it and revoked when
//! it is released, so every lock still expires on its own when its holder stops renewing
//! it. A lease is never put back once a transaction that may have put a key on it was sent.
//! An acquire that did not use its lease (the name was held, the read failed, the call was
//! cancelled before the transaction went out) puts it back for the next acquire.
//!
//! # Fresh, not kept alive
//!
//! A spare lease is not kept alive while it waits: it is used only while it is younger
//! than an eighth of its TTL ([`max_age`]), and a lock taken on it is valid from when its
//! grant was sent (etcd counts the lease's TTL from later, when it grants it), so a lock
//! loses at most that eighth of its validity. An older spare is dropped: it holds no key
//! and lapses by itself within its TTL. Keep-alives for every waiting lease would cost a
//! request per lease and TTL whether or not an acquire comes.
//!
//! # When leases are granted
//!
//! A refused attempt writes nothing: it reads, and uses a spare only to put it back. So
//! without a spare, an acquire grants beside its read only when the last acquire of its
//! TTL in this process found its name free (the next one likely will too); after a refused
//! one it reads first and grants only for a free name (three round trips). After an
//! acquire that took a lock within [`max_age`] of the previous one of the same TTL, one
//! lease is granted in the background if fewer than [`SPARES_WANTED`] are waiting or being
//! granted: a process that takes locks now and then grants nothing ahead, so a lease
//! granted ahead is rarely left to lapse unused.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::{EtcdBackend, Inner};

/// Spares wanted per TTL, waiting or being granted, while acquires of that TTL come often.
pub(super) const SPARES_WANTED: usize = 2;

/// Spares kept per TTL: leases of refused acquires are put back up to this many; more are
/// revoked.
const SPARES_KEPT: usize = 16;

/// TTLs spares are kept for; the one used least recently gives way to a new one.
const TTLS_KEPT: usize = 4;

/// The age up to which a spare lease of `ttl` is used: an eighth of the TTL.
pub(super) fn max_age(ttl: Duration) -> Duration {
    ttl / 8
}

/// A lease granted with a lock's TTL, holding no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spare {
    pub(super) id: i64,
    /// When the grant was sent: the lease's TTL counts from later.
    pub(super) granted_from: Instant,
}

/// The spare leases of one backend, by TTL.
#[derive(Debug, Default)]
pub(super) struct Spares {
    shelves: Mutex<Vec<Shelf>>,
}

#[derive(Debug)]
struct Shelf {
    seconds: i64,
    ttl: Duration,
    /// Oldest first.
    leases: Vec<Spare>,
    granting: usize,
    last_taken: Instant,
    /// When an acquire last took a lock on a lease of this TTL.
    last_acquired: Option<Instant>,
    /// Whether the last acquire that got an answer found its name free.
    last_free: bool,
}

/// What [`Spares::take`] found.
#[derive(Debug)]
pub(super) struct Taken {
    /// A spare young enough to use, the youngest there was.
    pub(super) spare: Option<Spare>,
    /// Without a spare: whether to grant beside the read (the last acquire of the TTL
    /// found its name free) rather than after it.
    pub(super) grant_beside_read: bool,
}

impl Spares {
    fn shelves(&self) -> MutexGuard<'_, Vec<Shelf>> {
        self.shelves
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes the youngest spare of `seconds` younger than [`max_age`] at `now`, dropping
    /// older ones (they hold nothing and lapse).
    pub(super) fn take(&self, seconds: i64, ttl: Duration, now: Instant) -> Taken {
        let mut shelves = self.shelves();
        let at = match shelves.iter().position(|s| s.seconds == seconds) {
            Some(at) => at,
            None => {
                if shelves.len() == TTLS_KEPT
                    && let Some(oldest) = (0..shelves.len()).min_by_key(|&i| shelves[i].last_taken)
                {
                    shelves.swap_remove(oldest);
                }
                shelves.push(Shelf {
                    seconds,
                    ttl,
                    leases: Vec::new(),
                    granting: 0,
                    last_taken: now,
                    last_acquired: None,
                    last_free: false,
                });
                shelves.len() - 1
            }
        };
        let shelf = &mut shelves[at];
        shelf.last_taken = now;
        let young =
            |spare: &Spare| now.saturating_duration_since(spare.granted_from) < max_age(ttl);
        shelf.leases.retain(young);
        let spare = shelf.leases.pop();
        Taken {
            spare,
            grant_beside_read: spare.is_none() && shelf.last_free,
        }
    }

    /// Records what an acquire of `seconds` found: its name free (and taken) or held. After
    /// a lock taken soon after the previous one, says whether to grant a lease ahead
    /// ([`EtcdBackend::grant_ahead`]), counted as being granted.
    pub(super) fn found(&self, seconds: i64, free: bool, now: Instant) -> bool {
        let mut shelves = self.shelves();
        let Some(shelf) = shelves.iter_mut().find(|s| s.seconds == seconds) else {
            return false;
        };
        shelf.last_free = free;
        if !free {
            return false;
        }
        let often = shelf
            .last_acquired
            .is_some_and(|last| now.saturating_duration_since(last) < max_age(shelf.ttl));
        shelf.last_acquired = Some(now);
        let grant_ahead = often && shelf.leases.len() + shelf.granting < SPARES_WANTED;
        if grant_ahead {
            shelf.granting += 1;
        }
        grant_ahead
    }

    /// Puts back a lease no transaction may have put a key on. `false` when it is not
    /// kept (too old, or enough spares): the caller revokes it.
    pub(super) fn put_back(&self, seconds: i64, spare: Spare, now: Instant) -> bool {
        let mut shelves = self.shelves();
        let Some(shelf) = shelves.iter_mut().find(|s| s.seconds == seconds) else {
            return false;
        };
        if now.saturating_duration_since(spare.granted_from) >= max_age(shelf.ttl)
            || shelf.leases.len() >= SPARES_KEPT
        {
            return false;
        }
        let at = shelf
            .leases
            .partition_point(|s| s.granted_from <= spare.granted_from);
        shelf.leases.insert(at, spare);
        true
    }

    /// A grant ahead of `seconds` ended, whether or not it granted a lease.
    fn granted_ahead(&self, seconds: i64) {
        if let Some(shelf) = self.shelves().iter_mut().find(|s| s.seconds == seconds) {
            shelf.granting = shelf.granting.saturating_sub(1);
        }
    }

    /// The grants ahead under way now, for tests.
    #[cfg(test)]
    fn granting(&self, seconds: i64) -> usize {
        self.shelves()
            .iter()
            .find(|s| s.seconds == seconds)
            .map_or(0, |s| s.granting)
    }

    /// The spares waiting now, for tests.
    #[cfg(test)]
    pub(super) fn waiting(&self, seconds: i64) -> Vec<Spare> {
        self.shelves()
            .iter()
            .find(|s| s.seconds == seconds)
            .map(|s| s.leases.clone())
            .unwrap_or_default()
    }
}

/// A grant ahead under way: counted as being granted until dropped, also when its task is
/// dropped unfinished (its runtime shut down), so that later grants ahead are not held back.
struct GrantingAhead {
    inner: Weak<Inner>,
    seconds: i64,
}

impl Drop for GrantingAhead {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.spares.granted_ahead(self.seconds);
        }
    }
}

impl EtcdBackend {
    /// Grants one lease of `seconds` in the background and keeps it as a spare. The task
    /// holds the backend weakly: a backend dropped meanwhile leaves the lease to lapse.
    pub(super) fn grant_ahead(&self, ttl: Duration, seconds: i64) {
        let granting = GrantingAhead {
            inner: Arc::downgrade(&self.inner),
            seconds,
        };
        tokio::spawn(async move {
            let Some(backend) = granting.inner.upgrade().map(|inner| EtcdBackend { inner }) else {
                return;
            };
            let granted_from = Instant::now();
            let Ok(id) = backend.grant(ttl, seconds).await else {
                return;
            };
            drop(granting);
            let spare = Spare { id, granted_from };
            if !backend
                .inner
                .spares
                .put_back(seconds, spare, Instant::now())
            {
                backend.revoke_in_background(id);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(8);

    fn spare(id: i64, granted_from: Instant) -> Spare {
        Spare { id, granted_from }
    }

    #[test]
    fn a_spare_is_used_only_while_younger_than_an_eighth_of_its_ttl() {
        let spares = Spares::default();
        let t0 = Instant::now();
        assert_eq!(spares.take(8, TTL, t0).spare, None);
        assert!(spares.put_back(8, spare(1, t0), t0));
        assert!(spares.put_back(8, spare(2, t0 + Duration::from_millis(500)), t0));
        // At t0 + 1 s the first is an eighth of the TTL old: dropped; the second is used.
        let taken = spares.take(8, TTL, t0 + Duration::from_secs(1));
        assert_eq!(taken.spare, Some(spare(2, t0 + Duration::from_millis(500))));
        assert!(spares.waiting(8).is_empty());
        // Too old to be put back at all.
        assert!(!spares.put_back(8, spare(3, t0), t0 + Duration::from_secs(1)));
    }

    #[test]
    fn spares_of_one_ttl_are_not_used_for_another() {
        let spares = Spares::default();
        let t0 = Instant::now();
        spares.take(8, TTL, t0);
        assert!(spares.put_back(8, spare(1, t0), t0));
        assert_eq!(spares.take(9, Duration::from_secs(9), t0).spare, None);
        assert_eq!(spares.take(8, TTL, t0).spare, Some(spare(1, t0)));
    }

    #[test]
    fn leases_are_granted_ahead_only_while_locks_are_taken_often() {
        let spares = Spares::default();
        let t0 = Instant::now();
        spares.take(8, TTL, t0);
        assert!(!spares.found(8, true, t0), "a first lock");
        let soon = t0 + Duration::from_millis(10);
        assert!(spares.found(8, true, soon));
        assert!(spares.found(8, true, soon));
        assert!(
            !spares.found(8, true, soon),
            "{SPARES_WANTED} already being granted"
        );
        spares.granted_ahead(8);
        assert!(spares.found(8, true, soon), "one grant failed");
        assert!(!spares.found(8, false, soon), "a refused attempt");
        spares.granted_ahead(8);
        spares.granted_ahead(8);
        let later = soon + max_age(TTL);
        assert!(
            !spares.found(8, true, later),
            "a lock an eighth of the TTL after the last"
        );
    }

    #[test]
    fn without_a_spare_the_grant_goes_beside_the_read_only_after_a_free_name() {
        let spares = Spares::default();
        let t0 = Instant::now();
        assert!(!spares.take(8, TTL, t0).grant_beside_read, "no acquire yet");
        spares.found(8, true, t0);
        assert!(spares.take(8, TTL, t0).grant_beside_read);
        spares.found(8, false, t0);
        assert!(
            !spares.take(8, TTL, t0).grant_beside_read,
            "after a refusal"
        );
        spares.found(8, true, t0);
        assert!(spares.put_back(8, spare(1, t0), t0));
        let taken = spares.take(8, TTL, t0);
        assert_eq!(taken.spare, Some(spare(1, t0)));
        assert!(!taken.grant_beside_read, "a spare needs no grant");
    }

    /// A grant ahead whose task is dropped before it ran (its runtime shut down) is no
    /// longer counted as under way, so later locks are granted spares again.
    #[test]
    fn a_grant_ahead_dropped_with_its_runtime_does_not_hold_back_later_ones() {
        use harness::etcd::EtcdServer;
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (_server, backend) = runtime.block_on(async {
            let server = harness::require(EtcdServer::start().await);
            let backend = EtcdBackend::builder()
                .endpoint(server.endpoint())
                .build()
                .await
                .unwrap();
            (server, backend)
        });
        let spares = &backend.inner.spares;
        let t0 = Instant::now();
        spares.take(8, TTL, t0);
        spares.found(8, true, t0);
        assert!(spares.found(8, true, t0), "a lock soon after another");
        assert_eq!(spares.granting(8), 1);

        let short = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        short.block_on(async { backend.grant_ahead(TTL, 8) });
        drop(short);
        assert_eq!(spares.granting(8), 0, "the dropped grant is not under way");
        drop(runtime);
    }

    #[test]
    fn only_so_many_spares_are_kept() {
        let spares = Spares::default();
        let t0 = Instant::now();
        spares.take(8, TTL, t0);
        for id in 0..SPARES_KEPT {
            assert!(spares.put_back(8, spare(id as i64, t0), t0));
        }
        assert!(!spares.put_back(8, spare(99, t0), t0));
    }
}
