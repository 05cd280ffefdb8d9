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
    keys: Mutex<HashMap<LockKey, Watched>>,
    subscriptions: Box<dyn Subscriptions>,
}

struct Watched {
    watchers: usize,
    notify: Arc<Notify>,
}

impl fmt::Debug for ReleaseHub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseHub")
            .field("watched_keys", &self.watched_keys())
            .finish()
    }
}

impl ReleaseHub {
    /// A hub that tells `subscriptions` which keys are watched.
    pub fn new(subscriptions: impl Subscriptions) -> Self {
        Self {
            inner: Arc::new(HubInner {
                keys: Mutex::new(HashMap::new()),
                subscriptions: Box::new(subscriptions),
            }),
        }
    }

    /// Starts watching `key`. Releases announced from now on wake the watch (or another
    /// watcher of the same key in this process).
    pub fn watch(&self, key: &LockKey) -> ReleaseWatch {
        let (notify, first) = {
            let mut keys = self.inner.keys.lock();
            let watched = keys.entry(key.clone()).or_insert_with(|| Watched {
                watchers: 0,
                notify: Arc::new(Notify::new()),
            });
            watched.watchers += 1;
            (watched.notify.clone(), watched.watchers == 1)
        };
        if first {
            self.inner.subscriptions.subscribe(key);
        }
        ReleaseWatch {
            hub: self.clone(),
            key: key.clone(),
            notify,
        }
    }

    /// `key` was released (or may have been): wakes one of its watchers in this process.
    /// A key nobody watches is ignored.
    pub fn notify(&self, key: &LockKey) {
        let notify = self.inner.keys.lock().get(key).map(|w| w.notify.clone());
        if let Some(notify) = notify {
            notify.notify_one();
        }
    }

    /// Wakes one watcher of every watched key: after a reconnect, when releases may have
    /// been missed, so each waiter looks at the store again.
    pub fn notify_all(&self) {
        let notifies: Vec<Arc<Notify>> = self
            .inner
            .keys
            .lock()
            .values()
            .map(|w| w.notify.clone())
            .collect();
        for notify in notifies {
            notify.notify_one();
        }
    }

    /// How many watchers `key` has in this process. A backend whose releases are announced
    /// only when an attempt has marked the key waited for (Redis) asks this when it grants
    /// the key: a release wakes one watcher per process, and the others, asleep in their
    /// backoff, make no attempt that would mark the key the woken one is granted.
    pub fn watchers(&self, key: &LockKey) -> usize {
        self.inner.keys.lock().get(key).map_or(0, |w| w.watchers)
    }

    /// The keys with at least one watcher: what a listener subscribes to again after a
    /// reconnect.
    pub fn watched_keys(&self) -> Vec<LockKey> {
        self.inner.keys.lock().keys().cloned().collect()
    }

    fn unwatch(&self, key: &LockKey) {
        let last = {
            let mut keys = self.inner.keys.lock();
            match keys.get_mut(key) {
                Some(watched) if watched.watchers > 1 => {
                    watched.watchers -= 1;
                    false
                }
                Some(_) => {
                    keys.remove(key);
                    true
                }
                None => false,
            }
        };
        if last {
            self.inner.subscriptions.unsubscribe(key);
        }
    }
}

/// One waiter's interest in the releases of one key; dropping it ends the interest (the
/// backend unsubscribes when the last watcher of a key goes).
#[must_use = "a watch does nothing unless awaited"]
pub struct ReleaseWatch {
    hub: ReleaseHub,
    key: LockKey,
    notify: Arc<Notify>,
}

impl fmt::Debug for ReleaseWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseWatch")
            .field("key", &self.key)
            .finish()
    }
}

impl ReleaseWatch {
    /// The watched key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Resolves when a release of the key is announced (possibly one announced since
    /// the last call, and possibly spuriously: the caller checks the store).
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
        self.hub.unwatch(&self.key);
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
}
