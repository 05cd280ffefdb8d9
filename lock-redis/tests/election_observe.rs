//! `Election::observe()` on Redis under a leader that keeps its role for many TTLs: the
//! stream stays alive across every renewal, reports that leader once with its token,
//! never yields an error, and still reports the resign that ends the term.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Election, Leader, LockError, Locker, Release};
use futures::{Stream, StreamExt};
use harness::redis::RedisServer;
use lock_redis::RedisBackend;
use tokio::time::timeout;

const TTL: Duration = Duration::from_millis(300);
/// How long the leader keeps its role: many TTLs, so many renewals.
const HELD: Duration = Duration::from_secs(6);
const POLL: Duration = Duration::from_millis(30);

/// An election for the role `nightly-report` on its own client of `server`.
async fn election(server: &RedisServer) -> Election {
    let backend = RedisBackend::builder()
        .url(server.url())
        .build()
        .await
        .expect("connect to the test server");
    let locker = Locker::builder(Arc::new(backend)).ttl(TTL).build().unwrap();
    Election::builder(locker, "nightly-report")
        .poll_interval(POLL)
        .build()
        .unwrap()
}

/// The next item of `leaders`, which must come within 5 s.
async fn next(
    leaders: &mut (impl Stream<Item = Result<Option<Leader>, LockError>> + Unpin),
) -> Result<Option<Leader>, LockError> {
    timeout(Duration::from_secs(5), leaders.next())
        .await
        .expect("observe() reports within 5 s")
        .expect("observe() has not ended")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_keeps_reporting_a_leader_that_holds_its_role_for_many_ttls() {
    let server = harness::require(RedisServer::start().await);
    let (candidate, observer) = (election(&server).await, election(&server).await);
    let mut leaders = Box::pin(observer.observe());

    assert!(
        next(&mut leaders).await.unwrap().is_none(),
        "nobody leads at first"
    );
    let leadership = candidate.campaign().await.unwrap();
    let seen = next(&mut leaders).await.unwrap().expect("the leader");
    assert_eq!(
        (seen.owner, seen.token),
        (leadership.owner(), leadership.token())
    );

    // Many TTLs later the stream has yielded nothing: no error, no other leader, no end.
    let quiet = timeout(HELD, leaders.next()).await;
    assert!(
        quiet.is_err(),
        "observe() yielded {:?} while one leader held the role",
        quiet.ok()
    );
    assert!(leadership.is_leader(), "the watchdog kept the role");
    let now = observer.leader().await.unwrap().expect("a leader");
    assert_eq!((now.owner, now.token), (seen.owner, seen.token));

    // The same stream still follows: it reports the resign.
    assert_eq!(leadership.resign().await.unwrap(), Release::Released);
    assert!(
        next(&mut leaders).await.unwrap().is_none(),
        "nobody leads after the resign"
    );
}
