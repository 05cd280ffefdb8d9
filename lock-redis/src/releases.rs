//! [`ReleaseListener`]: one pub/sub connection per backend, so that a waiter in
//! [`distlock_core::Locker::lock`] is woken when the key it waits for is released.
//!
//! # A channel per key
//!
//! The release scripts `PUBLISH` on the lock's own key name (channels and keys are
//! separate namespaces) when they delete a lock. The listener `SUBSCRIBE`s to the keys
//! waiters in this process watch, and only those: a process hears the releases it waits
//! for, not every release of the deployment, and a release nobody waits for costs the
//! server one lookup. On a Redis Cluster a `PUBLISH` reaches every node, so the listener
//! may subscribe on any of them. Expiries are not announced (that would take keyspace
//! notifications, a server setting); waiters find an expired key by their backoff.
//!
//! # Subscriptions follow the hub
//!
//! The [`ReleaseHub`] says which keys are watched. Each change only nudges the listener,
//! which then makes its subscriptions match the hub's keys, so changes that race each
//! other (the last waiter of a key leaving while a new one arrives) end in the right
//! state.
//!
//! # Reconnects and lifetime
//!
//! When the connection drops, the listener connects again (to the next node, on a
//! cluster), subscribes to every watched key, and wakes one waiter of each, since releases
//! while it was away were not heard. The task holds no reference to the backend: it ends
//! once the backend's last clone is dropped. A runtime that shuts down drops it; the next
//! watch, on another runtime, starts it again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{ReleaseHub, ReleaseWatch, Subscriptions};
use futures::StreamExt;
use tokio::runtime::Handle;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tracing::debug;

use crate::keys::LockKeys;

/// The pause after the first failed attempt to connect; it doubles up to
/// [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

/// The release subscriptions of one backend (shared by its clones).
pub(crate) struct ReleaseListener {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Dropped with the backend, which ends the task.
    stop: watch::Sender<()>,
}

/// What the listener task uses.
struct Shared {
    hub: ReleaseHub,
    /// Nudged when the hub's watched keys change.
    changed: Arc<Notify>,
    /// The servers to subscribe on, tried in turn.
    clients: Vec<redis::Client>,
    prefix: String,
    connect_timeout: Duration,
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

impl ReleaseListener {
    /// A listener subscribing on `clients` (one per server it may use) to the lock keys
    /// under `prefix`; nothing is opened until a key is watched.
    pub(crate) fn new(
        clients: Vec<redis::Client>,
        prefix: String,
        connect_timeout: Duration,
    ) -> Self {
        let changed = Arc::new(Notify::new());
        Self {
            shared: Arc::new(Shared {
                hub: ReleaseHub::new(Nudge(changed.clone())),
                changed,
                clients,
                prefix,
                connect_timeout,
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
        if self.shared.clients.is_empty() {
            return false;
        }
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
}

/// Subscribes, follows the messages, and connects again whenever the connection drops,
/// until the backend is dropped.
async fn listen(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    let mut pause = FIRST_PAUSE;
    let mut next_client = 0;
    loop {
        let client = &shared.clients[next_client % shared.clients.len()];
        next_client += 1;
        // `changed` fails once the sender is dropped with the backend; nothing is sent.
        let followed = tokio::select! {
            _ = stop.changed() => return,
            followed = shared.follow(client) => followed,
        };
        match followed {
            Ok(()) => pause = FIRST_PAUSE,
            Err(e) => debug!(error = %e, "release subscription lost; connecting again"),
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

impl Shared {
    /// One connection's life: connect, subscribe to the watched keys, wake their waiters
    /// (releases may have been missed), then deliver messages and keep the subscriptions
    /// matching the hub until the connection drops.
    async fn follow(&self, client: &redis::Client) -> redis::RedisResult<()> {
        let pubsub = tokio::time::timeout(self.connect_timeout, client.get_async_pubsub())
            .await
            .map_err(|_| {
                redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connecting for release notifications timed out",
                ))
            })??;
        let (mut sink, mut stream) = pubsub.split();
        let mut subscribed: HashMap<String, LockKey> = HashMap::new();
        // Every watched key is new to this connection, so `reconcile` wakes a waiter of
        // each: releases while there was no connection were not heard.
        self.reconcile(&mut sink, &mut subscribed).await?;
        loop {
            tokio::select! {
                () = self.changed.notified() => self.reconcile(&mut sink, &mut subscribed).await?,
                message = stream.next() => {
                    let Some(message) = message else {
                        return Err(redis::RedisError::from(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "the release subscription's connection closed",
                        )));
                    };
                    if let Some(key) = subscribed.get(message.get_channel_name()) {
                        self.hub.notify(key);
                    }
                }
            }
        }
    }

    /// Subscribes to the watched keys not yet subscribed, and unsubscribes from the rest.
    async fn reconcile(
        &self,
        sink: &mut redis::aio::PubSubSink,
        subscribed: &mut HashMap<String, LockKey>,
    ) -> redis::RedisResult<()> {
        let wanted: HashMap<String, LockKey> = self
            .hub
            .watched_keys()
            .into_iter()
            .map(|key| (LockKeys::new(&self.prefix, &key).lock, key))
            .collect();
        let gone: Vec<String> = subscribed
            .keys()
            .filter(|channel| !wanted.contains_key(*channel))
            .cloned()
            .collect();
        let new: HashSet<&String> = wanted
            .keys()
            .filter(|channel| !subscribed.contains_key(*channel))
            .collect();
        if !gone.is_empty() {
            sink.unsubscribe(&gone).await?;
        }
        let new: Vec<String> = new.into_iter().cloned().collect();
        if !new.is_empty() {
            sink.subscribe(&new).await?;
        }
        *subscribed = wanted;
        // A key may have been released between its waiter's last look and the
        // subscription taking effect: that waiter looks once more.
        for channel in &new {
            if let Some(key) = subscribed.get(channel) {
                self.hub.notify(key);
            }
        }
        Ok(())
    }
}
