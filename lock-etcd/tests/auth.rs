//! etcd with authentication: auth tokens expire (simple tokens once unused on a member for
//! `--auth-token-ttl`, JWTs after their TTL), and a held lock must outlive any number of
//! them, on one member and across a failover to a member whose token expired meanwhile.
//! The release watch, opened after the token expired, still wakes waiters.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::until_answered;
use distlock_core::{Fence, LockBackend, LockKey, Locker, Release, Renewal, RetryPolicy};
use harness::etcd::{EtcdAuth, EtcdCluster, EtcdServer};
use harness::require;
use lock_etcd::EtcdBackend;
use tokio::time::{Instant, sleep};

const PASSWORD: &str = "auth-test-password";
/// Tokens expire after 2 s unused; etcd checks every second.
const TOKEN_TTL: Duration = Duration::from_secs(2);
/// Long enough for a token to be gone: its TTL, one check interval, and slack.
const TOKEN_GONE: Duration = Duration::from_secs(4);
/// The locks' TTL: several token lifetimes, and room for an election during a failover.
const TTL: Duration = Duration::from_secs(10);

fn auth() -> EtcdAuth {
    EtcdAuth::new(PASSWORD, TOKEN_TTL)
}

fn key(name: &str) -> LockKey {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    LockKey::new(format!("etcd-auth:{random:016x}:{name}")).unwrap()
}

async fn backend(endpoints: Vec<String>) -> EtcdBackend {
    EtcdBackend::builder()
        .endpoints(endpoints)
        .credentials(EtcdAuth::USER, PASSWORD)
        .request_timeout(Duration::from_secs(3))
        .build()
        .await
        .expect("build with the right credentials")
}

fn renewed(renewal: Renewal) -> bool {
    matches!(renewal, Renewal::Renewed { .. })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_is_renewed_across_several_auth_token_lifetimes() {
    let server = require(EtcdServer::start_with_auth(&auth()).await);
    let backend = backend(vec![server.endpoint()]).await;
    let k = key("renewed");
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");

    // Each renewal comes after the token it was to be sent with has expired.
    for lifetime in 1..=3 {
        sleep(TOKEN_GONE).await;
        let renewal = backend.renew(&lease).await;
        assert!(
            matches!(renewal, Ok(Renewal::Renewed { .. })),
            "renewal after token lifetime {lifetime}: {renewal:?}"
        );
    }
    sleep(TOKEN_GONE).await;
    assert_eq!(backend.fence(&lease).await.unwrap(), Fence::Current);
    let other = key("taken-later");
    let later = backend
        .acquire(&other, TTL)
        .await
        .unwrap()
        .expect("a new lock is granted after the tokens expired");
    assert_eq!(backend.release(&later).await.unwrap(), Release::Released);
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_member_whose_auth_token_expired_keeps_the_lock() {
    let cluster = require(EtcdCluster::start_with_auth(&auth()).await);
    let [m0, m1, _] = cluster.members() else {
        panic!("three members")
    };
    // The client knows two of the three members, so a failover goes back to m0, whose
    // client authenticated when the backend was built.
    let backend = backend(vec![m0.endpoint(), m1.endpoint()]).await;
    let k = key("failover");
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");

    // m0 goes away: the client moves to m1 and authenticates there.
    require(m0.kill());
    let deadline = Instant::now() + TTL;
    let renewal = until_answered("renew on m1", deadline, || backend.renew(&lease)).await;
    assert!(renewed(renewal), "{renewal:?}");
    require(m0.restart().await);

    // The lock is renewed through m1 while m0 forgets the client's token.
    for _ in 0..3 {
        sleep(TOKEN_GONE / 2).await;
        let deadline = Instant::now() + TTL / 2;
        let renewal = until_answered("renew on m1", deadline, || backend.renew(&lease)).await;
        assert!(renewed(renewal), "{renewal:?}");
    }

    // m1 goes away: the client fails over to m0 with its expired token.
    require(m1.kill());
    let deadline = Instant::now() + TTL;
    let renewal = until_answered("renew on m0", deadline, || backend.renew(&lease)).await;
    assert!(renewed(renewal), "{renewal:?}");
    let deadline = Instant::now() + TTL;
    assert_eq!(
        until_answered("fence on m0", deadline, || backend.fence(&lease)).await,
        Fence::Current
    );
    assert_eq!(
        until_answered("release on m0", deadline, || backend.release(&lease)).await,
        Release::Released
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_watch_opened_after_the_auth_token_expired_wakes_the_waiter() {
    const BACKOFF: Duration = Duration::from_secs(30);
    let server = require(EtcdServer::start_with_auth(&auth()).await);
    let (holder, waiter) = (
        backend(vec![server.endpoint()]).await,
        backend(vec![server.endpoint()]).await,
    );
    let k = key("woken");
    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free key");
    // The waiter's client authenticated when it was built; its token is gone by now.
    sleep(TOKEN_GONE).await;
    let locker = Locker::builder(Arc::new(waiter))
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(Duration::from_secs(120)))
        .build()
        .unwrap();
    let waiting = {
        let k = k.clone();
        tokio::spawn(async move {
            let guard = locker.lock(&k).await.unwrap();
            let granted_at = Instant::now();
            guard.release().await.unwrap();
            granted_at
        })
    };
    sleep(Duration::from_secs(1)).await;

    let released_at = Instant::now();
    assert_eq!(holder.release(&lease).await.unwrap(), Release::Released);
    let granted_at = waiting.await.unwrap();
    // A waiter that polled would wait at least half its backoff.
    assert!(
        granted_at - released_at < Duration::from_secs(5),
        "granted {:?} after the release",
        granted_at - released_at
    );
}
