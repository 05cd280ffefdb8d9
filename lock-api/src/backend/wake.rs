//! Waking waiters when a key is released, so that [`crate::Locker::lock`] waits on a
//! notification instead of polling the store.
//!
//! A backend that can hear releases (Redis pub/sub, an etcd watch, PostgreSQL `NOTIFY`)
//! keeps one [`ReleaseHub`] per process and hands out [`ReleaseWatch`]es from
//! [`crate::LockBackend::watch_releases`]. The hub counts the watchers of each key and
//! tells the backend, through its [`Subscriptions`], when a key gains its first watcher or
//! loses its last, so the store sees one subscription per key per process however many
//! tasks wait. When the backend hears a release it calls [`ReleaseHub::notify`], which
//! wakes **one** watcher of that key in this process: one store call per process per
//! release, not one per waiter. A watcher dropped after it was woken but before it acted
//! passes the wake on to the next one.
//!
//! The task that hears the releases is a [`ReleaseListener`], the same for every store:
//! the backend says only how it follows its store over one connection ([`FollowReleases`]).
//!
//! A notification is a hint, never a grant: the woken waiter still has to acquire, and
//! waiters keep their backoff as a fallback, so a lost message (a reconnect, a dropped
//! packet, a release the store did not announce such as a TTL expiry) delays a waiter by
//! at most one backoff step and never strands it.

mod background;
mod listener;

pub use background::Background;
pub use listener::{FollowReleases, Followed, ReleaseListener, Releases};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::key::LockKey;

/// What a backend does when the set of watched keys changes: subscribe to a key's
/// release channel on its first watcher, unsubscribe after its last.
///
/// Called with the hub's lock released, from the task that created or dropped the
/// watch; it must not block (send the change to the backend's listener task).
pub trait Subscriptions: Send + Sync + 'static {
    /// `key` gained its first watcher in this process.
    fn subscribe(&self, key: &LockKey);
    /// `key` lost its last watcher in this process.
    fn unsubscribe(&self, key: &LockKey);
}

/// Subscriptions for a backend whose listener hears every key's releases without asking
/// per key (one pattern subscription, or an in-process store).
#[derive(Clone, Copy, Debug, Default)]
pub struct AllKeys;

impl Subscriptions for AllKeys {
    fn subscribe(&self, _: &LockKey) {}
    fn unsubscribe(&self, _: &LockKey) {}
}

/// The watchers of every key in one process, and the wakes sent to them.
#[derive(Clone)]
pub struct ReleaseHub {
    inner: Arc<HubInner>,
}

struct HubInner {
    watched: Mutex<Watched>,
    subscriptions: Box<dyn Subscriptions>,
}

/// What the hub's lock guards: the watched keys, and the semaphores watched as one.
#[derive(Default)]
struct Watched {
    keys: HashMap<LockKey, KeyWatch>,
    semaphores: HashMap<Semaphore, GroupWatch>,
}

/// A semaphore's slots as [`ReleaseHub::watch_permits`] names them: its first slot and
/// how many there are.
type Semaphore = (LockKey, usize);

/// One key's watchers, and the semaphores whose slot it is and that are watched.
struct KeyWatch {
    watchers: usize,
    notify: Arc<Notify>,
    semaphores: Vec<Semaphore>,
}

/// One semaphore's watchers (each watches every slot at once), and the slots they watch.
struct GroupWatch {
    watchers: usize,
    notify: Arc<Notify>,
    slots: Arc<[LockKey]>,
}

/// What one [`ReleaseWatch`] watches.
#[derive(Clone, Debug)]
enum Target {
    Key(LockKey),
    Permits(Semaphore),
}

impl fmt::Debug for ReleaseHub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseHub")
            .field("watched_keys", &self.watched_keys())
            .finish()
    }
}

impl Watched {
    /// Counts one more interest in `key` (a watcher, or a watched semaphore it is a slot
    /// of); `true` when it is the first, and the key is to be subscribed to.
    fn enter(&mut self, key: &LockKey) -> (&mut KeyWatch, bool) {
        let mut first = false;
        let watch = self.keys.entry(key.clone()).or_insert_with(|| {
            first = true;
            KeyWatch {
                watchers: 0,
                notify: Arc::new(Notify::new()),
                semaphores: Vec::new(),
            }
        });
        (watch, first)
    }

    /// Drops the key's entry once nothing watches it; `true` when it is to be unsubscribed.
    fn leave(&mut self, key: &LockKey) -> bool {
        let idle = self
            .keys
            .get(key)
            .is_some_and(|w| w.watchers == 0 && w.semaphores.is_empty());
        if idle {
            self.keys.remove(key);
        }
        idle
    }
}

