//! `adopt` (acting on a lease another client took, given its owner and token) and `purge`
//! (deleting a key's state, its token included) on a real PostgreSQL.

mod common;

use std::time::Duration;

use common::{Kind, backend, shared_server};
use distlock_core::{FencingToken, LockError, LockKey, OwnerId, Release, Renewal};

const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_releases_the_lock_another_client_took() {
    let server = shared_server().await;
    let (taker, tool) = (
        backend(&server, Kind::Lease).await,
        backend(&server, Kind::Lease).await,
    );
    let k = key("adopt:release");
    let lease = taker.acquire(&k, TTL).await.unwrap().unwrap();

    let adopted = tool.adopt(&k, lease.owner(), lease.token(), TTL).unwrap();
    assert_eq!(adopted.token(), lease.token());
    assert_eq!(tool.release(&adopted).await.unwrap(), Release::Released);

    let info = tool.inspect(&k).await.unwrap();
    assert_eq!(
        info.owner, None,
        "the key is free after the adopted release"
    );
    assert_eq!(info.token, Some(lease.token()), "the token is kept");
    assert_eq!(taker.renew(&lease).await.unwrap(), Renewal::Lost);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_with_the_wrong_owner_or_token_changes_nothing() {
    let server = shared_server().await;
    let (taker, tool) = (
        backend(&server, Kind::Lease).await,
        backend(&server, Kind::Lease).await,
    );
    let k = key("adopt:wrong");
    let lease = taker.acquire(&k, TTL).await.unwrap().unwrap();

    let stranger = tool
        .adopt(&k, OwnerId::random(), lease.token(), TTL)
        .unwrap();
    let old_token = tool
        .adopt(
            &k,
            lease.owner(),
            FencingToken(lease.token().get() - 1),
            TTL,
        )
        .unwrap();
    for forged in [&stranger, &old_token] {
        assert_eq!(tool.release(forged).await.unwrap(), Release::NotHeld);
        assert_eq!(tool.renew(forged).await.unwrap(), Renewal::Lost);
    }
    let info = tool.inspect(&k).await.unwrap();
    assert_eq!(info.owner, Some(lease.owner()), "the holder is untouched");
    assert_eq!(taker.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_refuses_a_ttl_the_backend_cannot_honour() {
    let server = shared_server().await;
    let tool = backend(&server, Kind::Lease).await;
    let err = tool
        .adopt(
            &key("adopt:ttl"),
            OwnerId::random(),
            FencingToken(1),
            Duration::ZERO,
        )
        .unwrap_err();
    assert!(matches!(err, LockError::InvalidTtl { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_advisory_backend_cannot_adopt_a_session_it_does_not_hold() {
    let server = shared_server().await;
    let tool = backend(&server, Kind::Advisory).await;
    let err = tool
        .adopt(
            &key("adopt:advisory"),
            OwnerId::random(),
            FencingToken(1),
            TTL,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            LockError::Unsupported {
                operation: "adopt",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_the_key_and_its_token_on_both_backends() {
    let server = shared_server().await;
    for kind in [Kind::Lease, Kind::Advisory] {
        let client = backend(&server, kind).await;
        let k = key(&format!("purge:{kind:?}"));
        let lease = client.acquire(&k, TTL).await.unwrap().unwrap();
        assert_eq!(client.release(&lease).await.unwrap(), Release::Released);
        assert_eq!(client.inspect(&k).await.unwrap().token, Some(lease.token()));

        client.purge(&k).await.unwrap();
        let info = client.inspect(&k).await.unwrap();
        assert_eq!((info.owner, info.token), (None, None), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_never_lowers_tokens_on_both_backends() {
    let server = shared_server().await;
    for kind in [Kind::Lease, Kind::Advisory] {
        let client = backend(&server, kind).await;
        let k = key(&format!("purge:floor:{kind:?}"));
        let mut last = None;
        for _ in 0..2 {
            let lease = client.acquire(&k, TTL).await.unwrap().unwrap();
            assert_eq!(client.release(&lease).await.unwrap(), Release::Released);
            last = Some(lease.token());
        }

        client.purge(&k).await.unwrap();
        let next = client.acquire(&k, TTL).await.unwrap().unwrap();
        assert!(
            Some(next.token()) > last,
            "{kind:?}: token {} after a purge that followed {last:?}",
            next.token()
        );
        assert_eq!(client.release(&next).await.unwrap(), Release::Released);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_leaves_other_keys_alone_and_a_missing_key_is_fine() {
    let server = shared_server().await;
    let client = backend(&server, Kind::Lease).await;
    let (gone, kept) = (key("purge:gone"), key("purge:kept"));
    let kept_lease = client.acquire(&kept, TTL).await.unwrap().unwrap();
    let gone_lease = client.acquire(&gone, TTL).await.unwrap().unwrap();
    client.release(&gone_lease).await.unwrap();

    client.purge(&gone).await.unwrap();
    client.purge(&key("purge:never-used")).await.unwrap();

    let info = client.inspect(&kept).await.unwrap();
    assert_eq!(info.owner, Some(kept_lease.owner()));
    assert_eq!(info.token, Some(kept_lease.token()));
    assert_eq!(
        client.release(&kept_lease).await.unwrap(),
        Release::Released
    );
}
