//! [`ReleaseListener`]: one etcd watch per backend on its lock keys, so that a waiter in
//! [`distlock_core::Locker::lock`] is woken when the key it waits for is deleted.
//!
//! # One prefix watch, not a watch per key
//!
//! etcd deletes a lock key however the lock ends: a release, a revoke, a lease that ran
//! out. The listener keeps one watch on `<prefix>/locks/` for deletes only (etcd filters
//! out the puts), opened when a waiter first watches a key, and wakes the waiters of each
//! deleted key in this process through a [`ReleaseHub`]. A watch per key, created and
//! cancelled as waiters come and go, would carry only the keys waited on, but each wait on
//! a new key would cost a create and a cancel on the stream, and the watcher would be in
//! place only once etcd had created it, racing the waiter's first attempt; the prefix watch
//! is already in place when a waiter looks. The price is that the process also hears the
//! releases of keys nobody in it waits for: a small message each, dropped at once.
//!
//! # Reconnects
//!
//! When the stream ends (a broken connection, a member that lost its leader, a watch that
//! etcd cancelled, say after a compaction) the listener opens a new one from the current
//! revision, pausing longer after each attempt that fails. Releases in between are not
//! replayed: once the new watch is created, the listener wakes a waiter of every watched key
//! to look at the store again. It does the same when the first watch is created, for the
//! releases while it was being opened.
//!
//! # Lifetime
//!
//! The task holds no reference to the backend: it ends once the backend's last clone is
//! dropped (its stop channel closes). A runtime that shuts down drops it; the next watch,
//! on another runtime, starts it again.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use etcd_client::{WatchFilterType, WatchOptions, WatchStream};
use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::debug;

use crate::error::Effect;
use crate::keys::name_of;
use crate::members::Members;

/// The pause after the first failed attempt to open the watch; it doubles up to
/// [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

/// The release watch of one backend (shared by its clones) and the waiters it wakes.
pub(crate) struct ReleaseListener {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Dropped with the backend, which ends the task.
    stop: watch::Sender<()>,
}

/// What the listener task uses.
struct Shared {
    hub: ReleaseHub,
    members: Arc<Members>,
    prefix: String,
    /// Hears deletes but wakes no one, as a watch that silently stopped delivering would.
    #[cfg(test)]
    deaf: std::sync::atomic::AtomicBool,
}

impl ReleaseListener {
    /// A listener on the lock keys under `prefix`; nothing is opened until a key is watched.
    pub(crate) fn new(members: Arc<Members>, prefix: String) -> Self {
        Self {
            shared: Arc::new(Shared {
                hub: ReleaseHub::new(AllKeys),
                members,
                prefix,
                #[cfg(test)]
                deaf: std::sync::atomic::AtomicBool::new(false),
            }),
            task: Mutex::new(None),
            stop: watch::channel(()).0,
        }
    }

    /// Starts watching `key`, and the listener if it does not run. `None` outside a tokio
    /// runtime, where no listener can run (callers poll).
    pub(crate) fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.ensure_running().then(|| self.shared.hub.watch(key))
    }

    /// The keys waiters of this backend are watching.
    pub(crate) fn watched_keys(&self) -> Vec<LockKey> {
        self.shared.hub.watched_keys()
    }

    fn ensure_running(&self) -> bool {
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            return true;
        }
        let Ok(runtime) = Handle::try_current() else {
            return false;
        };
        *task = Some(runtime.spawn(listen(self.shared.clone(), self.stop.subscribe())));
        true
    }

    /// Makes the listener wake no one from now on (`false` restores it).
    #[cfg(test)]
    pub(crate) fn deafen(&self, deaf: bool) {
        use std::sync::atomic::Ordering;
        self.shared.deaf.store(deaf, Ordering::SeqCst);
    }

    /// The listener task, once one was started.
    #[cfg(test)]
    pub(crate) fn task(&self) -> Option<tokio::task::AbortHandle> {
        let task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        task.as_ref().map(JoinHandle::abort_handle)
    }
}

