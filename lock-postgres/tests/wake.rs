//! Waiters woken by releases on a real PostgreSQL, in both modes: a release reaches a
//! waiter in another backend instance through `NOTIFY`, well within the waiter's backoff;
//! a lost listener connection is opened again and its waiters woken; a cancelled waiter
//! leaves nothing watched.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{builder, shared_server, start_server};
use distlock_core::{Lease, LockBackend, LockGuard, LockKey, Locker, RetryPolicy};
use harness::postgres::PostgresServer;
use lock_postgres::LISTENER_APPLICATION_NAME;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Far longer than a handoff by notification takes: a waiter that polls waits at least
/// half of it.
const BACKOFF: Duration = Duration::from_secs(5);
/// Well under half the backoff, and far above a notification's delivery time.
const WOKEN_WITHIN: Duration = Duration::from_secs(1);
const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Two backend instances of one mode, as two processes would have.
struct Pair {
    holder: Arc<dyn LockBackend>,
    waiter: Arc<dyn LockBackend>,
}

async fn lease_pair(server: &PostgresServer) -> Pair {
    let holder = builder(server).build_lease_backend().unwrap();
    let waiter = builder(server).build_lease_backend().unwrap();
    Pair {
        holder: Arc::new(holder),
        waiter: Arc::new(waiter),
    }
}

async fn advisory_pair(server: &PostgresServer) -> Pair {
    let holder = builder(server).build_advisory_backend().unwrap();
    let waiter = builder(server).build_advisory_backend().unwrap();
    Pair {
        holder: Arc::new(holder),
        waiter: Arc::new(waiter),
    }
}

fn locker(backend: Arc<dyn LockBackend>) -> Locker {
    Locker::builder(backend)
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(Duration::from_secs(60)))
        .build()
        .unwrap()
}

/// The pids of the sessions that listen for releases.
async fn listeners(server: &PostgresServer) -> Vec<String> {
    let out = server
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity \
              WHERE application_name = '{LISTENER_APPLICATION_NAME}' AND state IS NOT NULL"
        ))
        .await
        .unwrap();
    out.lines().map(str::to_owned).collect()
}

