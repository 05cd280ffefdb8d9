//! [`ReleaseListener`]: one `LISTEN` session per backend, so that a waiter in
//! [`distlock_core::Locker::lock`] is woken when the key it waits for is released.
//!
//! # One channel per schema and mode, the key as payload
//!
//! Every release statement runs `pg_notify(channel, name)` (both bind parameters) in the
//! same statement, so the notification goes out when the release commits, never before.
//! The channel is [`channel`]: one per schema and backend mode (the two modes' locks are
//! separate), named after a hash of the schema because a channel name is an identifier of
//! at most 63 bytes and a schema name alone may be that long. A channel per key would need
//! a `LISTEN` round trip before each new key's first wait (racing the waiter's first
//! attempt) and could not hold long key names; the one channel is already listened to when
//! a waiter looks. The price is that the process also hears releases of keys nobody in it
//! waits for: one small message each, dropped at once.
//!
//! # Not announced
//!
//! A lease-table row whose `expires_at` passes, and an advisory lock freed by its session
//! ending (a crash, a dropped lease, `idle_session_timeout`), send no notification:
//! waiters find such keys free at their next backoff step.
//!
//! # Reconnects
//!
//! The listener runs on a connection of its own (same settings as the backend's pool, not
//! one of its slots). When that connection is lost, it connects again, pausing longer after
//! each attempt that fails, `LISTEN`s again and wakes a waiter of every watched key, since
//! releases in between were not heard. It does the same after the first `LISTEN`.
//!
//! # Lifetime
//!
//! The task holds no reference to the backend: it ends once the backend is dropped (its
//! stop channel closes), closing its connection. A runtime that shuts down drops it; the
//! next watch, on another runtime, starts it again.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::debug;

use crate::schema::Schema;

/// The pause after the first failed attempt to listen; it doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const LONGEST_PAUSE: Duration = Duration::from_secs(2);

