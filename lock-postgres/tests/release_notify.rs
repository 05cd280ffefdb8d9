//! A release notifies only when some process waits for its key, so a release nobody waits
//! for never takes PostgreSQL's cluster-wide notify lock; an advisory release nobody waits
//! for writes nothing to the WAL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{builder, start_server, wal_insert_lsn};
use distlock_core::{LockBackend, LockKey, Locker, Release, RetryPolicy};
use harness::postgres::PostgresServer;
use lock_postgres::PgPooling;
use sha2::{Digest, Sha256};
use sqlx::Connection;
use sqlx::postgres::PgListener;

const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// The release channel of `mode` in the default schema, as the backend names it.
fn channel(mode: &str) -> String {
    let digest = Sha256::digest(b"distlock");
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("distlock_{mode}_{hex}")
}

/// A plain `LISTEN` on the release channel of `mode`: hears every notification sent,
/// whether or not a waiter is registered.
async fn eavesdrop(server: &PostgresServer, mode: &str) -> PgListener {
    let mut listener = PgListener::connect(&server.url()).await.unwrap();
    listener.listen(&channel(mode)).await.unwrap();
    listener
}

/// Whether a notification naming `name` arrives within a second.
async fn heard(listener: &mut PgListener, name: &str) -> bool {
    let wait = async {
        loop {
            let n = listener.recv().await.unwrap();
            if n.payload() == name {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), wait)
        .await
        .is_ok()
}

/// Takes and releases `k` on `holder` until `listener` hears its release announced: until
/// a waiter's listener registered the key, a release is not announced, and the first
/// announced one opens the holder's announcer connection.
async fn until_announced(holder: &dyn LockBackend, listener: &mut PgListener, k: &LockKey) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let lease = holder.acquire(k, TTL).await.unwrap().expect("free");
        holder.release(&lease).await.unwrap();
        if heard(listener, k.as_str()).await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never announced");
    }
}

