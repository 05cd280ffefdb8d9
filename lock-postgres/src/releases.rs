//! [`ReleaseListener`]: one `LISTEN` session per backend, so that a waiter in
//! [`distlock_core::Locker::lock`] is woken when the key it waits for is released.
//!
//! # One channel per schema and mode, the key as payload
//!
//! A release statement reads whether some process waits for its key (the listener
//! registers the keys its waiters watch in the waiters' registry, see [`crate::waiters`]);
//! when one does, the backend hands the name to its [`crate::announcer`], which sends
//! `pg_notify(channel, name)` (both bind parameters) after the release committed, never
//! before. The
//! channel is [`channel`]: one per schema and backend mode (the two modes' locks are
//! separate), named after a hash of the schema because a channel name is an identifier of
//! at most 63 bytes and a schema name alone may be that long. A channel per key would need
//! a `LISTEN` round trip before each new key's first wait and could not hold long key
//! names. The price is that the process also hears releases of keys that only another
//! process waits for: one small message each, dropped at once.
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
//! each attempt that fails, `LISTEN`s again, registers every watched key again and wakes a
//! waiter of each, since releases in between were not heard. It does the same after the
//! first `LISTEN`, and wakes the waiters of a key each time it registers that key.
//!
//! # A connection that dies silently
//!
//! A NAT or load balancer that drops an idle flow, a crashed host or a failover can leave
//! the socket open with nothing behind it: no error ever comes. So the listener waits for
//! a notification at most the request time limit, then pings (`SELECT 1`, under the same
//! limit); no answer, and it drops the connection and connects again. It is told the
//! state of its connection within twice the request time limit. The session also runs
//! with the server's TCP keepalives and `tcp_user_timeout` at about that time, so the
//! server ends the session of a listener that vanished, and with it its registrations.
//!
//! # A registration that waits
//!
//! Registering waits for the exclusive lock of a release that is committing. The session's
//! `lock_timeout` (half the request time limit) bounds that wait on the server: a
//! registration held up by a transaction that does not end fails there, and the listener
//! drops a connection that has answered and connects again. Bounded by the client alone,
//! each attempt left a session behind, still waiting for the lock.
//!
//! # A lock table that is full
//!
//! Each registration is a shared lock in PostgreSQL's lock table, which every session of
//! the server shares (`max_locks_per_transaction` times the connection slots, plus spare
//! shared memory). When it is full, registering fails with "out of shared memory"
//! (SQLSTATE 53200), and the listener drops its connection, which frees whatever part of
//! the registration the server had granted (a session lock outlives the failed statement
//! that took it, but not the session). It then connects again after a pause that doubles
//! each time this happens, as after a failed connection, instead of after the first pause
//! of a lost one: registering again at once filled the lock table again about ten times a
//! second, for the listener and for every other session of the server. It says so once at
//! `warn` level, naming the setting, until a registration succeeds again; waiters poll
//! with their backoff meanwhile.
//!
//! # Lifetime
//!
//! The listener's lifecycle (started by the first watch, connected again with a growing
//! pause, ended with the backend, closing its connection) is the core's
//! [`distlock_core::wake::ReleaseListener`]; [`Follower`] is how it follows PostgreSQL.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{FollowReleases, Followed, ReleaseWatch, Releases};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::announcer::Announcer;
use crate::pooling::PgPooling;
use crate::schema::Schema;
use crate::waiters::{REGISTER, UNREGISTER, waiter_id};

/// The `application_name` of the listener's sessions, so operators (and tests) can tell
/// them from the backend's pool.
pub const LISTENER_APPLICATION_NAME: &str = "distlock-releases";

