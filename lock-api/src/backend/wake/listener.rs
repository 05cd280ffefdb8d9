//! [`ReleaseListener`]: the task that follows a store's release announcements for one
//! backend and wakes this process's waiters; written once, for every store.
//!
//! A backend says only how it follows its store over one connection
//! ([`FollowReleases::follow`]): connect, subscribe to the watched keys, wake the waiters of
//! each release it hears, keep its subscriptions matching the watched keys (it is told when
//! they change), until the connection is lost. The listener holds the rest:
//!
//! * **Start.** Nothing is opened until a key is watched. The first watch starts the
//!   listener in the caller's tokio runtime. Outside a runtime no listener can run, and
//!   [`ReleaseListener::watch`] returns `None`: callers poll. A listener whose runtime shut
//!   down is started again by the next watch, on that watch's runtime.
//! * **Reconnects.** When a connection is lost, the listener follows again after a pause.
//!   The pause starts at the backend's [`FollowReleases::FIRST_PAUSE`] and doubles, up to
//!   two seconds, while attempts fail before following; an attempt that followed starts it
//!   afresh. Releases in between are not heard: a follower wakes a waiter of each key it
//!   subscribes to, which then looks at the store again.
//! * **Refusal.** A store that refuses this user's subscriptions ends the listener for
//!   good ([`Followed::Refused`]): it is never started again in this process (one refusal,
//!   however many waiters come later), [`ReleaseListener::watch`] returns `None` from then
//!   on and waiters poll; [`ReleaseListener::refused`] says so to the backend.
//! * **Lifetime.** The task holds no reference to the backend: it ends once the listener,
//!   which the backend's last clone owns, is dropped.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;

use super::{Background, ReleaseHub, ReleaseWatch, Subscriptions};
use crate::key::LockKey;

/// The longest pause between two attempts to follow the store.
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

/// How a backend follows its store's release announcements over one connection.
#[async_trait]
pub trait FollowReleases: Send + Sync + 'static {
    /// The pause after the first attempt that failed before following.
    const FIRST_PAUSE: Duration;

    /// Follows the store over one connection until it is lost: connects (`attempt` counts
    /// the attempts before, from 0, so that a backend with several servers can take them in
    /// turn), subscribes to [`Releases::watched_keys`] and wakes a waiter of each, then
    /// wakes a waiter of each key whose release it hears, subscribing again whenever
    /// [`Releases::changed`] says the watched keys changed.
    ///
    /// # Cancel safety
    /// Dropped at an await point when the backend is dropped: what it opened must close
    /// with it.
    async fn follow(&self, releases: &Releases, attempt: usize) -> Followed;
}

/// How one [`FollowReleases::follow`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Followed {
    /// It failed before following (no connection, or no subscription): the pause before
    /// the next attempt doubles.
    Failed,
    /// It followed the store, then lost the connection: the next pause is the first.
    Lost,
    /// The store refuses this user's subscriptions: the listener ends, and waiters poll.
    Refused,
}

/// What a follower sees of this process's waiters: the keys they watch, when that set
/// changes, and their wakes.
#[derive(Debug)]
pub struct Releases {
    hub: ReleaseHub,
    changed: Arc<Notify>,
}

impl Releases {
    /// The keys with at least one waiter: what to subscribe to.
    pub fn watched_keys(&self) -> Vec<LockKey> {
        self.hub.watched_keys()
    }

    /// Resolves once the watched keys changed since it last resolved (or since the
    /// listener was made).
    ///
    /// # Cancel safety
    /// Cancel safe: a change seen by a cancelled call is kept for the next one.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// `key` was released (or may have been): wakes one of its waiters in this process.
    pub fn wake(&self, key: &LockKey) {
        self.hub.notify(key);
    }

    /// Wakes one waiter of every watched key: when releases may have been missed.
    pub fn wake_all(&self) {
        self.hub.notify_all();
    }
}