impl ReleaseHub {
    /// A hub that tells `subscriptions` which keys are watched.
    pub fn new(subscriptions: impl Subscriptions) -> Self {
        Self {
            inner: Arc::new(HubInner {
                watched: Mutex::new(Watched::default()),
                subscriptions: Box::new(subscriptions),
            }),
        }
    }

    /// Starts watching `key`. Releases announced from now on wake the watch (or another
    /// watcher of the same key in this process).
    pub fn watch(&self, key: &LockKey) -> ReleaseWatch {
        let (notify, first) = {
            let mut watched = self.inner.watched.lock();
            let (watch, first) = watched.enter(key);
            watch.watchers += 1;
            (watch.notify.clone(), first)
        };
        if first {
            self.inner.subscriptions.subscribe(key);
        }
        ReleaseWatch {
            hub: self.clone(),
            target: Target::Key(key.clone()),
            notify,
        }
    }

    /// Starts watching every slot of a semaphore at once, with one watch: `slots` are its
    /// permit slots in order (`<name>:permit:0` to `<name>:permit:<N-1>`, see
    /// [`crate::LockBackend::watch_permit_releases`]). A release of any slot wakes one
    /// watcher of the semaphore in this process (and one of the slot's own
    /// [`Self::watch`]ers, if it has some).
    ///
    /// The slots are subscribed to when the semaphore gains its first watcher and
    /// unsubscribed from after its last, as a key is: work proportional to N once, not per
    /// watcher. Semaphores are told apart by their first slot and N, so two
    /// [`crate::Semaphore`]s of one name with different N in one process are watched apart.
    pub fn watch_permits(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        let semaphore: Semaphore = (slots.first()?.clone(), slots.len());
        let mut subscribe = Vec::new();
        let notify = {
            let mut watched = self.inner.watched.lock();
            if let Some(group) = watched.semaphores.get_mut(&semaphore) {
                group.watchers += 1;
                group.notify.clone()
            } else {
                for slot in slots {
                    let (watch, first) = watched.enter(slot);
                    watch.semaphores.push(semaphore.clone());
                    if first {
                        subscribe.push(slot.clone());
                    }
                }
                let notify = Arc::new(Notify::new());
                watched.semaphores.insert(
                    semaphore.clone(),
                    GroupWatch {
                        watchers: 1,
                        notify: notify.clone(),
                        slots: slots.into(),
                    },
                );
                notify
            }
        };
        for slot in &subscribe {
            self.inner.subscriptions.subscribe(slot);
        }
        Some(ReleaseWatch {
            hub: self.clone(),
            target: Target::Permits(semaphore),
            notify,
        })
    }

    /// `key` was released (or may have been): wakes one of its watchers in this process,
    /// and one watcher of each watched semaphore it is a slot of. A key nobody watches is
    /// ignored.
    pub fn notify(&self, key: &LockKey) {
        let notifies: Vec<Arc<Notify>> = {
            let watched = self.inner.watched.lock();
            let Some(watch) = watched.keys.get(key) else {
                return;
            };
            let own = (watch.watchers > 0).then(|| watch.notify.clone());
            own.into_iter()
                .chain(
                    watch
                        .semaphores
                        .iter()
                        .filter_map(|s| watched.semaphores.get(s).map(|g| g.notify.clone())),
                )
                .collect()
        };
        for notify in notifies {
            notify.notify_one();
        }
    }

    /// Wakes one watcher of every watched key and semaphore: after a reconnect, when
    /// releases may have been missed, so each waiter looks at the store again.
    pub fn notify_all(&self) {
        let notifies: Vec<Arc<Notify>> = {
            let watched = self.inner.watched.lock();
            let keys = watched.keys.values().filter(|w| w.watchers > 0);
            keys.map(|w| w.notify.clone())
                .chain(watched.semaphores.values().map(|g| g.notify.clone()))
                .collect()
        };
        for notify in notifies {
            notify.notify_one();
        }
    }

    /// How many watchers `key` has in this process, counting those of the watched
    /// semaphores it is a slot of. A backend whose releases are announced only when an
    /// attempt has marked the key waited for (Redis) asks this when it grants the key: a
    /// release wakes one watcher per process, and the others, asleep in their backoff,
    /// make no attempt that would mark the key the woken one is granted.
    pub fn watchers(&self, key: &LockKey) -> usize {
        let watched = self.inner.watched.lock();
        watched.keys.get(key).map_or(0, |w| {
            let of_semaphores = w
                .semaphores
                .iter()
                .filter_map(|s| watched.semaphores.get(s));
            w.watchers + of_semaphores.map(|g| g.watchers).sum::<usize>()
        })
    }