/// Follows the watch, opening it again whenever it ends, until the backend is dropped.
async fn listen(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    let mut pause = FIRST_PAUSE;
    loop {
        // `changed` fails once the sender is dropped with the backend; nothing is ever sent.
        let created = tokio::select! {
            _ = stop.changed() => return,
            created = shared.follow() => created,
        };
        if created {
            pause = FIRST_PAUSE;
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

impl Shared {
    /// Opens one watch from the current revision and wakes waiters from it until it ends.
    /// True if etcd created the watch.
    async fn follow(&self) -> bool {
        let mut stream = match self.open().await {
            Ok(stream) => stream,
            Err(e) => {
                debug!(error = %e, "cannot open the release watch");
                return false;
            }
        };
        let mut created = false;
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => {
                    debug!("the release watch ended");
                    return created;
                }
                Err(e) => {
                    debug!(error = %e, "the release watch broke");
                    return created;
                }
            };
            if response.created() {
                created = true;
                self.wake_all();
            }
            if response.canceled() {
                debug!(
                    reason = response.cancel_reason(),
                    compact_revision = response.compact_revision(),
                    "etcd cancelled the release watch"
                );
                return created;
            }
            // Every event is a delete: the watch filters out puts.
            for event in response.events() {
                let name = event
                    .kv()
                    .and_then(|kv| name_of(&self.prefix, "locks", kv.key()));
                if let Some(key) = name.and_then(|name| LockKey::new(name).ok()) {
                    self.wake(&key);
                }
            }
        }
    }

    async fn open(&self) -> Result<WatchStream, distlock_core::LockError> {
        let locks = format!("{}/locks/", self.prefix);
        let options = WatchOptions::new()
            .with_prefix()
            .with_filters([WatchFilterType::NoPut]);
        self.members
            .call(Effect::None, |client| {
                let (locks, options) = (locks.clone(), options.clone());
                async move { client.watch_client().watch(locks, Some(options)).await }
            })
            .await
    }

    fn wake(&self, key: &LockKey) {
        if !self.is_deaf() {
            self.hub.notify(key);
        }
    }

    fn wake_all(&self) {
        if !self.is_deaf() {
            self.hub.notify_all();
        }
    }

    #[cfg(test)]
    fn is_deaf(&self) -> bool {
        self.deaf.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(test))]
    fn is_deaf(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::{LockBackend, Locker, RetryPolicy};
    use harness::etcd::EtcdServer;
    use harness::require;
    use tokio::time::Instant;

    use crate::EtcdBackend;

    use super::*;

    async fn backend(server: &EtcdServer) -> EtcdBackend {
        EtcdBackend::builder()
            .endpoint(server.endpoint())
            .build()
            .await
            .unwrap()
    }

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    /// A watch that hears nothing (a stream that silently stopped delivering) strands no
    /// one: the waiter takes the key at a later poll.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_still_acquires_by_its_backoff_when_the_watch_wakes_no_one() {
        let server = require(EtcdServer::start().await);
        let (holder, waiter) = (backend(&server).await, backend(&server).await);
        waiter.release_listener().deafen(true);
        let held = holder
            .acquire(&key("deaf"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        let locker = Locker::builder(Arc::new(waiter.clone()))
            .ttl(Duration::from_secs(30))
            .retry(RetryPolicy {
                initial: Duration::from_secs(2),
                max: Duration::from_secs(2),
            })
            .wait_timeout(Some(Duration::from_secs(30)))
            .build()
            .unwrap();
        let waiting = tokio::spawn(async move { locker.lock(&key("deaf")).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(waiter.watched_keys(), [key("deaf")], "the waiter watches");
        holder.release(&held).await.unwrap();
        let guard = waiting
            .await
            .unwrap()
            .expect("the backoff fallback takes the key");
        assert!(guard.token() > held.token());
        guard.release().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_backend_ends_its_release_listener() {
        let server = require(EtcdServer::start().await);
        let backend = backend(&server).await;
        let watch = backend
            .watch_releases(&key("dropped"))
            .expect("a runtime runs");
        let task = backend
            .release_listener()
            .task()
            .expect("the first watch starts it");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !task.is_finished(),
            "the listener runs while the backend lives"
        );
        drop(watch);
        drop(backend);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !task.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the listener outlived its backend"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[test]
    fn a_runtime_shutting_down_drops_the_listener_without_a_panic() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (server, backend, task) = runtime.block_on(async {
            let server = require(EtcdServer::start().await);
            let backend = backend(&server).await;
            drop(backend.watch_releases(&key("shutdown")));
            let task = backend.release_listener().task().unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            (server, backend, task)
        });
        drop(runtime);
        assert!(task.is_finished());
        // Outside a runtime no listener can run: callers poll.
        assert!(backend.watch_releases(&key("shutdown")).is_none());
        drop(server);
    }
}
