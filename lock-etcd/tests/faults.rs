//! Faults on real etcd: the leader killed while a lock is held, a member paused, and the
//! client's connection blackholed. In every case the lock stays safe: a new holder gets a
//! higher token, and the old holder is fenced.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{EtcdFactory, until_answered};
use distlock_core::{
    Admission, EnforcementMode, Fence, FencedResource, Lease, LockBackend, LockGuard, LockKey,
    Locker, Release, Renewal,
};
use harness::require;
use lock_etcd::{EtcdBackend, EtcdFencedResource};
use tokio::time::{Instant, sleep, timeout_at};

const TTL: Duration = Duration::from_secs(2);

fn key(name: &str) -> LockKey {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    LockKey::new(format!("etcd-fault:{random:016x}:{name}")).unwrap()
}

/// A locker on `holder` with the test TTL, a guard of the free `key` from it, and the
/// guard's lease.
async fn guarded(holder: &EtcdBackend, key: &LockKey) -> (Locker, LockGuard, Lease) {
    let locker = Locker::builder(Arc::new(holder.clone()))
        .ttl(TTL)
        .build()
        .unwrap();
    let guard = locker.try_lock(key).await.unwrap().expect("free key");
    let old = guard.lease().clone();
    (locker, guard, old)
}

/// Acquires `key` with `client`, retrying while it is held or the store is unavailable.
async fn take_by(client: &EtcdBackend, key: &LockKey, deadline: Instant) -> Lease {
    loop {
        match client.acquire(key, TTL).await {
            Ok(Some(lease)) => return lease,
            Ok(None) => {}
            Err(e) if e.is_retryable() => {}
            Err(e) => panic!("acquire: {e}"),
        }
        assert!(
            Instant::now() < deadline,
            "{key} was not free again by the deadline"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// The old holder is fenced everywhere once the new one holds the key.
async fn assert_fenced(
    old_client: &EtcdBackend,
    old: &Lease,
    new_client: &EtcdBackend,
    new: &Lease,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    assert!(
        new.token() > old.token(),
        "new token {} after {}",
        new.token(),
        old.token()
    );
    let fence = until_answered("fence", deadline, || old_client.fence(old)).await;
    assert_eq!(
        fence,
        Fence::Stale {
            current: new.token()
        }
    );
    let renewal = until_answered("renew", deadline, || old_client.renew(old)).await;
    assert_eq!(renewal, Renewal::Lost);
    let release = until_answered("release", deadline, || old_client.release(old)).await;
    assert_eq!(release, Release::NotHeld);
    let fence = until_answered("fence", deadline, || new_client.fence(new)).await;
    assert_eq!(fence, Fence::Current, "the new holder is untouched");
    let resource = EtcdFencedResource::new(new_client, EnforcementMode::Enforce);
    let r = new.key().as_str();
    let admitted = until_answered("admit", deadline, || resource.check_only(r, new.token())).await;
    assert_eq!(admitted, Admission::Admitted);
    let late = until_answered("admit", deadline, || resource.check_only(r, old.token())).await;
    assert_eq!(
        late,
        Admission::Stale {
            latest: new.token()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_while_a_lock_is_held_keeps_it_safe() {
    let factory = EtcdFactory::private_cluster()
        .await
        .with_request_timeout(Duration::from_secs(3));
    let cluster = factory.cluster_servers().unwrap();
    let (a, b) = (factory.etcd().await, factory.etcd().await);
    let k = key("leader-kill");

    let sent = Instant::now();
    let old = a.acquire(&k, TTL).await.unwrap().expect("free key");
    let leader = require(cluster.leader_index().await);
    require(cluster.members()[leader].kill());
    let killed_at = Instant::now();
    // The old holder stops renewing (it is partitioned away with the old leader).
    let new_leader = require(cluster.leader_index().await);
    let elected_at = Instant::now();
    assert_ne!(new_leader, leader);

    let new = take_by(&b, &k, killed_at + Duration::from_secs(30)).await;
    let taken_at = Instant::now();
    println!(
        "leader kill: lease granted with TTL {TTL:?}; leader killed {:?} after the grant was \
         sent; new leader elected {:?} after the kill; key free again {:?} after the \
         election, i.e. the lease outlived its TTL by {:?}",
        killed_at - sent,
        elected_at - killed_at,
        taken_at - elected_at,
        taken_at.saturating_duration_since(sent + TTL),
    );
    assert_fenced(&a, &old, &b, &new).await;
    until_answered("release", Instant::now() + Duration::from_secs(10), || {
        b.release(&new)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_member_loses_its_clients_locks_and_the_others_carry_on() {
    let factory = EtcdFactory::private_cluster().await;
    let cluster = factory.cluster_servers().unwrap();
    let leader = require(cluster.leader_index().await);
    let follower = (leader + 1) % 3;
    let others: Vec<String> = (0..3)
        .filter(|&i| i != follower)
        .map(|i| format!("http://{}", factory.proxies()[i].addr()))
        .collect();
    let only_paused = format!("http://{}", factory.proxies()[follower].addr());
    let on = |endpoints: Vec<String>| {
        EtcdBackend::builder()
            .endpoints(endpoints)
            .key_prefix("distlock-test")
            .request_timeout(Duration::from_secs(1))
            .build()
    };
    let holder = on(vec![only_paused.clone()]).await.unwrap();
    let rest = on(others).await.unwrap();
    let k = key("paused");

    let (_locker, guard, old) = guarded(&holder, &k).await;
    require(cluster.members()[follower].pause());
    let paused_at = Instant::now();

    // The holder's renewals cannot reach the cluster: the guard reports the loss.
    let lost = timeout_at(paused_at + TTL * 2 + Duration::from_secs(1), guard.lost()).await;
    assert!(lost.is_ok(), "the guard noticed the loss");
    assert!(!guard.is_held());
    // A new client on the paused member alone gets a retryable error, never a lease.
    match on(vec![only_paused]).await {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("a client reached a paused member"),
    }
    // The rest of the cluster carries on; the key frees itself when its lease runs out.
    let new = take_by(&rest, &k, paused_at + Duration::from_secs(20)).await;
    for _ in 0..3 {
        let next_key = key("paused-cycle");
        let lease = take_by(&rest, &next_key, Instant::now() + Duration::from_secs(10)).await;
        assert_eq!(rest.release(&lease).await.unwrap(), Release::Released);
    }

    require(cluster.members()[follower].resume());
    // Once the member has caught up, its client sees the new holder and is fenced.
    assert_fenced(&holder, &old, &rest, &new).await;
    let _ = guard.release().await;
    rest.release(&new).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_connection_makes_the_guard_report_lost() {
    let cut_link = EtcdFactory::single().await;
    let clean_link = EtcdFactory::single().await;
    let holder = cut_link.etcd().await;
    let other = clean_link.etcd().await;
    let k = key("blackhole");

    let (_locker, guard, old) = guarded(&holder, &k).await;
    sleep(TTL / 2).await;
    cut_link.proxies().iter().for_each(|p| p.blackhole());
    let cut_at = Instant::now();

    let lost = timeout_at(cut_at + TTL * 2 + Duration::from_secs(1), guard.lost()).await;
    let lost_at = Instant::now();
    assert!(lost.is_ok(), "lost() resolved after the cut");
    assert!(!guard.is_held());
    assert!(
        guard.valid_until() <= cut_at + TTL,
        "no validity past the cut plus one TTL"
    );
    assert!(lost_at <= guard.valid_until() + Duration::from_millis(500));

    // Another client, on a working link, takes the key once the lease ran out in etcd.
    let new = take_by(&other, &k, cut_at + Duration::from_secs(10)).await;
    cut_link.proxies().iter().for_each(|p| {
        p.reset();
        p.heal();
    });
    assert_fenced(&holder, &old, &other, &new).await;
    let _ = guard.release().await;
    other.release(&new).await.unwrap();
}

/// Acquire, renew, fence and release on `client`, each of which must succeed at once.
async fn lock_cycle(client: &EtcdBackend, k: &LockKey) {
    let lease = client
        .acquire(k, TTL)
        .await
        .unwrap_or_else(|e| panic!("acquire {k}: {e}"))
        .expect("free key");
    let renewal = client
        .renew(&lease)
        .await
        .unwrap_or_else(|e| panic!("renew {k}: {e}"));
    assert!(matches!(renewal, Renewal::Renewed { .. }), "{renewal:?}");
    assert_eq!(client.fence(&lease).await.unwrap(), Fence::Current);
    assert_eq!(client.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_fail_over_to_a_live_member_when_one_member_is_down() {
    let cluster = require(harness::etcd::EtcdCluster::start().await);
    let leader = require(cluster.leader_index().await);
    let dead = (leader + 1) % 3;
    let endpoints = cluster.endpoints();
    let build = |endpoints: Vec<String>| {
        EtcdBackend::builder()
            .endpoints(endpoints)
            .key_prefix("distlock-test")
            .request_timeout(Duration::from_secs(3))
            .build()
    };
    // Connected to the member that will die: it is first in the list, so preferred.
    let mut dead_first = endpoints.clone();
    dead_first.rotate_left(dead);
    let before = build(dead_first.clone()).await.unwrap();
    lock_cycle(&before, &key("before-kill")).await;

    require(cluster.members()[dead].kill());
    // A request already on the dying connection could be lost (`OutcomeUnknown`); this
    // test is about the calls made once the member is gone, so let the client see the
    // closed connection first.
    sleep(Duration::from_millis(200)).await;
    for round in 0..3 {
        lock_cycle(&before, &key(&format!("after-kill-{round}"))).await;
    }
    // Backends built while the member is down, with it first, in the middle and last.
    for shift in 0..3 {
        let mut order = endpoints.clone();
        order.rotate_left((dead + shift) % 3);
        let client = build(order.clone())
            .await
            .unwrap_or_else(|e| panic!("build on {order:?} with {dead} down: {e}"));
        for round in 0..3 {
            lock_cycle(&client, &key(&format!("built-down-{shift}-{round}"))).await;
        }
        let k = key(&format!("many-{shift}"));
        let keys = [k.clone(), key(&format!("many-{shift}-b"))];
        let leases: Vec<_> = client
            .acquire_many(&keys, TTL)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.expect("free key"))
            .collect();
        let released = client.release_many(&leases).await.unwrap();
        assert_eq!(released, [Release::Released, Release::Released]);
    }
    // Only the dead member listed: nothing to fail over to, a retryable error.
    match build(vec![dead_first[0].clone()]).await {
        Err(e) => assert!(e.is_retryable(), "{e}"),
        Ok(_) => panic!("a client on a dead member alone was built"),
    }
    // The member comes back; the clients keep working and still agree on tokens.
    require(cluster.members()[dead].restart().await);
    let only_restarted = build(vec![dead_first[0].clone()]).await.unwrap();
    let k = key("after-restart");
    let lease = before.acquire(&k, TTL).await.unwrap().expect("free key");
    let info = only_restarted.inspect(&k).await.unwrap();
    assert_eq!(info.owner, Some(lease.owner()));
    assert_eq!(info.token, Some(lease.token()));
    assert_eq!(before.release(&lease).await.unwrap(), Release::Released);
}

/// Batch items fail one by one: an item whose member did not answer is `Unreachable` while
/// the others answer. Repeated keys go in later waves, which start after the first wave
/// timed out on a silent member and moved on to the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reports_items_whose_member_did_not_answer_as_unreachable() {
    let factory = EtcdFactory::private_cluster()
        .await
        .with_request_timeout(Duration::from_secs(1));
    let client = factory.etcd().await;
    let k = key("batch-items");
    let ttl = Duration::from_secs(5);
    let released = client.acquire(&k, ttl).await.unwrap().expect("free key");
    assert_eq!(client.release(&released).await.unwrap(), Release::Released);
    let held = client
        .acquire(&k, ttl)
        .await
        .unwrap()
        .expect("released key");
    let both = [released.clone(), held.clone()];

    // The member the client uses goes silent: the first wave is unreachable, the second
    // is sent to the next member and answers.
    factory.proxies()[0].blackhole();
    let renewals = client.renew_many(&both).await.unwrap();
    assert_eq!(renewals[0], Renewal::Unreachable);
    assert!(
        matches!(renewals[1], Renewal::Renewed { .. }),
        "{renewals:?}"
    );

    factory.proxies()[0].heal();
    factory.proxies()[1].blackhole();
    let releases = client.release_many(&both).await.unwrap();
    assert_eq!(releases, [Release::Unreachable, Release::Released]);
    factory.proxies()[1].heal();
    let deadline = Instant::now() + Duration::from_secs(10);
    let fence = until_answered("fence", deadline, || client.fence(&held)).await;
    assert!(matches!(fence, Fence::Stale { .. }), "released: {fence:?}");
}

/// etcd sends a client away (`GOAWAY`, `too_many_pings`) at the third HTTP/2 ping in a row
/// that comes sooner than its policy allows after the one before, unless etcd has written
/// to the connection in between: sooner than `--grpc-keepalive-min-time` (5 s as shipped)
/// while a call or a watch is open, and at any interval while none is. A call made as the
/// connection closes fails. An idle client, with its release watch open and without, keeps
/// its connection through four pings' worth of the shortest interval etcd allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_client_is_not_sent_away_for_its_pings() {
    // etcd's default `--grpc-keepalive-min-time`.
    const MIN_PING_INTERVAL: Duration = Duration::from_secs(5);
    let (idle_link, watching_link) = (EtcdFactory::single().await, EtcdFactory::single().await);
    let (idle, watching) = (idle_link.etcd().await, watching_link.etcd().await);
    let k = key("idle");
    lock_cycle(&idle, &k).await;
    let mut watch = watching
        .watch_releases(&k)
        .expect("the etcd backend announces releases");
    // Once its watch is created, the listener wakes every watcher to look again.
    lock_cycle(&idle, &k).await;
    tokio::time::timeout(Duration::from_secs(10), watch.released())
        .await
        .expect("the release watch in place");
    let connections =
        |link: &EtcdFactory| -> u64 { link.proxies().iter().map(|p| p.accepted()).sum() };
    let before = [connections(&idle_link), connections(&watching_link)];

    sleep(MIN_PING_INTERVAL * 4 + Duration::from_secs(1)).await;
    lock_cycle(&idle, &k).await;
    lock_cycle(&watching, &k).await;
    assert_eq!(
        [connections(&idle_link), connections(&watching_link)],
        before,
        "connections made, [idle client, client with a watch open]: etcd sent one away"
    );
}