    /// The keys with at least one watcher (their own, or a watched semaphore's): what a
    /// listener subscribes to again after a reconnect.
    pub fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.watched.lock().keys.keys().cloned().collect()
    }

    fn unwatch(&self, target: &Target) {
        let mut unsubscribe = Vec::new();
        {
            let mut watched = self.inner.watched.lock();
            match target {
                Target::Key(key) => {
                    if let Some(watch) = watched.keys.get_mut(key) {
                        watch.watchers -= 1;
                    }
                    if watched.leave(key) {
                        unsubscribe.push(key.clone());
                    }
                }
                Target::Permits(semaphore) => {
                    let Some(group) = watched.semaphores.get_mut(semaphore) else {
                        return;
                    };
                    group.watchers -= 1;
                    if group.watchers == 0 {
                        let slots = watched
                            .semaphores
                            .remove(semaphore)
                            .map(|g| g.slots)
                            .unwrap_or_default();
                        for slot in slots.iter() {
                            if let Some(watch) = watched.keys.get_mut(slot) {
                                watch.semaphores.retain(|s| s != semaphore);
                            }
                            if watched.leave(slot) {
                                unsubscribe.push(slot.clone());
                            }
                        }
                    }
                }
            }
        }
        for key in &unsubscribe {
            self.inner.subscriptions.unsubscribe(key);
        }
    }
}

/// One waiter's interest in the releases of one key, or of a semaphore's slots; dropping
/// it ends the interest (the backend unsubscribes when the last watcher of a key goes).
#[must_use = "a watch does nothing unless awaited"]
pub struct ReleaseWatch {
    hub: ReleaseHub,
    target: Target,
    notify: Arc<Notify>,
}

impl fmt::Debug for ReleaseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseWatch")
            .field("key", self.key())
            .finish()
    }
}

impl ReleaseWatch {
    /// The watched key (a semaphore's first slot, for a watch of its slots).
    pub fn key(&self) -> &LockKey {
        match &self.target {
            Target::Key(key) | Target::Permits((key, _)) => key,
        }
    }

    /// Resolves when a release of the key (of any slot, for a semaphore's) is announced
    /// (possibly one announced since the last call, and possibly spuriously: the caller
    /// checks the store).
    ///
    /// # Cancel safety
    /// Cancel safe: a wake received by a cancelled call is passed to another watcher of
    /// the key, or kept for the next call.
    pub async fn released(&mut self) {
        self.notify.notified().await;
    }
}