/// The notification channel of the releases of one backend mode (`lease`, `advisory`) in
/// `schema`: `distlock_<mode>_` and the first 8 bytes of SHA-256 of the schema name in hex.
pub(crate) fn channel(mode: &str, schema: &Schema) -> String {
    let digest = Sha256::digest(schema.as_str().as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("distlock_{mode}_{hex}")
}

/// The release listener of one backend and the waiters it wakes.
pub(crate) struct ReleaseListener {
    listener: distlock_core::wake::ReleaseListener<Follower>,
    /// Sends the notifications of released keys that some process waits for.
    announcer: Announcer,
    /// Dropped with the backend, which ends the announcer's task.
    stop: watch::Sender<()>,
    /// With [`PgPooling::Transaction`] nothing listens: there is no session to `LISTEN` on.
    pooling: PgPooling,
}

/// How the listener follows PostgreSQL: a `LISTEN` session of its own.
pub(crate) struct Follower {
    mode: &'static str,
    schema: Schema,
    channel: String,
    options: PgConnectOptions,
    connect_timeout: Duration,
    /// How long the listener waits for a reply, and how long it lets its connection stay
    /// quiet before it pings.
    request_timeout: Duration,
    /// [`keepalive_sql`] for `request_timeout`.
    keepalive: Arc<str>,
    /// Whether the warning about a full lock table was given since the last registration
    /// that succeeded.
    warned_lock_table: AtomicBool,
}

impl ReleaseListener {
    /// A listener for the releases of backend mode `mode` (`lease`, `advisory`) in
    /// `schema` that connects with `options`; nothing is opened until a key is watched,
    /// and nothing ever with [`PgPooling::Transaction`] (announcements are still sent).
    pub(crate) fn new(
        mode: &'static str,
        schema: &Schema,
        options: PgConnectOptions,
        connect_timeout: Duration,
        request_timeout: Duration,
        pooling: PgPooling,
    ) -> Self {
        let channel = channel(mode, schema);
        Self {
            announcer: Announcer::new(
                channel.clone(),
                options.clone(),
                connect_timeout,
                request_timeout,
                pooling,
            ),
            listener: distlock_core::wake::ReleaseListener::new(Follower {
                mode,
                schema: schema.clone(),
                channel,
                options: options.application_name(LISTENER_APPLICATION_NAME),
                connect_timeout,
                request_timeout,
                keepalive: keepalive_sql(request_timeout).into(),
                warned_lock_table: AtomicBool::new(false),
            }),
            stop: watch::channel(()).0,
            pooling,
        }
    }

    /// Announces the release of `name`, which some process waits for (its release found
    /// the key's waiter id registered), once this and other queued announcements can go;
    /// see [`crate::announcer`].
    pub(crate) fn announce(&self, name: &str) {
        self.announcer.announce(name, &self.stop);
    }

    /// The waiter id of `key`, which the backend's releases of `key` check.
    pub(crate) fn waiter_id(&self, key: &LockKey) -> (i32, i32) {
        let follower = self.listener.follower();
        waiter_id(follower.mode, &follower.schema, key)
    }

    /// Starts watching `key`, and the listener if it does not run. `None` outside a tokio
    /// runtime, where no listener can run, and with [`PgPooling::Transaction`] (callers
    /// poll).
    pub(crate) fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        if self.pooling == PgPooling::Transaction {
            return None;
        }
        self.listener.watch(key)
    }

    /// Starts watching a semaphore's slots with one watch, as [`Self::watch`] a key.
    pub(crate) fn watch_permits(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        if self.pooling == PgPooling::Transaction {
            return None;
        }
        self.listener.watch_permits(slots)
    }

    /// The keys waiters of this backend are watching.
    pub(crate) fn watched_keys(&self) -> Vec<LockKey> {
        self.listener.watched_keys()
    }

    /// The listener task, once one was started.
    #[cfg(test)]
    pub(crate) fn task(&self) -> Option<tokio::task::AbortHandle> {
        self.listener.task()
    }
}

/// The statement that shows an idle listener connection is alive.
const PING: &str = "SELECT 1";

/// How many keepalive probes the server sends to an unanswering listener client before it
/// drops the session (and with it the session's waiter registrations).
const KEEPALIVE_PROBES: u64 = 3;

/// Sets the server's TCP keepalives and `tcp_user_timeout` on the listener's session, so
/// that the server ends the session of a client that vanished (its registrations would
/// otherwise make releases notify for no one). The time is `request_timeout`, rounded up
/// to whole seconds: the client pings that often.
///
/// Also sets the session's `lock_timeout` to half the request time limit. A registration
/// waits for the exclusive lock of a release that is committing; one that never commits
/// (or a session that holds the waiter id for another reason) would keep it waiting. The
/// server then ends the wait itself, before the client gives up: the listener gets an
/// error, drops a connection that has answered, and connects again. Waited on by the
/// client's time limit alone, the connection stayed busy after the listener gave up on
/// it (sqlx's drop handler waits for the statement before it can return or close it),
/// and each attempt left one more session waiting for the lock.
fn keepalive_sql(request_timeout: Duration) -> String {
    let secs = request_timeout.as_secs() + u64::from(request_timeout.subsec_nanos() > 0);
    let secs = secs.max(1);
    let lock_ms = (request_timeout / 2).as_millis().clamp(1, i32::MAX as u128);
    format!(
        "SELECT set_config('tcp_keepalives_idle', '{secs}', false), \
                set_config('tcp_keepalives_interval', '{secs}', false), \
                set_config('tcp_keepalives_count', '{KEEPALIVE_PROBES}', false), \
                set_config('tcp_user_timeout', '{}', false), \
                set_config('lock_timeout', '{lock_ms}', false)",
        secs * 1000 * (KEEPALIVE_PROBES + 1)
    )
}

