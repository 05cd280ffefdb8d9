//! `RedisFencedResource`'s `FencedResource::write` checks the token and writes in one script: a stale holder's
//! write is refused even when it was paused between being admitted and writing.

mod common;

use std::time::Duration;

use common::{RedisClusterFactory, RedisFactory};
use distlock_core::{
    Admission, EnforcementMode, FencedResource, FencingToken, LockBackend, LockError, LockKey,
};
use harness::redis::RespValue;
use lock_redis::{RedisBackend, RedisFencedResource};

const RESOURCE: &str = "account:7";

/// The resource's value, as text so a failed assertion reads well.
async fn balance(ledger: &RedisFencedResource) -> Option<String> {
    let value = ledger.read(RESOURCE).await.unwrap();
    value.map(|v| String::from_utf8(v).unwrap())
}

async fn stale_write_is_refused_and_current_write_lands(redis: RedisBackend) {
    let ledger = RedisFencedResource::new(redis, EnforcementMode::Enforce);
    let first = ledger.write(RESOURCE, FencingToken(5), b"50").await;
    assert_eq!(first.unwrap(), Admission::Admitted);

    let stale = ledger.write(RESOURCE, FencingToken(4), b"40").await;
    assert_eq!(
        stale.unwrap(),
        Admission::Stale {
            latest: FencingToken(5)
        }
    );
    assert_eq!(
        balance(&ledger).await.as_deref(),
        Some("50"),
        "the stale write changed the value"
    );

    let same = ledger.write(RESOURCE, FencingToken(5), b"55").await;
    assert_eq!(same.unwrap(), Admission::Admitted);
    let newer = ledger.write(RESOURCE, FencingToken(6), b"60").await;
    assert_eq!(newer.unwrap(), Admission::Admitted);
    assert_eq!(balance(&ledger).await.as_deref(), Some("60"));
    assert_eq!(ledger.read("account:8").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_write_is_refused_and_current_token_write_lands() {
    let f = RedisFactory::start().await;
    stale_write_is_refused_and_current_write_lands(f.redis().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_write_is_refused_and_current_token_write_lands_on_a_cluster() {
    let f = RedisClusterFactory::start().await;
    stale_write_is_refused_and_current_write_lands(f.redis().await).await;
}

/// The old holder is admitted by `admit`, pauses past its lease, and writes after the new
/// holder: only the fenced write keeps the new holder's value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_old_holder_writing_after_the_new_holder_leaves_the_new_value() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let ledger = RedisFencedResource::new(redis.clone(), EnforcementMode::Enforce);
    let key = LockKey::new("payout").unwrap();
    let ttl = Duration::from_millis(500);

    let old = redis.acquire(&key, ttl).await.unwrap().expect("free lock");
    let checked = ledger.check_only(RESOURCE, old.token()).await.unwrap();
    assert_eq!(checked, Admission::Admitted);
    // The old holder pauses until its lease has expired; a new holder takes over.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let new = redis
        .acquire(&key, ttl)
        .await
        .unwrap()
        .expect("expired lock");
    assert!(new.token() > old.token());
    let landed = ledger.write(RESOURCE, new.token(), b"new").await;
    assert_eq!(landed.unwrap(), Admission::Admitted);

    let late = ledger.write(RESOURCE, old.token(), b"old").await;
    assert_eq!(
        late.unwrap(),
        Admission::Stale {
            latest: new.token()
        }
    );
    assert_eq!(
        balance(&ledger).await.as_deref(),
        Some("new"),
        "the paused old holder overwrote the new holder"
    );
}

/// Many writers at once: whatever the order, the value left is the highest token's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_leave_the_highest_tokens_value() {
    let f = RedisFactory::start().await;
    let ledger = RedisFencedResource::new(f.redis().await, EnforcementMode::Enforce);
    let writes = (1..=40u64).rev().map(|t| {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let value = t.to_string();
            ledger
                .write(RESOURCE, FencingToken(t), value.as_bytes())
                .await
                .unwrap()
        })
    });
    for write in futures::future::join_all(writes).await {
        write.unwrap();
    }
    assert_eq!(balance(&ledger).await.as_deref(), Some("40"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_lets_a_stale_write_through_and_reports_it_stale() {
    let f = RedisFactory::start().await;
    let ledger = RedisFencedResource::new(f.redis().await, EnforcementMode::Shadow);
    ledger
        .write(RESOURCE, FencingToken(5), b"50")
        .await
        .unwrap();

    let stale = ledger
        .write(RESOURCE, FencingToken(3), b"30")
        .await
        .unwrap();
    assert_eq!(
        stale,
        Admission::ShadowStale {
            latest: FencingToken(5)
        }
    );
    assert!(stale.is_admitted() && stale.was_stale());
    assert_eq!(
        balance(&ledger).await.as_deref(),
        Some("30"),
        "shadow mode must let the stale write through"
    );
    // The stale write did not lower the stored token.
    let still_stale = ledger.write(RESOURCE, FencingToken(4), b"40").await;
    assert_eq!(
        still_stale.unwrap(),
        Admission::ShadowStale {
            latest: FencingToken(5)
        }
    );
}

/// A fenced write on a cluster whose reply is lost after it was applied, while a newer
/// holder writes: sent again, it would meet the newer token and say `Stale`, "wrote
/// nothing", for a write that landed. It is never sent again; its outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_write_whose_reply_was_lost_is_never_reported_stale_on_a_cluster() {
    let f = RedisClusterFactory::behind_proxies().await;
    let proxies = f.proxies.clone().expect("behind proxies");
    let redis = f.redis().await;
    // The resource's keys, `<prefix>:fenced:{<resource>}` and its `:data` value, read and
    // written on their node directly, past the proxies.
    let fence = format!("{}:fenced:{{{RESOURCE}}}", redis.key_prefix());
    let data = format!("{fence}:data");
    let ledger = RedisFencedResource::new(redis, EnforcementMode::Enforce);
    assert_eq!(
        ledger
            .write(RESOURCE, FencingToken(4), b"40")
            .await
            .unwrap(),
        Admission::Admitted
    );
    // The node that has the keys (the others answer MOVED).
    let mut node = None;
    for n in f.cluster.nodes() {
        if n.command(&["EXISTS", &fence]).await.ok() == Some(RespValue::Integer(1)) {
            node = Some(n);
        }
    }
    let node = node.expect("a node holds the resource");
    let on_node = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            harness::require(node.command(&args).await).as_text()
        }
    };

    // 300 ms each way: the write lands a round trip before its reply could come back.
    proxies
        .iter()
        .for_each(|p| p.delay(Duration::from_millis(300)));
    let old = tokio::spawn({
        let ledger = ledger.clone();
        async move { ledger.write(RESOURCE, FencingToken(5), b"50").await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while on_node(&["GET", &data]).await.as_deref() != Some("50") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the write never landed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The reply is held back; a newer holder writes, as its own fenced write would.
    proxies.iter().for_each(|p| p.blackhole());
    on_node(&["SET", &fence, "6"]).await;
    on_node(&["SET", &data, "60"]).await;
    // The connection drops with the reply still held back (the reset takes effect within
    // a scheduler tick); then the links work again, without delay, so a client that sent
    // the write again would have its answer at once.
    proxies.iter().for_each(|p| {
        p.delay(Duration::ZERO);
        p.reset();
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxies.iter().for_each(|p| p.heal());

    let outcome = old.await.unwrap();
    assert!(
        !matches!(outcome, Ok(Admission::Stale { .. })),
        "an applied write was reported stale: {outcome:?}"
    );
    assert!(
        matches!(
            outcome,
            Ok(Admission::Admitted) | Err(LockError::OutcomeUnknown { .. })
        ),
        "{outcome:?}"
    );
    assert_eq!(
        on_node(&["GET", &data]).await.as_deref(),
        Some("60"),
        "the old write ran again"
    );
}