impl Drop for ReleaseWatch {
    fn drop(&mut self) {
        self.hub.unwatch(&self.target);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[derive(Default)]
    struct Counting {
        subscribed: AtomicUsize,
        unsubscribed: AtomicUsize,
    }

    impl Subscriptions for Arc<Counting> {
        fn subscribe(&self, _: &LockKey) {
            self.subscribed.fetch_add(1, Ordering::SeqCst);
        }
        fn unsubscribe(&self, _: &LockKey) {
            self.unsubscribed.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    async fn woken(watch: &mut ReleaseWatch) -> bool {
        tokio::time::timeout(Duration::from_millis(50), watch.released())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn one_subscription_per_key_however_many_watchers() {
        let counts = Arc::new(Counting::default());
        let hub = ReleaseHub::new(counts.clone());
        let watches: Vec<_> = (0..16).map(|_| hub.watch(&key("job:1"))).collect();
        let other = hub.watch(&key("job:2"));
        assert_eq!(counts.subscribed.load(Ordering::SeqCst), 2);
        drop(watches);
        assert_eq!(counts.unsubscribed.load(Ordering::SeqCst), 1);
        drop(other);
        assert_eq!(counts.unsubscribed.load(Ordering::SeqCst), 2);
        assert!(hub.watched_keys().is_empty());
    }

    #[test]
    fn watchers_counts_the_watches_of_each_key_until_they_are_dropped() {
        let hub = ReleaseHub::new(AllKeys);
        let (a, b) = (hub.watch(&key("job:1")), hub.watch(&key("job:1")));
        let other = hub.watch(&key("job:2"));
        assert_eq!(hub.watchers(&key("job:1")), 2);
        assert_eq!(hub.watchers(&key("job:2")), 1);
        assert_eq!(hub.watchers(&key("job:3")), 0);
        drop(a);
        assert_eq!(hub.watchers(&key("job:1")), 1);
        drop((b, other));
        assert_eq!(hub.watchers(&key("job:1")), 0);
        assert_eq!(hub.watchers(&key("job:2")), 0);
    }

    #[tokio::test]
    async fn a_release_wakes_one_watcher_and_not_the_other_keys() {
        let hub = ReleaseHub::new(AllKeys);
        let mut a = hub.watch(&key("job:1"));
        let mut b = hub.watch(&key("job:1"));
        let mut other = hub.watch(&key("job:2"));
        hub.notify(&key("job:1"));
        let woke = [woken(&mut a).await, woken(&mut b).await];
        assert_eq!(woke.iter().filter(|w| **w).count(), 1, "{woke:?}");
        assert!(!woken(&mut other).await);
    }

    #[tokio::test]
    async fn a_release_before_the_wait_is_not_missed() {
        let hub = ReleaseHub::new(AllKeys);
        let mut watch = hub.watch(&key("job:1"));
        hub.notify(&key("job:1"));
        assert!(woken(&mut watch).await);
    }

    #[tokio::test]
    async fn a_cancelled_wait_passes_its_wake_on() {
        let hub = ReleaseHub::new(AllKeys);
        let mut first = hub.watch(&key("job:1"));
        let mut second = hub.watch(&key("job:1"));
        {
            let waiting = first.released();
            tokio::pin!(waiting);
            // Registered as a waiter, then woken, then dropped without acting.
            assert!(futures::poll!(waiting.as_mut()).is_pending());
            hub.notify(&key("job:1"));
        }
        assert!(woken(&mut second).await);
    }

    #[tokio::test]
    async fn notify_all_wakes_every_watched_key() {
        let hub = ReleaseHub::new(AllKeys);
        let mut a = hub.watch(&key("job:1"));
        let mut b = hub.watch(&key("job:2"));
        hub.notify_all();
        assert!(woken(&mut a).await);
        assert!(woken(&mut b).await);
    }

    fn slots(name: &str, n: usize) -> Vec<LockKey> {
        (0..n).map(|i| key(&format!("{name}:permit:{i}"))).collect()
    }

    #[test]
    fn a_semaphores_watchers_share_one_subscription_per_slot() {
        let counts = Arc::new(Counting::default());
        let hub = ReleaseHub::new(counts.clone());
        let slots = slots("exports", 4);
        let watches: Vec<_> = (0..16)
            .map(|_| hub.watch_permits(&slots).unwrap())
            .collect();
        assert_eq!(counts.subscribed.load(Ordering::SeqCst), 4);
        let own = hub.watch(&slots[2]);
        assert_eq!(counts.subscribed.load(Ordering::SeqCst), 4);
        assert_eq!(hub.watched_keys().len(), 4);
        drop(watches);
        assert_eq!(counts.unsubscribed.load(Ordering::SeqCst), 3);
        assert_eq!(hub.watched_keys(), vec![slots[2].clone()]);
        drop(own);
        assert_eq!(counts.unsubscribed.load(Ordering::SeqCst), 4);
        assert!(hub.watched_keys().is_empty());
        assert!(hub.watch_permits(&[]).is_none());
    }

    #[tokio::test]
    async fn a_release_of_any_slot_wakes_one_watcher_of_the_semaphore() {
        let hub = ReleaseHub::new(AllKeys);
        let slots = slots("exports", 4);
        let mut a = hub.watch_permits(&slots).unwrap();
        let mut b = hub.watch_permits(&slots).unwrap();
        let mut other = hub.watch(&key("job:1"));
        hub.notify(&slots[3]);
        let woke = [woken(&mut a).await, woken(&mut b).await];
        assert_eq!(woke.iter().filter(|w| **w).count(), 1, "{woke:?}");
        assert!(!woken(&mut other).await);
        hub.notify(&key("exports:permit:4"));
        assert!(!woken(&mut a).await && !woken(&mut b).await);
        hub.notify_all();
        let woke = [woken(&mut a).await, woken(&mut b).await];
        assert_eq!(woke.iter().filter(|w| **w).count(), 1, "{woke:?}");
    }

    #[tokio::test]
    async fn semaphores_of_one_name_and_different_sizes_are_watched_apart() {
        let hub = ReleaseHub::new(AllKeys);
        let mut small = hub.watch_permits(&slots("exports", 2)).unwrap();
        let mut large = hub.watch_permits(&slots("exports", 8)).unwrap();
        let mut slot = hub.watch(&key("exports:permit:1"));
        hub.notify(&key("exports:permit:5"));
        assert!(!woken(&mut small).await);
        assert!(woken(&mut large).await);
        assert!(!woken(&mut slot).await);
        hub.notify(&key("exports:permit:1"));
        assert!(woken(&mut small).await);
        assert!(woken(&mut large).await);
        assert!(woken(&mut slot).await);
        drop(large);
        assert_eq!(hub.watched_keys().len(), 2);
    }

    #[test]
    fn watchers_of_a_slot_count_the_semaphores_watchers() {
        let hub = ReleaseHub::new(AllKeys);
        let slots = slots("exports", 3);
        let group = [hub.watch_permits(&slots), hub.watch_permits(&slots)];
        let own = hub.watch(&slots[1]);
        assert_eq!(hub.watchers(&slots[0]), 2);
        assert_eq!(hub.watchers(&slots[1]), 3);
        drop(group);
        assert_eq!(hub.watchers(&slots[0]), 0);
        assert_eq!(hub.watchers(&slots[1]), 1);
        drop(own);
    }
}