/// Tells the listener that the watched keys changed.
struct Nudge(Arc<Notify>);

impl Subscriptions for Nudge {
    fn subscribe(&self, _: &LockKey) {
        self.0.notify_one();
    }
    fn unsubscribe(&self, _: &LockKey) {
        self.0.notify_one();
    }
}

/// The release listener of one backend (shared by its clones): its waiters' watches, and
/// the task that follows the store with `F`.
pub struct ReleaseListener<F> {
    follower: Arc<F>,
    releases: Arc<Releases>,
    task: Background,
    /// Set by the task when the store refused this user's subscriptions: the listener
    /// ended for good and is not started again.
    refused: Arc<AtomicBool>,
    /// Dropped with the listener, which ends the task.
    stop: watch::Sender<()>,
}

impl<F> fmt::Debug for ReleaseListener<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseListener")
            .field("releases", &self.releases)
            .finish_non_exhaustive()
    }
}

impl<F: FollowReleases> ReleaseListener<F> {
    /// A listener that follows the store with `follower`; nothing runs until a key is
    /// watched.
    pub fn new(follower: F) -> Self {
        let changed = Arc::new(Notify::new());
        Self {
            follower: Arc::new(follower),
            releases: Arc::new(Releases {
                hub: ReleaseHub::new(Nudge(changed.clone())),
                changed,
            }),
            task: Background::default(),
            refused: Arc::new(AtomicBool::new(false)),
            stop: watch::channel(()).0,
        }
    }

    /// How this listener follows its store.
    pub fn follower(&self) -> &F {
        &self.follower
    }

    /// Starts watching `key`, and the listener if it does not run. `None` outside a tokio
    /// runtime, where no listener can run, and once the store refused the listener
    /// ([`Self::refused`]): callers poll.
    pub fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.ensure_running().then(|| self.releases.hub.watch(key))
    }

    /// Starts watching a semaphore's slots with one watch (see
    /// [`ReleaseHub::watch_permits`]), and the listener if it does not run. `None` as
    /// [`Self::watch`] returns it, and for no slots.
    pub fn watch_permits(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        if self.ensure_running() {
            self.releases.hub.watch_permits(slots)
        } else {
            None
        }
    }

    /// How many waiters of this process watch `key` (see [`ReleaseHub::watchers`]).
    pub fn watchers(&self, key: &LockKey) -> usize {
        self.releases.hub.watchers(key)
    }

    /// The keys waiters of this process watch.
    pub fn watched_keys(&self) -> Vec<LockKey> {
        self.releases.hub.watched_keys()
    }

    /// Whether the store refused this user's subscriptions ([`Followed::Refused`]): the
    /// listener ended for good, no release is heard, and [`Self::watch`] returns `None`.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Acquire)
    }

    /// The listener's task, once one was started: to see it end.
    pub fn task(&self) -> Option<AbortHandle> {
        self.task.abort_handle()
    }

    fn ensure_running(&self) -> bool {
        if self.refused() {
            return false;
        }
        let (follower, releases, stop) = (&self.follower, &self.releases, &self.stop);
        self.task.ensure_running(|| {
            let refused = self.refused.clone();
            listen(
                follower.clone(),
                releases.clone(),
                stop.subscribe(),
                refused,
            )
        })
    }
}

