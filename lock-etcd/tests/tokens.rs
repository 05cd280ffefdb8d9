//! Tokens as etcd is run and repaired: they keep rising after a snapshot restore, and an
//! attempt on a held key writes nothing to the raft log.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use distlock_core::{Fence, FencingToken, LockBackend, LockKey, Release};
use etcd_client::Client;
use harness::etcd::EtcdServer;
use harness::require;
use lock_etcd::EtcdBackend;

const TTL: Duration = Duration::from_secs(2);

async fn backend(server: &EtcdServer) -> EtcdBackend {
    EtcdBackend::builder()
        .endpoint(server.endpoint())
        .build()
        .await
        .unwrap()
}

/// Takes and releases `key` `times` times; the tokens granted, in order.
async fn cycles(backend: &EtcdBackend, key: &LockKey, times: usize) -> Vec<FencingToken> {
    let mut tokens = Vec::with_capacity(times);
    for _ in 0..times {
        let lease = backend.acquire(key, TTL).await.unwrap().expect("free key");
        assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
        tokens.push(lease.token());
    }
    tokens
}

/// `etcdctl snapshot restore` brings the revision back to the snapshot's: tokens that were
/// revisions would be granted again to new holders, and a stale holder's writes admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_increasing_after_a_snapshot_restore() {
    let server = require(EtcdServer::start().await);
    let key = LockKey::new("restored").unwrap();
    let before = backend(&server).await;
    cycles(&before, &key, 3).await;
    let snapshot = server.dir().join("backup.db");
    require(server.save_snapshot(&snapshot).await);
    // Grants after the backup, which the restore forgets; the last one is still held.
    let mut lost = cycles(&before, &key, 20).await;
    let stale = before.acquire(&key, TTL).await.unwrap().expect("free key");
    lost.push(stale.token());
    assert!(lost.windows(2).all(|w| w[0] < w[1]), "{lost:?}");
    drop(before);

    require(server.restore_snapshot(&snapshot).await);
    let after = backend(&server).await;
    let newest = *lost.last().unwrap();
    let fresh = cycles(&after, &key, 5).await;
    assert!(
        fresh[0] > newest,
        "after the restore the first token was {:?}, at or below {newest:?} granted before it \
         (tokens after the restore: {fresh:?})",
        fresh[0]
    );
    assert!(fresh.windows(2).all(|w| w[0] < w[1]), "{fresh:?}");
    // The holder from before the restore, as a tool would name it (`adopt`), is stale.
    let stale = after
        .adopt(&key, stale.owner(), stale.token(), TTL)
        .unwrap();
    let fence = after.fence(&stale).await.unwrap();
    assert!(
        matches!(fence, Fence::Stale { current } if current > stale.token()),
        "{fence:?}"
    );
}

/// The raft log's index moves with every consensus write (a lease grant, a transaction
/// that may write, a revoke); a read moves it not.
async fn raft_index(server: &EtcdServer) -> u64 {
    let mut client = Client::connect([server.endpoint()], None).await.unwrap();
    client.status().await.unwrap().raft_index()
}

/// A contended attempt used to cost three consensus writes (grant, a transaction whose
/// comparison failed, revoke), each flushed on a quorum, exactly while a key is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_on_a_held_key_write_nothing_to_the_raft_log() {
    let server = require(EtcdServer::start().await);
    // Acquires start a sweep of expired token keys when one is due, which claims its turn
    // with a write: the next one is made due in half an hour, as after a sweep.
    let due = SystemTime::now() + Duration::from_secs(1800);
    let due_us = due.duration_since(UNIX_EPOCH).unwrap().as_micros();
    let mut client = Client::connect([server.endpoint()], None).await.unwrap();
    client
        .put("distlock/sweeps/tokens", due_us.to_string(), None)
        .await
        .unwrap();
    let (holder, other) = (backend(&server).await, backend(&server).await);
    let key = LockKey::new("busy").unwrap();
    let held = holder.acquire(&key, Duration::from_secs(30)).await.unwrap();
    assert!(held.is_some());

    let before = raft_index(&server).await;
    for _ in 0..10 {
        assert!(other.acquire(&key, TTL).await.unwrap().is_none());
    }
    let many = other
        .acquire_many(&[key.clone(), key.clone()], TTL)
        .await
        .unwrap();
    assert!(many.iter().all(Option::is_none));
    // Give anything sent in the background (a revoke) time to reach the log.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = raft_index(&server).await;
    assert_eq!(
        after - before,
        0,
        "11 refused attempts wrote {} raft entries",
        after - before
    );
}