#[distlock_core::async_trait]
impl FollowReleases for Follower {
    const FIRST_PAUSE: Duration = Duration::from_millis(100);

    async fn follow(&self, releases: &Releases, _: usize) -> Followed {
        // A pool of one per connection, only so that `PgListener` can open it: a connection
        // given up on goes back to its own pool, never blocking the next one.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(self.connect_timeout)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_lazy_with(self.options.clone());
        if self.follow_pool(&pool, releases).await {
            Followed::Lost
        } else {
            Followed::Failed
        }
    }
}

/// Why the listener stopped following its connection.
enum Lost {
    /// The connection failed, was closed, or did not answer in time (the reason).
    Connection(String),
    /// Registering the watched keys found the server's lock table full (the error).
    LockTableFull(String),
}

impl Lost {
    fn from_sqlx(e: &sqlx::Error) -> Self {
        match e {
            sqlx::Error::Database(db) if db.code().as_deref() == Some(OUT_OF_MEMORY) => {
                Self::LockTableFull(e.to_string())
            }
            _ => Self::Connection(e.to_string()),
        }
    }
}

impl fmt::Display for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connection(why) | Self::LockTableFull(why) => f.write_str(why),
        }
    }
}

/// SQLSTATE `out_of_memory`: among others, "out of shared memory" from a full lock table.
const OUT_OF_MEMORY: &str = "53200";

impl Follower {
    /// Connects, listens, registers the watched keys and wakes waiters from the
    /// notifications until the connection is lost. True if the `LISTEN` ran and the
    /// connection was then lost; false when it failed before, or the lock table was full
    /// (see "A lock table that is full" above): the pause before the next attempt doubles.
    async fn follow_pool(&self, pool: &PgPool, releases: &Releases) -> bool {
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
        let keepalive = sqlx::query(AssertSqlSafe(self.keepalive.clone())).execute(&mut listener);
        if let Err(lost) = self.timed(keepalive).await {
            debug!(%lost, "cannot set the release listener's TCP and lock timeouts");
            return true;
        }
        let mut registered = HashMap::new();
        let lost = self
            .follow_listening(&mut listener, releases, &mut registered)
            .await;
        if let Lost::LockTableFull(error) = &lost {
            let watched = releases.watched_keys().len();
            if self.warned_lock_table.swap(true, Ordering::Relaxed) {
                debug!(%error, watched, "the release listener cannot register its keys");
            } else {
                warn!(
                    %error,
                    watched,
                    "the release listener cannot register the keys its waiters watch: the \
                     server's lock table is full (raise max_locks_per_transaction); waiters \
                     poll with their backoff, and the listener tries again after a growing pause"
                );
            }
            return false;
        }
        debug!(%lost, "the release listener's connection was lost");
        true
    }