/// The holder releases a key nobody waits for: nothing is sent. Then a waiter of another
/// instance waits for a second key: its release is sent (the eavesdropper works).
async fn only_a_waited_for_key_is_announced(
    server: &PostgresServer,
    mode: &str,
    holder: Arc<dyn LockBackend>,
    waiter: Arc<dyn LockBackend>,
) {
    let mut listener = eavesdrop(server, mode).await;
    let alone = key(&format!("{mode}:alone"));
    let lease = holder.acquire(&alone, TTL).await.unwrap().expect("free");
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert!(
        !heard(&mut listener, alone.as_str()).await,
        "a release nobody waits for was announced"
    );

    let waited = key(&format!("{mode}:waited"));
    let lease = holder.acquire(&waited, TTL).await.unwrap().expect("free");
    let locker = Locker::builder(waiter.clone())
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(10),
        })
        .build()
        .unwrap();
    let waiting = {
        let waited = waited.clone();
        tokio::spawn(async move { locker.lock(&waited).await.unwrap() })
    };
    // The waiter's listener registers the key, then wakes the waiter, which is refused
    // again and sleeps.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert!(
        heard(&mut listener, waited.as_str()).await,
        "a release of a key a waiter waits for was not announced"
    );
    let guard = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("woken, not polled")
        .unwrap();
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_release_is_announced_only_when_someone_waits_for_its_key() {
    let server = start_server().await;
    let holder = builder(&server).build_lease_backend().unwrap();
    let waiter = builder(&server).build_lease_backend().unwrap();
    only_a_waited_for_key_is_announced(&server, "lease", Arc::new(holder), Arc::new(waiter)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_release_is_announced_only_when_someone_waits_for_its_key() {
    let server = start_server().await;
    let holder = builder(&server).build_advisory_backend().unwrap();
    let waiter = builder(&server).build_advisory_backend().unwrap();
    only_a_waited_for_key_is_announced(&server, "advisory", Arc::new(holder), Arc::new(waiter))
        .await;
}

/// Forty advisory releases nobody waits for write no WAL: each would otherwise write a
/// commit record (a notify gives its transaction an id), over 1.5 KiB in all. The margin
/// allows for a record the server writes on its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_releases_nobody_waits_for_write_no_wal() {
    const LOCKS: u32 = 40;
    let server = start_server().await;
    let backend = builder(&server)
        .pool_size(LOCKS)
        .build_advisory_backend()
        .unwrap();
    let mut leases = Vec::new();
    for i in 0..LOCKS {
        let k = key(&format!("wal:{i}"));
        leases.push(backend.acquire(&k, TTL).await.unwrap().expect("free"));
    }
    let before = wal_insert_lsn(&server).await;
    for lease in &leases {
        assert_eq!(backend.release(lease).await.unwrap(), Release::Released);
    }
    let written = wal_insert_lsn(&server).await - before;
    assert!(
        written < 300,
        "{LOCKS} releases wrote {written} bytes of WAL"
    );
}

/// Another application's notifying transaction that wrote something and stays in its
/// commit holds the server's notify lock (here: waiting for a synchronous standby that
/// never answers, as a commit waits for its flush on a slow disk). A release whose key someone waits
/// for still returns at once: it notifies nothing in its own transaction, and its
/// announcement, sent after it, waits instead. Then the commit ends and the waiter is woken.
async fn a_waited_release_does_not_queue_behind_other_notifying_commits(
    mode: &str,
    build: fn(lock_postgres::PgBuilder) -> Arc<dyn LockBackend>,
) {
    let server = start_server().await;
    // The test role's own commits do not wait for the standby; the superuser's do.
    for sql in [
        "CREATE TABLE another_application (v int)",
        "ALTER ROLE distlock SET synchronous_commit = local",
        "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
        "SELECT pg_reload_conf()",
    ] {
        server.psql(sql).await.unwrap();
    }
    let holder = build(builder(&server).request_timeout(Duration::from_secs(2)));
    let waiter = build(builder(&server));
    let k = key(&format!("{mode}:behind-notify"));
    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free");
    let watch = waiter.watch_releases(&k).expect("in a runtime");
    // Registered once the listener holds the key's waiter lock (shared, advisory).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server
        .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock'")
        .await
        .unwrap()
        != "1"
    {
        assert!(tokio::time::Instant::now() < deadline, "never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut other = sqlx::PgConnection::connect(&server.superuser_url())
        .await
        .unwrap();
    let stuck = tokio::spawn(async move {
        sqlx::query(
            "WITH w AS (INSERT INTO another_application VALUES (1) RETURNING 1) \
             SELECT pg_notify('another_application', '') FROM w",
        )
        .execute(&mut other)
        .await
        .map(drop)
    });
    // Its commit is waiting for the standby, with the notify lock held.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server
        .psql("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        .await
        .unwrap()
        != "1"
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other commit never waited (finished: {})",
            stuck.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let released = holder.release(&lease).await;
    for sql in [
        "ALTER SYSTEM RESET synchronous_standby_names",
        "SELECT pg_reload_conf()",
    ] {
        server.psql(sql).await.unwrap();
    }
    assert!(
        matches!(released, Ok(Release::Released)),
        "{mode}: the release queued behind another application's commit: {released:?}"
    );
    stuck.await.unwrap().unwrap();
    // The announcement went out once the lock was free.
    let mut watch = watch;
    tokio::time::timeout(Duration::from_secs(5), watch.released())
        .await
        .expect("the waiter was woken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_waited_release_does_not_queue_behind_other_notifying_commits() {
    a_waited_release_does_not_queue_behind_other_notifying_commits("lease", |b| {
        Arc::new(b.build_lease_backend().unwrap())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_waited_release_does_not_queue_behind_other_notifying_commits() {
    a_waited_release_does_not_queue_behind_other_notifying_commits("advisory", |b| {
        Arc::new(b.build_advisory_backend().unwrap())
    })
    .await;
}

/// The announcer's session ends while it idles (`idle_session_timeout`, a restart, here
/// `pg_terminate_backend`): the next waited release is still announced, on a new
/// connection, not lost to the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_the_announcers_session_ended_is_announced() {
    let server = start_server().await;
    let holder = builder(&server).build_lease_backend().unwrap();
    let waiter = builder(&server).build_lease_backend().unwrap();
    let mut listener = eavesdrop(&server, "lease").await;
    let k = key("announce:after-drop");
    let _watch = waiter.watch_releases(&k).expect("in a runtime");
    until_announced(&holder, &mut listener, &k).await;
    let ended = server
        .psql(&format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
              WHERE application_name = '{}'",
            lock_postgres::ANNOUNCER_APPLICATION_NAME
        ))
        .await
        .unwrap();
    assert_eq!(ended, "1", "one announcer session");

    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free");
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    assert!(
        heard(&mut listener, k.as_str()).await,
        "the first release after the announcer's session ended was not announced"
    );
}

/// A synchronous standby that went away (`synchronous_standby_names` naming a server that
/// is gone): a transaction that ran `NOTIFY` waits in its commit for the standby, holding
/// PostgreSQL's cluster-wide notify lock, and every later notifying commit waits behind
/// it. The announcer's statement is one of them; once the announcer gives up on it, the
/// server ends it too instead of keeping a backend waiting on the lock for nobody, and so
/// does the statement it sends again on a new connection. The application's role commits
/// with `synchronous_commit = local` ([`commits_locally`]), so its own writes do not wait
/// for the standby.
async fn an_announcement_stuck_behind_the_notify_lock(
    server: &PostgresServer,
    url: &str,
    pooling: PgPooling,
) {
    const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
    /// Scheduling on a loaded machine, past the server's limit.
    const MARGIN: Duration = Duration::from_secs(5);
    let stuck_announcer = format!(
        "application_name = '{}' AND wait_event_type = 'Lock'",
        lock_postgres::ANNOUNCER_APPLICATION_NAME
    );
    let lease_backend = |url: &str, pooling| {
        common::builder_at(url)
            .pooling(pooling)
            .request_timeout(REQUEST_TIMEOUT)
            .build_lease_backend()
            .unwrap()
    };
    // The holder's announcer sends as `url` and `pooling` say; the waiter listens on a
    // session of its own (`LISTEN` needs one).
    let holder = lease_backend(url, pooling);
    let waiter = lease_backend(&server.url(), PgPooling::Session);
    let mut listener = eavesdrop(server, "lease").await;
    let k = key("announce:stuck");
    let _watch = waiter.watch_releases(&k).expect("in a runtime");
    until_announced(&holder, &mut listener, &k).await;

    server
        .psql("ALTER SYSTEM SET synchronous_standby_names = 'gone'")
        .await
        .unwrap();
    server.psql("SELECT pg_reload_conf()").await.unwrap();
    // The reload is a signal, and commits wait for standbys only once the checkpointer
    // took the setting in: until then a notifying commit goes through, and another is
    // started.
    let mut observer = common::observer(server).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let stalled = loop {
        let mut notifier = sqlx::PgConnection::connect(&server.url()).await.unwrap();
        let notifying = tokio::spawn(async move {
            // A write, so that the commit waits for the standby, as the role's sessions
            // do not.
            sqlx::raw_sql(
                "BEGIN; SET LOCAL synchronous_commit = on; CREATE TEMP TABLE stall (); \
                 NOTIFY distlock_test_stall; COMMIT",
            )
            .execute(&mut notifier)
            .await
        });
        while !notifying.is_finished()
            && common::sessions(&mut observer, "wait_event = 'SyncRep'").await == 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !notifying.is_finished() {
            break notifying;
        }
        notifying.await.unwrap().unwrap();
        assert!(
            tokio::time::Instant::now() < deadline,
            "commits never waited for the standby"
        );
    };

    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free");
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while common::sessions(&mut observer, &stuck_announcer).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the announcement never waited on the notify lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first statement, then the one sent again on a new connection: each backend
    // seen waiting must be gone within the limit (and scheduling) of when it was first seen.
    let watch_until = tokio::time::Instant::now() + 2 * (REQUEST_TIMEOUT + MARGIN);
    let mut first_seen: std::collections::HashMap<i32, tokio::time::Instant> = Default::default();
    let mut overdue = Vec::new();
    while tokio::time::Instant::now() < watch_until && overdue.is_empty() {
        let pids: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT pid FROM pg_stat_activity WHERE {stuck_announcer}"
        )))
        .persistent(false)
        .fetch_all(&mut observer)
        .await
        .unwrap();
        let now = tokio::time::Instant::now();
        for pid in pids {
            let since = *first_seen.entry(pid).or_insert(now);
            if now - since > REQUEST_TIMEOUT + MARGIN {
                overdue.push(pid);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    server
        .psql("ALTER SYSTEM RESET synchronous_standby_names")
        .await
        .unwrap();
    server.psql("SELECT pg_reload_conf()").await.unwrap();
    stalled.await.unwrap().unwrap();
    assert!(
        overdue.is_empty(),
        "announcer backends {overdue:?} still waiting on the notify lock after the server's \
         limit (all seen waiting: {first_seen:?})"
    );
}

/// A server whose application role commits with `synchronous_commit = local`: a session
/// takes it when it starts, so before any session of the role (a pooler's too) opens.
async fn commits_locally() -> PostgresServer {
    let server = start_server().await;
    server
        .psql(&format!(
            "ALTER ROLE {} SET synchronous_commit = local",
            harness::postgres::USER
        ))
        .await
        .unwrap();
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announcement_stuck_behind_the_notify_lock_does_not_stay_waiting_on_the_server() {
    let server = commits_locally().await;
    an_announcement_stuck_behind_the_notify_lock(&server, &server.url(), PgPooling::Session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_transaction_pooling_a_stuck_announcement_does_not_stay_waiting_either() {
    use harness::pgbouncer::{PgBouncerServer, PoolMode};
    let server = commits_locally().await;
    let bouncer = harness::require(PgBouncerServer::start(&server, PoolMode::Transaction).await);
    an_announcement_stuck_behind_the_notify_lock(&server, &bouncer.url(), PgPooling::Transaction)
        .await;
}