/// Follows the store, again whenever a connection is lost, until the listener is dropped
/// or the store refuses (which sets `refused`, before the task ends).
async fn listen<F: FollowReleases>(
    follower: Arc<F>,
    releases: Arc<Releases>,
    mut stop: watch::Receiver<()>,
    refused: Arc<AtomicBool>,
) {
    let mut pause = F::FIRST_PAUSE;
    for attempt in 0.. {
        // `changed` fails once the sender is dropped with the listener; nothing is sent.
        let followed = tokio::select! {
            _ = stop.changed() => return,
            followed = follower.follow(&releases, attempt) => followed,
        };
        match followed {
            Followed::Refused => {
                refused.store(true, Ordering::Release);
                return;
            }
            Followed::Lost => pause = F::FIRST_PAUSE,
            Followed::Failed => {}
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Fails before following each time, counting its attempts.
    #[derive(Default)]
    struct Unreachable(AtomicUsize);

    #[async_trait]
    impl FollowReleases for Unreachable {
        const FIRST_PAUSE: Duration = Duration::from_millis(100);
        async fn follow(&self, _: &Releases, attempt: usize) -> Followed {
            assert_eq!(attempt, self.0.fetch_add(1, Ordering::SeqCst));
            Followed::Failed
        }
    }

    /// Refused at once, counting its attempts.
    #[derive(Default)]
    struct Refusing(AtomicUsize);

    #[async_trait]
    impl FollowReleases for Refusing {
        const FIRST_PAUSE: Duration = Duration::from_millis(100);
        async fn follow(&self, _: &Releases, _: usize) -> Followed {
            self.0.fetch_add(1, Ordering::SeqCst);
            Followed::Refused
        }
    }

    async fn ended(task: &AbortHandle) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !task.is_finished() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the task ends");
    }

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn failed_attempts_pause_longer_each_time_up_to_two_seconds() {
        let listener = ReleaseListener::new(Unreachable::default());
        let _watch = listener.watch(&key("k")).expect("a runtime runs");
        // Attempts at 0, 0.1, 0.3, 0.7, 1.5, 3.1, 5.1, 7.1 s.
        tokio::time::sleep(Duration::from_millis(7_150)).await;
        assert_eq!(listener.follower().0.load(Ordering::SeqCst), 8);
    }

    #[tokio::test]
    async fn a_refused_listener_ends_and_a_dropped_one_stops() {
        let refused = ReleaseListener::new(Refusing::default());
        let _watch = refused.watch(&key("k")).expect("a runtime runs");
        ended(&refused.task().expect("the first watch starts it")).await;

        let dropped = ReleaseListener::new(Unreachable::default());
        drop(dropped.watch(&key("k")));
        let task = dropped.task().expect("the first watch starts it");
        drop(dropped);
        tokio::time::timeout(Duration::from_secs(5), async {
            while !task.is_finished() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the task ends with its listener");
    }

    #[tokio::test]
    async fn a_refused_listener_is_not_started_again_by_later_watches() {
        let listener = ReleaseListener::new(Refusing::default());
        assert!(!listener.refused());
        let first = listener.watch(&key("k")).expect("a runtime runs");
        ended(&listener.task().expect("the first watch starts it")).await;
        assert!(listener.refused());
        drop(first);
        for i in 0..20 {
            assert!(
                listener.watch(&key(&format!("k{i}"))).is_none(),
                "watch {i} after the refusal: callers poll"
            );
        }
        tokio::task::yield_now().await;
        assert_eq!(
            listener.follower().0.load(Ordering::SeqCst),
            1,
            "the store was asked once"
        );
    }

    #[test]
    fn outside_a_runtime_nothing_is_watched() {
        let listener = ReleaseListener::new(Refusing::default());
        assert!(listener.watch(&key("k")).is_none());
        assert!(listener.task().is_none());
    }

    #[tokio::test]
    async fn a_change_of_the_watched_keys_reaches_the_follower() {
        let listener = ReleaseListener::new(Refusing::default());
        let watch = listener.watch(&key("k")).expect("a runtime runs");
        tokio::time::timeout(Duration::from_secs(1), listener.releases.changed())
            .await
            .expect("the first watch of a key is a change");
        assert_eq!(listener.releases.watched_keys(), [key("k")]);
        drop(watch);
        tokio::time::timeout(Duration::from_secs(1), listener.releases.changed())
            .await
            .expect("the last watch dropped is a change");
        assert!(listener.watched_keys().is_empty());
    }
}