    /// Keeps the registered keys in step with the watched ones and wakes waiters from the
    /// notifications, until the connection is lost.
    async fn follow_listening(
        &self,
        listener: &mut PgListener,
        releases: &Releases,
        registered: &mut HashMap<LockKey, (i32, i32)>,
    ) -> Lost {
        loop {
            if let Err(lost) = self.register(listener, releases, registered).await {
                return lost;
            }
            tokio::select! {
                () = releases.changed() => {}
                received = tokio::time::timeout(self.request_timeout, listener.try_recv()) => {
                    match received {
                        Ok(Ok(Some(notification))) => {
                            if let Ok(key) = LockKey::new(notification.payload()) {
                                releases.wake(&key);
                            }
                        }
                        Ok(Ok(None)) => return Lost::Connection("closed".to_owned()),
                        Ok(Err(e)) => return Lost::from_sqlx(&e),
                        // Quiet for a while: a connection that died silently would stay
                        // quiet forever, so it must answer a ping.
                        Err(_) => {
                            let ping = sqlx::query(PING).execute(&mut *listener);
                            if let Err(lost) = self.timed(ping).await {
                                return lost;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Registers the keys watched now and not yet registered, then wakes their waiters
    /// (a release before the registration was not announced); unregisters the keys no
    /// longer watched.
    async fn register(
        &self,
        listener: &mut PgListener,
        releases: &Releases,
        registered: &mut HashMap<LockKey, (i32, i32)>,
    ) -> Result<(), Lost> {
        let watched: HashSet<LockKey> = releases.watched_keys().into_iter().collect();
        let gone: Vec<LockKey> = registered
            .keys()
            .filter(|k| !watched.contains(*k))
            .cloned()
            .collect();
        if !gone.is_empty() {
            let ids: Vec<(i32, i32)> = gone.iter().filter_map(|k| registered.remove(k)).collect();
            self.run(listener, UNREGISTER, &ids).await?;
        }
        let new: Vec<LockKey> = watched
            .into_iter()
            .filter(|k| !registered.contains_key(k))
            .collect();
        if !new.is_empty() {
            let ids: Vec<(i32, i32)> = new
                .iter()
                .map(|k| waiter_id(self.mode, &self.schema, k))
                .collect();
            self.run(listener, REGISTER, &ids).await?;
            self.warned_lock_table.store(false, Ordering::Relaxed);
            for (key, id) in new.into_iter().zip(ids) {
                releases.wake(&key);
                registered.insert(key, id);
            }
        }
        Ok(())
    }

    /// Runs `REGISTER` or `UNREGISTER` for `ids`.
    async fn run(
        &self,
        listener: &mut PgListener,
        sql: &'static str,
        ids: &[(i32, i32)],
    ) -> Result<(), Lost> {
        let (classes, objs): (Vec<i32>, Vec<i32>) = ids.iter().copied().unzip();
        let query = sqlx::query(sql)
            .bind(classes)
            .bind(objs)
            .execute(&mut *listener);
        self.timed(query).await
    }

    /// Awaits a statement on the listener's connection under the request time limit.
    async fn timed<T>(
        &self,
        statement: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<(), Lost> {
        match tokio::time::timeout(self.request_timeout, statement).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(Lost::from_sqlx(&e)),
            Err(_) => Err(Lost::Connection(format!(
                "no reply within {:?}",
                self.request_timeout
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use distlock_core::{
        BackendLayer, Layered, Lease, LockBackend, LockError, Locker, RetryPolicy,
    };
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
        let waiter = PgBuilder::new(server.url()).build_lease_backend().unwrap();
        let deaf = Arc::new(Layered::new(Arc::new(waiter), conformance::Deaf::default()));
        let refused = Arc::new(Refusals::default());
        let waiter = Arc::new(Layered::new(deaf, refused.clone()));
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
        // Released once the waiter's first attempt was refused (its first connection may
        // take a while on a loaded machine): it is then in its first backoff step.
        refused.0.notified().await;
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

    /// Says when an acquire was refused (the key held by another).
    #[derive(Debug, Default)]
    struct Refusals(tokio::sync::Notify);

    #[async_trait::async_trait]
    impl BackendLayer for Refusals {
        async fn acquire(
            &self,
            next: &dyn LockBackend,
            key: &LockKey,
            ttl: Duration,
        ) -> Result<Option<Lease>, LockError> {
            let granted = next.acquire(key, ttl).await;
            if matches!(granted, Ok(None)) {
                self.0.notify_one();
            }
            granted
        }
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
            .psql(&format!(
                "SELECT count(*) FROM pg_stat_activity \
                  WHERE application_name = '{LISTENER_APPLICATION_NAME}'"
            ))
            .await
            .unwrap();
        assert_eq!(listening, "0");
    }

    /// Listener sessions that wait for a lock, and all listener sessions.
    async fn listener_sessions(server: &PostgresServer) -> (u64, u64) {
        let counts = server
            .psql(&format!(
                "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock') || ' ' || count(*) \
                   FROM pg_stat_activity WHERE application_name = '{LISTENER_APPLICATION_NAME}'"
            ))
            .await
            .unwrap();
        let (waiting, all) = counts.split_once(' ').unwrap();
        (waiting.parse().unwrap(), all.parse().unwrap())
    }

    /// A registration that cannot get its shared lock (another session holds the waiter
    /// id exclusively, as a release that does not commit would) is ended by the server,
    /// and the listener's connection with it: the listener keeps at most one session,
    /// not one more left waiting for the lock each time it gives up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocked_registration_leaves_no_session_behind() {
        const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
        let server = server().await;
        let backend = PgBuilder::new(server.url())
            .request_timeout(REQUEST_TIMEOUT)
            .build_lease_backend()
            .unwrap();
        backend.setup().await.unwrap();
        let k = key("blocked:registration");
        let (class, obj) = backend.releases.waiter_id(&k);
        let mut blocker = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url())
            .await
            .unwrap();
        sqlx::query("SELECT pg_advisory_lock($1, $2)")
            .bind(class)
            .bind(obj)
            .execute(&mut blocker)
            .await
            .unwrap();

        let watch = backend.watch_releases(&k).expect("in a runtime");
        // Many of the listener's time limits: each one it gave up on a waiting
        // registration would have left a session waiting.
        let mut most = (0, 0);
        let until = Instant::now() + REQUEST_TIMEOUT * 12;
        while Instant::now() < until {
            let (waiting, all) = listener_sessions(&server).await;
            most = (most.0.max(waiting), most.1.max(all));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(most.0 >= 1, "the registration was never seen waiting");
        assert!(
            most.0 == 1 && most.1 <= 2,
            "at most {} listener sessions waited for the lock at once, {} were open",
            most.0,
            most.1
        );

        // Once the lock is free the key is registered, on one session.
        sqlx::Connection::close(blocker).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let registered = server
                .psql(&format!(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                        AND mode = 'ShareLock' AND classid = ({class})::int4::oid \
                        AND objid = ({obj})::int4::oid AND objsubid = 2"
                ))
                .await
                .unwrap();
            if registered == "1" && listener_sessions(&server).await == (0, 1) {
                break;
            }
            assert!(Instant::now() < deadline, "never registered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(watch);
    }

    /// With the server's lock table nearly full (another session holds 16,000 advisory
    /// locks; the test server has room for 23,000 to 24,000), registering the 10,000 keys
    /// the waiters watch fails with "out of shared memory". The listener connects again (a registration cannot be kept in part), but
    /// with a pause that doubles from the first (100 ms) up to the longest (2 s), not the
    /// first pause each time: in 10 s at most as many connections as that schedule
    /// allows, and at least two (it did fail and try again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_lock_table_makes_the_listener_try_again_after_a_growing_pause() {
        const HELD: i64 = 16_000;
        const WATCHED: usize = 10_000;
        const WINDOW: Duration = Duration::from_secs(10);
        let server = server().await;
        let proxy = harness::require(harness::proxy::FaultProxy::start(server.addr()).await);
        let url = format!(
            "postgres://{}:{}@{}/postgres",
            harness::postgres::USER,
            harness::postgres::PASSWORD,
            proxy.addr()
        );
        let backend = PgBuilder::new(url).build_lease_backend().unwrap();
        backend.setup().await.unwrap();
        backend.connect().await.unwrap();
        let mut holder = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url())
            .await
            .unwrap();
        sqlx::query("SELECT count(pg_advisory_lock(-i)) FROM generate_series(1, $1::bigint) AS i")
            .bind(HELD)
            .execute(&mut holder)
            .await
            .unwrap();

        let before = proxy.accepted();
        let watches: Vec<ReleaseWatch> = (0..WATCHED)
            .map(|i| {
                backend
                    .watch_releases(&key(&format!("full:{i}")))
                    .expect("in a runtime")
            })
            .collect();
        tokio::time::sleep(WINDOW).await;
        let connections = proxy.accepted() - before;

        // Attempts the doubling schedule allows in the window: the first at once, then one
        // after each pause that fits.
        let (mut allowed, mut pause, mut spent) =
            (1u64, Duration::from_millis(100), Duration::ZERO);
        while spent + pause <= WINDOW {
            spent += pause;
            allowed += 1;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
        assert!(
            connections >= 2,
            "the listener connected {connections} times: its registration never failed"
        );
        assert!(
            connections <= allowed,
            "the listener connected {connections} times in {WINDOW:?} with the lock table \
             full; a pause doubling from 100 ms to 2 s allows {allowed}"
        );
        sqlx::Connection::close(holder).await.unwrap();
        drop(watches);
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
