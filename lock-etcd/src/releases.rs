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
//! The listener's lifecycle (started by the first watch, followed again with a growing
//! pause, ended with the backend) is the core's [`distlock_core::wake::ReleaseListener`];
//! [`Follower`] is how it follows etcd.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{FollowReleases, Followed, Releases};
use etcd_client::{WatchFilterType, WatchOptions, WatchStream};
use tracing::debug;

use crate::error::Effect;
use crate::keys::name_of;
use crate::members::Members;

/// The release watch of one backend (shared by its clones) and the waiters it wakes.
pub(crate) type ReleaseListener = distlock_core::wake::ReleaseListener<Follower>;

/// How the listener follows etcd: one prefix watch for deletes.
pub(crate) struct Follower {
    members: Arc<Members>,
    prefix: String,
}

impl Follower {
    /// A follower of the lock keys under `prefix`.
    pub(crate) fn new(members: Arc<Members>, prefix: String) -> Self {
        Self { members, prefix }
    }
}

#[distlock_core::async_trait]
impl FollowReleases for Follower {
    const FIRST_PAUSE: Duration = Duration::from_millis(100);

    /// Opens one watch from the current revision and wakes waiters from it until it ends.
    async fn follow(&self, releases: &Releases, _: usize) -> Followed {
        let mut stream = match self.open().await {
            Ok(stream) => stream,
            Err(e) => {
                debug!(error = %e, "cannot open the release watch");
                return Followed::Failed;
            }
        };
        let mut created = false;
        let ended = |created| {
            if created {
                Followed::Lost
            } else {
                Followed::Failed
            }
        };
        loop {
            let response = match stream.message().await {
                Ok(Some(response)) => response,
                Ok(None) => {
                    debug!("the release watch ended");
                    return ended(created);
                }
                Err(e) => {
                    debug!(error = %e, "the release watch broke");
                    return ended(created);
                }
            };
            if response.created() {
                created = true;
                releases.wake_all();
            }
            if response.canceled() {
                debug!(
                    reason = response.cancel_reason(),
                    compact_revision = response.compact_revision(),
                    "etcd cancelled the release watch"
                );
                return ended(created);
            }
            // Every event is a delete: the watch filters out puts.
            for event in response.events() {
                let name = event
                    .kv()
                    .and_then(|kv| name_of(&self.prefix, "locks", kv.key()));
                if let Some(key) = name.and_then(|name| LockKey::new(name).ok()) {
                    releases.wake(&key);
                }
            }
        }
    }
}

impl Follower {
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
}

#[cfg(test)]
mod tests {
    use distlock_core::{Layered, LockBackend, Locker, RetryPolicy};
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
        let waiter = Arc::new(Layered::new(Arc::new(waiter), conformance::Deaf::default()));
        let held = holder
            .acquire(&key("deaf"), Duration::from_secs(30))
            .await
            .unwrap()
            .unwrap();
        let locker = Locker::builder(waiter.clone())
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
