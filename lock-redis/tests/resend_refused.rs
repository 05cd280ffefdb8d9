//! An acquire whose reply was lost may have taken its key: it is sent again, and when the
//! second send is refused (here BUSY: the server runs a long script) the outcome is still
//! unknown, not `Unavailable`, and the key the first send took is freed in the background,
//! the cleanup sending again the deletes the server refused for now.

mod common;

use std::time::Duration;

use distlock_core::{LockBackend, LockError, LockKey};
use harness::proxy::FaultProxy;
use harness::redis::{RedisServer, RespValue};
use lock_redis::RedisBackend;
use tokio::time::{Instant, sleep};

/// Room for the delayed first send, the reset and the resend.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Each way through the proxy while the first send is on its way.
const DELAY: Duration = Duration::from_millis(300);
/// Far longer than the test: only the cleanup can free the key in time.
const TTL: Duration = Duration::from_secs(60);
/// How long the long script holds the server: past the resend's arrival (about
/// `DELAY / 3 + DELAY` after the reset), and well inside the cleanup's two response
/// timeouts.
const BUSY_FOR: Duration = Duration::from_millis(800);
/// How many response timeouts the cleanup of an acquire may take in all (the backend's
/// `CLEANUP_TIMEOUTS`).
const CLEANUP_TIMEOUTS: u32 = 2;

/// Whether `key` exists; `None` while the server answers BUSY.
async fn exists(server: &RedisServer, key: &str) -> Option<bool> {
    match harness::require(server.command(&["EXISTS", key]).await) {
        RespValue::Integer(n) => Some(n == 1),
        RespValue::Error(e) if e.starts_with("BUSY") => None,
        other => panic!("EXISTS answered {other:?}"),
    }
}

/// The server, and what the acquire returned: its first send ran and its reply was lost
/// (the connection reset), and the send made again on a new connection met BUSY.
struct Refused {
    server: RedisServer,
    /// Kept: the cleanup goes through it.
    _proxy: FaultProxy,
    lock_key: String,
    outcome: Result<Option<distlock_core::Lease>, LockError>,
    returned_at: Instant,
    busy: tokio::task::JoinHandle<()>,
}

async fn acquire_whose_resend_is_refused() -> Refused {
    let server = harness::require(RedisServer::start().await);
    // A script past 10 ms of running makes the server answer every other client BUSY.
    harness::require(
        server
            .command(&["CONFIG", "SET", "busy-reply-threshold", "10"])
            .await,
    );
    let proxy = harness::require(FaultProxy::start(server.addr()).await);
    let redis = RedisBackend::builder()
        .url(format!("redis://{}/", proxy.addr()))
        .request_timeout(RESPONSE_TIMEOUT)
        .build()
        .await
        .unwrap();
    let key = LockKey::new("refused-resend").unwrap();
    let lock_key = redis.redis_key(&key);

    proxy.delay(DELAY);
    let acquire = tokio::spawn({
        let (redis, key) = (redis.clone(), key.clone());
        async move {
            let outcome = redis.acquire(&key, TTL).await;
            (outcome, Instant::now())
        }
    });
    // The first send ran: the key is taken, its reply still on its way back.
    let deadline = Instant::now() + DELAY * 3;
    while exists(&server, &lock_key).await != Some(true) {
        assert!(
            Instant::now() < deadline,
            "the acquire never reached the server"
        );
        sleep(Duration::from_millis(10)).await;
    }
    let busy = tokio::spawn({
        let script = "local s = redis.call('TIME') \
             while true do \
               local n = redis.call('TIME') \
               if (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > tonumber(ARGV[1]) then return 1 end \
             end";
        let micros = BUSY_FOR.as_micros().to_string();
        let addr = server.addr();
        async move {
            let args = ["EVAL", script, "0", &micros];
            let busy = harness::redis::resp_command(addr, None, &args, BUSY_FOR * 2)
                .await
                .expect("the long script ran");
            assert_eq!(busy, RespValue::Integer(1));
        }
    });
    sleep(Duration::from_millis(50)).await;
    proxy.reset();
    // Healing at once could let the held-back reply through before the reset.
    sleep(DELAY / 3).await;
    proxy.heal();
    let (outcome, returned_at) = acquire.await.unwrap();
    Refused {
        server,
        _proxy: proxy,
        lock_key,
        outcome,
        returned_at,
        busy,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_reply_was_lost_and_whose_resend_was_refused_has_an_unknown_outcome() {
    let refused = acquire_whose_resend_is_refused().await;
    assert!(
        matches!(refused.outcome, Err(LockError::OutcomeUnknown { .. })),
        "the first send took the key, so the outcome is unknown: {:?}",
        refused.outcome
    );
    refused.busy.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_sends_again_the_deletes_a_busy_server_refused() {
    let refused = acquire_whose_resend_is_refused().await;
    assert!(
        refused.outcome.is_err(),
        "the acquire cannot have succeeded: {:?}",
        refused.outcome
    );
    // The cleanup gives up after two response timeouts; the key's TTL is a minute.
    let deadline = refused.returned_at + RESPONSE_TIMEOUT * CLEANUP_TIMEOUTS;
    while exists(&refused.server, &refused.lock_key).await != Some(false) {
        assert!(
            Instant::now() < deadline,
            "{} is still held once the cleanup has given up",
            refused.lock_key
        );
        sleep(Duration::from_millis(20)).await;
    }
    refused.busy.await.unwrap();
}