/// The notification channel of the releases of one backend mode (`lease`, `advisory`) in
/// `schema`: `distlock_<mode>_` and the first 8 bytes of SHA-256 of the schema name in hex.
pub(crate) fn channel(mode: &str, schema: &Schema) -> String {
    let digest = Sha256::digest(schema.as_str().as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("distlock_{mode}_{hex}")
}

/// The release listener of one backend and the waiters it wakes.
pub(crate) struct ReleaseListener {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Dropped with the backend, which ends the task.
    stop: watch::Sender<()>,
}

/// What the listener task uses.
struct Shared {
    hub: ReleaseHub,
    channel: String,
    options: PgConnectOptions,
    connect_timeout: Duration,
    /// Hears releases but wakes no one, as a connection that silently lost them would.
    #[cfg(test)]
    deaf: std::sync::atomic::AtomicBool,
}

impl ReleaseListener {
    /// A listener on `channel` that connects with `options`; nothing is opened until a key
    /// is watched.
    pub(crate) fn new(
        channel: String,
        options: PgConnectOptions,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                hub: ReleaseHub::new(AllKeys),
                channel,
                options,
                connect_timeout,
                #[cfg(test)]
                deaf: std::sync::atomic::AtomicBool::new(false),
            }),
            task: Mutex::new(None),
            stop: watch::channel(()).0,
        }
    }

    /// The channel the backend's releases notify.
    pub(crate) fn channel(&self) -> &str {
        &self.shared.channel
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

/// Listens, connecting again whenever the connection is lost, until the backend is dropped.
async fn listen(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    // A pool of one, only so that `PgListener` can open its connection; its connection
    // closes when the task ends.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(shared.connect_timeout)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(shared.options.clone());
    let mut pause = FIRST_PAUSE;
    loop {
        // `changed` fails once the sender is dropped with the backend; nothing is ever sent.
        let listened = tokio::select! {
            _ = stop.changed() => return,
            listened = shared.follow(&pool) => listened,
        };
        if listened {
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
    /// Connects, listens, and wakes waiters from the notifications until the connection is
    /// lost. True if the `LISTEN` ran.
    async fn follow(&self, pool: &PgPool) -> bool {
        let mut listener = match PgListener::connect_with(pool).await {
            Ok(listener) => listener,
            Err(e) => {
                debug!(error = %e, "cannot connect the release listener");
                return false;
            }
        };
        // Reconnecting is done here, so that waiters are woken after every reconnect.
        listener.eager_reconnect(false);
        if let Err(e) = listener.listen(&self.channel).await {
            debug!(error = %e, "cannot LISTEN for releases");
            return false;
        }
        // Releases before the LISTEN took effect were not heard.
        self.wake_all();
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => {
                    if let Ok(key) = LockKey::new(notification.payload()) {
                        self.wake(&key);
                    }
                }
                Ok(None) => {
                    debug!("the release listener's connection was lost");
                    return true;
                }
                Err(e) => {
                    debug!(error = %e, "the release listener's connection failed");
                    return true;
                }
            }
        }
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
    use std::sync::Arc;

    use distlock_core::{LockBackend, Locker, RetryPolicy};
    use harness::postgres::PostgresServer;
    use tokio::time::Instant;

    use super::*;
    use crate::PgBuilder;

    async fn server() -> PostgresServer {
        let server = harness::require(PostgresServer::start().await);
        harness::require(
            server
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await,
        );
        server
    }

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    /// A listener that hears nothing (a notification lost on the way) strands no one: the
    /// waiter takes the key at its next poll, after its backoff.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_still_acquires_by_its_backoff_when_the_notification_is_lost() {
        const BACKOFF: Duration = Duration::from_secs(2);
        let server = server().await;
        let holder = PgBuilder::new(server.url()).build_lease_backend().unwrap();
        holder.setup().await.unwrap();
        let waiter = Arc::new(PgBuilder::new(server.url()).build_lease_backend().unwrap());
        waiter.releases.deafen(true);
        let ttl = Duration::from_secs(30);
        let held = holder.acquire(&key("deaf"), ttl).await.unwrap().unwrap();
        let locker = Locker::builder(waiter.clone())
            .ttl(ttl)
            .retry(RetryPolicy {
                initial: BACKOFF,
                max: BACKOFF,
            })
            .build()
            .unwrap();
        let waiting = tokio::spawn(async move { locker.lock(&key("deaf")).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(waiter.watched_keys(), [key("deaf")], "the waiter watches");
        let released_at = Instant::now();
        holder.release(&held).await.unwrap();
        let guard = waiting
            .await
            .unwrap()
            .expect("the backoff fallback takes the key");
        // Not woken: it polled, at the end of the backoff step it was sleeping in.
        assert!(released_at.elapsed() >= BACKOFF / 2 - Duration::from_millis(500));
        assert!(guard.token() > held.token());
        guard.release().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_backend_ends_its_release_listener() {
        let server = server().await;
        let backend = PgBuilder::new(server.url())
            .build_advisory_backend()
            .unwrap();
        let watch = backend.watch_releases(&key("x")).expect("in a runtime");
        let task = backend.releases.task().expect("started by the watch");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!task.is_finished());
        drop(backend);
        let started = Instant::now();
        while !task.is_finished() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the task runs on"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(watch);
        // Its session is closed: nobody listens any more.
        let listening = server
            .psql("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
            .await
            .unwrap();
        assert_eq!(listening, "0");
    }

    #[test]
    fn channels_are_short_identifiers_per_schema_and_mode() {
        let long = Schema::new(&"s".repeat(63)).unwrap();
        let short = Schema::new("distlock").unwrap();
        let c = channel("advisory", &long);
        assert!(c.len() < 64, "{c}");
        assert!(
            c.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        );
        assert_ne!(c, channel("advisory", &short));
        assert_ne!(channel("lease", &short), channel("advisory", &short));
    }
}