/// Waits until exactly one session other than those in `except` listens; its pid.
async fn wait_for_listener(server: &PostgresServer, except: &[String]) -> String {
    let started = Instant::now();
    loop {
        let now: Vec<String> = listeners(server)
            .await
            .into_iter()
            .filter(|pid| !except.contains(pid))
            .collect();
        if let [pid] = now.as_slice() {
            return pid.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no single listener session: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The holder takes `k`; a waiter of the other instance starts locking it and reports
/// when it got it.
async fn held_with_a_waiter(pair: &Pair, k: &LockKey) -> (Lease, JoinHandle<(Instant, LockGuard)>) {
    let held = pair.holder.acquire(k, TTL).await.unwrap().expect("free");
    let waiter = locker(pair.waiter.clone());
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move {
            let guard = waiter.lock(&k).await.unwrap();
            (Instant::now(), guard)
        })
    };
    (held, waiting)
}

/// The holder releases `held`; the waiter gets the key within [`WOKEN_WITHIN`]. Its guard.
async fn release_reaches_the_waiter(
    pair: &Pair,
    held: &Lease,
    waiting: JoinHandle<(Instant, LockGuard)>,
) -> LockGuard {
    let released_at = Instant::now();
    pair.holder.release(held).await.unwrap();
    let (granted_at, guard) = waiting.await.unwrap();
    let waited = granted_at - released_at;
    assert!(
        waited < WOKEN_WITHIN,
        "granted {waited:?} after the release"
    );
    guard
}

/// The holder releases while a waiter of another instance sleeps in its 5 s backoff; the
/// waiter gets the key well within it.
async fn a_release_wakes_the_waiter(pair: Pair, server: &PostgresServer, name: &str) {
    let k = key(name);
    let (held, waiting) = held_with_a_waiter(&pair, &k).await;
    // The waiter's first attempt is refused and it sleeps in its backoff, listening.
    wait_for_listener(server, &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pair.waiter.watched_keys(), std::slice::from_ref(&k));
    let guard = release_reaches_the_waiter(&pair, &held, waiting).await;
    assert!(guard.token() > held.token());
    guard.release().await.unwrap();
    assert!(pair.waiter.watched_keys().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_release_wakes_a_waiter_of_another_instance_well_within_its_backoff() {
    let server = start_server().await;
    a_release_wakes_the_waiter(lease_pair(&server).await, &server, "wake:lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_release_wakes_a_waiter_of_another_instance_well_within_its_backoff() {
    let server = start_server().await;
    a_release_wakes_the_waiter(advisory_pair(&server).await, &server, "wake:advisory").await;
}

/// The listener's session is terminated right before the release, so the release's
/// notification reaches no one; the listener connects again, listens again and wakes
/// every waiter, which then finds the key free, still well within its backoff.
async fn a_lost_listener_connection_wakes_its_waiters_after_reconnecting(
    pair: Pair,
    server: &PostgresServer,
    name: &str,
) {
    let k = key(name);
    let (held, waiting) = held_with_a_waiter(&pair, &k).await;
    let first = wait_for_listener(server, &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = server
        .psql(&format!("SELECT pg_terminate_backend({first})"))
        .await
        .unwrap();
    assert_eq!(killed, "t");
    let guard = release_reaches_the_waiter(&pair, &held, waiting).await;
    // It listens again, on a new session.
    wait_for_listener(server, &[first]).await;
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_lost_listener_connection_is_opened_again_and_wakes_its_waiters() {
    let server = start_server().await;
    let pair = lease_pair(&server).await;
    a_lost_listener_connection_wakes_its_waiters_after_reconnecting(pair, &server, "lost:lease")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_lost_listener_connection_is_opened_again_and_wakes_its_waiters() {
    let server = start_server().await;
    let pair = advisory_pair(&server).await;
    a_lost_listener_connection_wakes_its_waiters_after_reconnecting(pair, &server, "lost:advisory")
        .await;
}

async fn a_cancelled_waiter_leaves_nothing_watched(pair: Pair, name: &str) {
    let k = key(name);
    let _held = pair.holder.acquire(&k, TTL).await.unwrap().expect("free");
    let waiter = locker(pair.waiter.clone());
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move { waiter.lock(&k).await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(pair.waiter.watched_keys(), [k]);
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    assert!(pair.waiter.watched_keys().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_cancelled_waiter_leaves_no_watched_key() {
    let server = shared_server().await;
    a_cancelled_waiter_leaves_nothing_watched(lease_pair(&server).await, "cancel:lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_cancelled_waiter_leaves_no_watched_key() {
    let server = shared_server().await;
    a_cancelled_waiter_leaves_nothing_watched(advisory_pair(&server).await, "cancel:advisory")
        .await;
}

/// The waiter's instance reaches the server through a proxy that then stops forwarding
/// without closing anything, as a NAT that dropped the flow would: its listener gets no
/// error, only silence. It notices by its ping within two request time limits and
/// connects again; once the network is back, its waiter is woken for the release it
/// missed, long before its backoff ends.
async fn a_silently_dead_listener_connection_is_replaced(kind: common::Kind, name: &str) {
    const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
    let server = start_server().await;
    let proxy = harness::require(harness::proxy::FaultProxy::start(server.addr()).await);
    let waiter_settings =
        common::builder_at(&common::url_at(proxy.addr())).request_timeout(REQUEST_TIMEOUT);
    let pair = match kind {
        common::Kind::Lease => Pair {
            holder: Arc::new(builder(&server).build_lease_backend().unwrap()),
            waiter: Arc::new(waiter_settings.build_lease_backend().unwrap()),
        },
        common::Kind::Advisory => Pair {
            holder: Arc::new(builder(&server).build_advisory_backend().unwrap()),
            waiter: Arc::new(waiter_settings.build_advisory_backend().unwrap()),
        },
    };
    let k = key(name);
    let (held, waiting) = held_with_a_waiter(&pair, &k).await;
    wait_for_listener(&server, &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let connections = proxy.active_connections();

    proxy.blackhole();
    let cut_at = Instant::now();
    pair.holder.release(&held).await.unwrap();
    // The listener gives up on its connection and opens another (held by the proxy
    // until the network heals).
    while proxy.active_connections() <= connections {
        assert!(
            cut_at.elapsed() < REQUEST_TIMEOUT * 4,
            "the listener still trusts its silent connection after {:?}",
            cut_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.heal();
    let healed_at = Instant::now();
    let (granted_at, guard) = waiting.await.unwrap();
    assert!(granted_at - healed_at < WOKEN_WITHIN + REQUEST_TIMEOUT);
    assert!(guard.token() > held.token());
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_a_silently_dead_listener_connection_is_replaced_and_its_waiters_woken() {
    a_silently_dead_listener_connection_is_replaced(common::Kind::Lease, "silent:lease").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_a_silently_dead_listener_connection_is_replaced_and_its_waiters_woken() {
    a_silently_dead_listener_connection_is_replaced(common::Kind::Advisory, "silent:advisory")
        .await;
}
