//! etcd-specific behaviour on a real server: what the lock and token keys hold,
//! TTLs follow etcd's whole-second leases and server minimum, leases are revoked on release,
//! renewal never touches a replaced key, the fenced resource, and bad input.

mod common;

use std::time::Duration;

use common::{EtcdFactory, shared_single};
use distlock_core::{
    Admission, EnforcementMode, Fence, FencedResource, FencingToken, LockBackend, LockError,
    LockKey, OwnerId, Release, Renewal,
};
use etcd_client::{Client, GetOptions};
use harness::etcd::EtcdServer;
use harness::{free_port, require};
use lock_etcd::{EtcdBackend, EtcdFencedResource};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(2);

fn key(name: &str) -> LockKey {
    LockKey::new(format!("etcd-test:{:016x}:{name}", rand_suffix())).unwrap()
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

async fn raw(server: &EtcdServer) -> Client {
    Client::connect([server.endpoint()], None).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttls_are_whole_seconds_at_least_the_server_minimum_and_never_rounded() {
    let factory = EtcdFactory::single().await;
    let backend = factory.etcd().await;
    // The harness runs etcd with its default 1 s election timeout: a 2 s minimum lease.
    assert_eq!(backend.server_min_ttl(), Duration::from_secs(2));
    let caps = backend.capabilities();
    assert_eq!(caps.ttl_granularity, Duration::from_secs(1));
    assert_eq!(caps.min_ttl, Duration::from_secs(2));

    let k = key("ttl");
    for (ttl, why) in [
        (Duration::from_secs(1), "minimum lease TTL"),
        (Duration::from_millis(1500), "whole seconds"),
        (Duration::from_millis(2500), "whole seconds"),
        (Duration::ZERO, "whole seconds"),
    ] {
        match backend.acquire(&k, ttl).await {
            Err(LockError::InvalidTtl { ttl: got, reason }) => {
                assert_eq!(got, ttl);
                assert!(reason.contains(why) || ttl.is_zero(), "{ttl:?}: {reason}");
            }
            other => panic!("{ttl:?} should be InvalidTtl, got {other:?}"),
        }
    }
    // Nothing was taken by the refused calls.
    let info = backend.inspect(&k).await.unwrap();
    assert_eq!(info.owner, None);
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_hold_the_owner_and_token_and_release_revokes_its_lease() {
    let server = shared_single().await;
    let factory = EtcdFactory::single().await;
    let backend = factory.etcd().await;
    let mut etcd = raw(&server).await;
    let k = key("token");

    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    let resp = etcd.get(backend.lock_key(&k), None).await.unwrap();
    let kv = &resp.kvs()[0];
    assert_eq!(
        kv.value_str().unwrap(),
        format!("{}:{}", lease.owner(), lease.token().get())
    );
    let tokens = etcd.get(backend.token_key(&k), None).await.unwrap();
    assert_eq!(
        tokens.kvs()[0].value_str().unwrap(),
        format!("{:020}", lease.token().get()),
        "the newest token, zero-padded so that etcd orders it as a number"
    );
    // The token comes from the client's clock (µs since 1970), not from a revision.
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    assert!(
        lease.token().get().abs_diff(clock) < 60_000_000,
        "token {:?}, clock {clock}",
        lease.token()
    );
    let lease_id = kv.lease();
    assert_ne!(lease_id, 0, "the lock key is attached to a lease");
    let ttl = etcd.lease_time_to_live(lease_id, None).await.unwrap();
    assert_eq!(ttl.granted_ttl(), 2, "the lease has exactly the asked TTL");

    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
    // The revoke runs in the background, well before the lease's own 2 s would lapse.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    loop {
        let ttl = etcd.lease_time_to_live(lease_id, None).await.unwrap();
        if ttl.ttl() == -1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "release revoked the lock's lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let info = backend.inspect(&k).await.unwrap();
    assert_eq!(
        info.token,
        Some(lease.token()),
        "the newest token outlives the key"
    );

    let next = backend
        .acquire(&k, TTL)
        .await
        .unwrap()
        .expect("released key");
    assert!(next.token() > lease.token());
    backend.release(&next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_never_extends_a_key_that_was_deleted_and_taken_again() {
    let server = shared_single().await;
    let factory = EtcdFactory::single().await;
    let (a, b) = (factory.etcd().await, factory.etcd().await);
    let mut etcd = raw(&server).await;
    let k = key("replaced");

    let old = a.acquire(&k, TTL).await.unwrap().expect("free key");
    // Someone deletes the key by hand; a new holder takes it.
    etcd.delete(a.lock_key(&k), None).await.unwrap();
    let new = b.acquire(&k, TTL).await.unwrap().expect("deleted key");
    assert!(new.token() > old.token());
    let new_lease = etcd.get(b.lock_key(&k), None).await.unwrap().kvs()[0].lease();

    assert_eq!(a.renew(&old).await.unwrap(), Renewal::Lost);
    assert_eq!(a.release(&old).await.unwrap(), Release::NotHeld);
    assert!(
        matches!(a.fence(&old).await.unwrap(), Fence::Stale { current } if current == new.token())
    );

    // The new holder's key and lease are untouched.
    let kv = etcd.get(b.lock_key(&k), None).await.unwrap().kvs()[0].clone();
    assert_eq!(
        kv.value_str().unwrap(),
        format!("{}:{}", new.owner(), new.token().get())
    );
    assert_eq!(kv.lease(), new_lease);
    assert_eq!(b.fence(&new).await.unwrap(), Fence::Current);
    assert!(matches!(
        b.renew(&new).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(b.release(&new).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_acts_only_with_the_right_owner_and_token() {
    let factory = EtcdFactory::single().await;
    let (a, tool) = (factory.etcd().await, factory.etcd().await);
    let k = key("adopt");
    let lease = a.acquire(&k, TTL).await.unwrap().expect("free key");

    let wrong_owner = tool
        .adopt(&k, OwnerId::random(), lease.token(), TTL)
        .unwrap();
    let wrong_token = tool.adopt(&k, lease.owner(), FencingToken(1), TTL).unwrap();
    assert_eq!(tool.renew(&wrong_owner).await.unwrap(), Renewal::Lost);
    assert_eq!(tool.release(&wrong_owner).await.unwrap(), Release::NotHeld);
    assert_eq!(tool.release(&wrong_token).await.unwrap(), Release::NotHeld);
    assert_eq!(a.fence(&lease).await.unwrap(), Fence::Current);

    let adopted = tool.adopt(&k, lease.owner(), lease.token(), TTL).unwrap();
    assert!(matches!(
        tool.renew(&adopted).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    assert_eq!(tool.release(&adopted).await.unwrap(), Release::Released);
    assert!(matches!(
        a.fence(&lease).await.unwrap(),
        Fence::Stale { .. }
    ));
    assert!(matches!(
        tool.adopt(
            &k,
            lease.owner(),
            lease.token(),
            Duration::from_millis(1500)
        ),
        Err(LockError::InvalidTtl { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_lease_is_renewed_for_the_ttl_etcd_granted_not_the_one_claimed() {
    let factory = EtcdFactory::single().await;
    let (holder, tool) = (factory.etcd().await, factory.etcd().await);
    let k = key("adopt-ttl");
    let lease = holder.acquire(&k, TTL).await.unwrap().expect("free key");

    // The tool believes the lock was taken for a minute; etcd granted its lease TTL.
    let claimed = Duration::from_secs(60);
    let adopted = tool
        .adopt(&k, lease.owner(), lease.token(), claimed)
        .unwrap();
    let renewal = tool.renew(&adopted).await.unwrap();
    let answered = Instant::now();
    let Renewal::Renewed { valid_until } = renewal else {
        panic!("the adopted lease is held: {renewal:?}");
    };
    assert!(
        valid_until <= answered + TTL,
        "valid for {:?} after the renewal answered, beyond the {TTL:?} etcd granted",
        valid_until - answered
    );
    assert_eq!(tool.release(&adopted).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_and_a_name_that_concatenate_alike_are_different_locks() {
    let server = shared_single().await;
    let base = format!("layout-{:016x}", rand_suffix());
    let on = |prefix: String| {
        EtcdBackend::builder()
            .endpoint(server.endpoint())
            .key_prefix(prefix)
            .build()
    };
    // "<base>/app" + "/locks/" + "x/locks/y" and "<base>/app/locks/x" + "/locks/" + "y"
    // read the same when the parts are simply joined.
    let outer = on(format!("{base}/app")).await.unwrap();
    let inner = on(format!("{base}/app/locks/x")).await.unwrap();
    let (outer_key, inner_key) = (
        LockKey::new("x/locks/y").unwrap(),
        LockKey::new("y").unwrap(),
    );
    let held = outer
        .acquire(&outer_key, TTL)
        .await
        .unwrap()
        .expect("free key");
    let other = inner
        .acquire(&inner_key, TTL)
        .await
        .unwrap()
        .expect("another prefix's lock is not this one");
    assert_eq!(outer.fence(&held).await.unwrap(), Fence::Current);
    assert_eq!(inner.fence(&other).await.unwrap(), Fence::Current);
    assert_ne!(outer.lock_key(&outer_key), inner.lock_key(&inner_key));
    assert_ne!(outer.token_key(&outer_key), inner.token_key(&inner_key));

    // The fenced resource's keys are laid out the same way.
    let outer_resource = EtcdFencedResource::new(&outer, EnforcementMode::Enforce);
    let data_prefix = on(format!("{base}/app/data/x")).await.unwrap();
    let inner_resource = EtcdFencedResource::new(&data_prefix, EnforcementMode::Enforce);
    assert_eq!(
        outer_resource
            .write("x/data/y", held.token(), b"outer")
            .await
            .unwrap(),
        Admission::Admitted
    );
    assert_eq!(inner_resource.read("y").await.unwrap(), None);
    assert_eq!(inner_resource.latest("y").await.unwrap(), None);

    assert_eq!(outer.release(&held).await.unwrap(), Release::Released);
    assert_eq!(inner.release(&other).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fenced_resource_stores_only_the_newest_holders_writes() {
    let factory = EtcdFactory::single().await;
    let backend = factory.etcd().await;
    let enforce = EtcdFencedResource::new(&backend, EnforcementMode::Enforce);
    let k = key("fenced");
    let resource = k.as_str();

    let first = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    backend.release(&first).await.unwrap();
    let second = backend
        .acquire(&k, TTL)
        .await
        .unwrap()
        .expect("released key");

    assert_eq!(
        enforce
            .write(resource, second.token(), b"from second")
            .await
            .unwrap(),
        Admission::Admitted
    );
    // The same token may write again.
    assert_eq!(
        enforce
            .write(resource, second.token(), b"second again")
            .await
            .unwrap(),
        Admission::Admitted
    );
    assert_eq!(
        enforce
            .write(resource, first.token(), b"late first")
            .await
            .unwrap(),
        Admission::Stale {
            latest: second.token()
        }
    );
    assert_eq!(
        enforce.read(resource).await.unwrap().as_deref(),
        Some(&b"second again"[..])
    );
    assert_eq!(
        enforce.latest(resource).await.unwrap(),
        Some(second.token())
    );
    assert_eq!(
        enforce.check_only(resource, first.token()).await.unwrap(),
        Admission::Stale {
            latest: second.token()
        }
    );

    // Shadow mode lets the stale write through, reports it, and never lowers the fence.
    let shadow = EtcdFencedResource::new(&backend, EnforcementMode::Shadow);
    assert_eq!(
        shadow
            .write(resource, first.token(), b"shadowed first")
            .await
            .unwrap(),
        Admission::ShadowStale {
            latest: second.token()
        }
    );
    assert_eq!(
        shadow.read(resource).await.unwrap().as_deref(),
        Some(&b"shadowed first"[..])
    );
    assert_eq!(shadow.latest(resource).await.unwrap(), Some(second.token()));
    assert!(matches!(
        enforce.write("", second.token(), b"x").await,
        Err(LockError::InvalidKey { .. })
    ));
    backend.release(&second).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_holders_fenced_in_etcd_lose_no_update() {
    let factory = EtcdFactory::single().await;
    let k = key("counter");
    let mut workers = Vec::new();
    for _ in 0..4 {
        let backend = factory.etcd().await;
        let k = k.clone();
        workers.push(tokio::spawn(async move {
            let fenced = EtcdFencedResource::new(&backend, EnforcementMode::Enforce);
            let mut done = 0;
            while done < 5 {
                let Some(lease) = backend.acquire(&k, TTL).await.unwrap() else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                let now: u64 = fenced
                    .read(k.as_str())
                    .await
                    .unwrap()
                    .map_or(0, |v| String::from_utf8(v).unwrap().parse().unwrap());
                let admitted = fenced
                    .write(k.as_str(), lease.token(), (now + 1).to_string().as_bytes())
                    .await
                    .unwrap();
                assert_eq!(admitted, Admission::Admitted);
                assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
                done += 1;
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let backend = factory.etcd().await;
    let fenced = EtcdFencedResource::new(&backend, EnforcementMode::Enforce);
    assert_eq!(
        fenced.read(k.as_str()).await.unwrap().as_deref(),
        Some(&b"20"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_unavailable() {
    let port = require(free_port());
    let started = tokio::time::Instant::now();
    let got = EtcdBackend::builder()
        .endpoint(format!("127.0.0.1:{port}"))
        .connect_timeout(Duration::from_millis(500))
        .request_timeout(Duration::from_secs(1))
        .build()
        .await;
    match got {
        Err(e @ LockError::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // Bounded by the connect and request timeouts, with generous slack.
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_are_a_configuration_error_that_never_shows_the_password() {
    let server = require(EtcdServer::start().await);
    let mut etcd = raw(&server).await;
    etcd.user_add("root", "right-password", None).await.unwrap();
    etcd.user_grant_role("root", "root").await.unwrap();
    etcd.auth_enable().await.unwrap();

    let build = |user: Option<(&str, &str)>| {
        let mut b = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .request_timeout(Duration::from_secs(3));
        if let Some((u, p)) = user {
            b = b.credentials(u, p);
        }
        b.build()
    };
    match build(Some(("root", "wrong-password-xyz"))).await {
        Err(e @ LockError::Config(_)) => {
            let shown = format!("{e} {e:?}");
            assert!(shown.contains("credentials"), "{shown}");
            assert!(!shown.contains("wrong-password-xyz"), "{shown}");
            assert!(!e.is_retryable());
        }
        other => panic!("expected Config, got {other:?}"),
    }
    assert!(matches!(build(None).await, Err(LockError::Config(_))));

    let backend = build(Some(("root", "right-password"))).await.unwrap();
    let shown = format!("{backend:?}");
    assert!(
        shown.contains("root") && !shown.contains("right-password"),
        "{shown}"
    );
    let k = key("auth");
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    assert_eq!(backend.release(&lease).await.unwrap(), Release::Released);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_live_under_the_prefix_only() {
    let server = shared_single().await;
    let factory = EtcdFactory::single().await;
    let backend = factory.etcd().await;
    let mut etcd = raw(&server).await;
    let k = key("prefix");
    let lease = backend.acquire(&k, TTL).await.unwrap().expect("free key");
    let under = etcd
        .get(
            format!("distlock-test/locks/{}", k.as_str()),
            Some(GetOptions::new().with_count_only()),
        )
        .await
        .unwrap();
    assert_eq!(under.count(), 1);
    backend.release(&lease).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_the_lock_key_the_token_key_and_the_lease() {
    let server = shared_single().await;
    let factory = EtcdFactory::single().await;
    let backend = factory.etcd().await;
    let mut etcd = raw(&server).await;
    let (held, free, other) = (key("purge-held"), key("purge-free"), key("purge-other"));

    let lease = backend
        .acquire(&held, TTL)
        .await
        .unwrap()
        .expect("free key");
    let lease_id = etcd.get(backend.lock_key(&held), None).await.unwrap().kvs()[0].lease();
    let released = backend
        .acquire(&free, TTL)
        .await
        .unwrap()
        .expect("free key");
    backend.release(&released).await.unwrap();
    let kept = backend
        .acquire(&other, TTL)
        .await
        .unwrap()
        .expect("free key");
    for k in [&held, &free] {
        assert!(backend.inspect(k).await.unwrap().token.is_some());
        backend.purge(k).await.unwrap();
        for etcd_key in [backend.lock_key(k), backend.token_key(k)] {
            let found = etcd.get(etcd_key.clone(), None).await.unwrap();
            assert!(found.kvs().is_empty(), "{etcd_key} is still there");
        }
        let info = backend.inspect(k).await.unwrap();
        assert_eq!((info.owner, info.token), (None, None), "{k}");
    }
    // The purged lock's lease is revoked before purge returns.
    let ttl = etcd.lease_time_to_live(lease_id, None).await.unwrap();
    assert_eq!(ttl.ttl(), -1, "the purged lock's lease is gone");
    assert_eq!(
        backend.fence(&lease).await.unwrap(),
        Fence::Stale {
            current: lease.token()
        }
    );
    // Purging a key that was never used, or twice, is fine; other keys are untouched.
    backend.purge(&key("purge-never")).await.unwrap();
    backend.purge(&held).await.unwrap();
    assert_eq!(backend.fence(&kept).await.unwrap(), Fence::Current);
    assert_eq!(backend.release(&kept).await.unwrap(), Release::Released);
}
