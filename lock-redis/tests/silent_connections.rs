//! Connections that die without a reset (a NAT or balancer that dropped the flow, a host
//! gone): the proxy stops every byte of the connections open now, while new ones get
//! through. The backend's calls go over a new connection after the first call the silent
//! one timed out, and a waiter whose release listener fell silent is still woken. Every
//! connection has TCP keepalive, so the kernel also finds such a peer on an idle one.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::{RESPONSE_TIMEOUT, RedisFactory};
use distlock_core::{LockBackend, LockError, LockKey, Locker, Renewal, RetryPolicy};
use harness::redis::RespValue;
use lock_redis::RedisBackend;
use tokio::time::{Instant, sleep};

const TTL: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Calls waiting on a silent connection each fail once the response timeout has passed
/// (their outcome is unknown); the calls after them go over one new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_timeout_on_a_silent_connection_go_over_a_new_one() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let lease = redis.acquire(&key("held"), TTL).await.unwrap().unwrap();
    let before = f.proxy.accepted();

    f.proxy.blackhole_existing();
    let cut_at = Instant::now();
    let waiting: Vec<_> = (0..8)
        .map(|_| {
            let (redis, lease) = (redis.clone(), lease.clone());
            tokio::spawn(async move { redis.renew(&lease).await })
        })
        .collect();
    for renewal in futures::future::join_all(waiting).await {
        let renewal = renewal.unwrap();
        assert!(
            matches!(renewal, Err(LockError::OutcomeUnknown { .. })),
            "no reply on the silent connection: {renewal:?}"
        );
    }
    let timed_out = cut_at.elapsed();
    assert!(timed_out >= RESPONSE_TIMEOUT, "{timed_out:?}");

    // The next calls: one response timeout each at most, and they succeed.
    let started = Instant::now();
    let renewed = redis.renew(&lease).await;
    assert!(
        matches!(renewed, Ok(Renewal::Renewed { .. })),
        "the renewal after the timeouts went over a new connection: {renewed:?}"
    );
    let fresh = redis
        .acquire(&key("fresh"), TTL)
        .await
        .expect("an acquire over the new connection")
        .expect("a free key");
    println!(
        "eight calls timed out after {timed_out:?}; the next two took {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < RESPONSE_TIMEOUT * 2);
    assert_eq!(
        f.proxy.accepted() - before,
        1,
        "eight calls given up on one silent connection replace it once"
    );
    redis.release(&fresh).await.unwrap();
    redis.release(&lease).await.unwrap();
}

/// Far longer than a woken waiter takes, so a waiter that polled would be late.
const BACKOFF: Duration = Duration::from_secs(20);

/// The release listener's own connection falls silent (the waiter's other connection
/// keeps working); the key is released meanwhile, and the announcement never arrives.
/// The listener pings after a response timeout without a word, gives the connection up
/// when the ping goes unanswered for another, connects again, and wakes its waiter, who
/// takes the key long before its backoff ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_after_its_listeners_connection_fell_silent() {
    let f = RedisFactory::start().await;
    // The holder talks to the server directly: only the waiter's connections go through
    // the proxy.
    let holder = RedisBackend::builder()
        .url(f.server.url())
        .build()
        .await
        .unwrap();
    let k = key("woken");
    let lease = holder.acquire(&k, TTL).await.unwrap().unwrap();
    let waiter = f.redis().await;
    let channel = waiter.redis_key(&k);
    // The second, `build`'s try of a subscription, closed when `build` returned.
    assert_eq!(
        f.proxy.accepted(),
        2,
        "the waiter's backend has one connection"
    );
    let locker = Locker::builder(Arc::new(waiter))
        .ttl(TTL)
        .retry(RetryPolicy {
            initial: BACKOFF,
            max: BACKOFF,
        })
        .wait_timeout(Some(BACKOFF * 3))
        .build()
        .unwrap();
    let waiting = tokio::spawn({
        let k = k.clone();
        async move {
            let guard = locker.lock(&k).await;
            (Instant::now(), guard)
        }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while numsub(&f, &channel).await != 1 {
        assert!(Instant::now() < deadline, "the waiter never subscribed");
        sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        f.proxy.accepted(),
        3,
        "the listener has a connection of its own"
    );
    // The subscription wakes the waiter once (a release may have come before it): the
    // waiter has tried twice, and waits, once the server ran three acquires.
    while f.calls("evalsha").await < 3 {
        assert!(Instant::now() < deadline, "the waiter never looked again");
        sleep(Duration::from_millis(10)).await;
    }

    f.proxy.blackhole_connections(2..3);
    let cut_at = Instant::now();
    holder.release(&lease).await.unwrap();
    // Two response timeouts to find the silence, and one for the reconnect's pause
    // (50 ms), connecting, subscribing and the waiter's acquire.
    let (granted_at, guard) = waiting.await.unwrap();
    let guard = guard.expect("the waiter got the key");
    let took = granted_at - cut_at;
    println!("woken {took:?} after its listener's connection fell silent");
    assert!(took < RESPONSE_TIMEOUT * 3, "woken only after {took:?}");
    assert!(guard.token() > lease.token());
    assert_eq!(f.proxy.accepted(), 4, "the listener connected again");
    guard.release().await.unwrap();
}

/// Subscribers of `channel`, as the server counts them.
async fn numsub(f: &RedisFactory, channel: &str) -> i64 {
    let reply = harness::require(f.server.command(&["PUBSUB", "NUMSUB", channel]).await);
    match &reply {
        RespValue::Array(Some(items)) => match items.get(1) {
            Some(RespValue::Integer(n)) => *n,
            _ => panic!("PUBSUB NUMSUB answered {reply:?}"),
        },
        _ => panic!("PUBSUB NUMSUB answered {reply:?}"),
    }
}

/// The backend's connection and its release listener's have `SO_KEEPALIVE`: the kernel
/// runs their keepalive timer while they are idle (`/proc/net/tcp`, timer 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_has_tcp_keepalive() {
    let server = harness::require(harness::redis::RedisServer::start().await);
    // A response timeout long enough that the listener does not ping while it is looked at.
    let redis = RedisBackend::builder()
        .url(server.url())
        .request_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let k = key("kept-alive");
    let _held = redis.acquire(&k, TTL).await.unwrap().unwrap();
    let _watch = redis.watch_releases(&k).expect("a listener");
    let channel = redis.redis_key(&k);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(
        harness::require(server.command(&["PUBSUB", "NUMSUB", &channel]).await),
        RespValue::Array(Some(ref items)) if items.get(1) == Some(&RespValue::Integer(1))
    ) {
        assert!(Instant::now() < deadline, "the listener never subscribed");
        sleep(Duration::from_millis(10)).await;
    }

    // The backend's two connections, as the server knows them: the one whose last
    // command was the acquire, and the one subscribed (the harness's own connections
    // sent other commands). `build`'s try of a subscription closed its connection as it
    // returned; the server may take a moment to see it go.
    let backend_ports = loop {
        let clients = harness::require(server.command(&["CLIENT", "LIST"]).await)
            .as_text()
            .unwrap_or_default();
        let backend_ports: HashSet<u16> = clients
            .lines()
            .filter(|c| c.contains(" cmd=evalsha ") || c.contains(" cmd=subscribe "))
            .filter_map(|c| {
                let addr = c.split(' ').find_map(|f| f.strip_prefix("addr="))?;
                addr.rsplit(':').next()?.parse().ok()
            })
            .collect();
        if backend_ports.len() == 2 {
            break backend_ports;
        }
        assert!(
            Instant::now() < deadline,
            "the backend's connection and its listener's: {clients}"
        );
        sleep(Duration::from_millis(10)).await;
    };
    let ours = own_sockets();
    // `/proc/net/tcp` is read a page at a time and each read resumes at a position in a
    // table other tests' sockets come and go from, so a socket may be listed twice (seen
    // in CI: each of the two, twice) or not at all in one read: one entry per socket
    // (inode), and the table read again until both are in it.
    let timers: BTreeMap<u64, (u16, u8)> = loop {
        let timers: BTreeMap<u64, (u16, u8)> = tcp_table()
            .into_iter()
            .filter(|s| {
                s.remote_port == server.port()
                    && backend_ports.contains(&s.local_port)
                    && ours.contains(&s.inode)
            })
            .map(|s| (s.inode, (s.local_port, s.timer)))
            .collect();
        if timers.len() >= 2 || Instant::now() >= deadline {
            break timers;
        }
        sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(timers.len(), 2, "{timers:?}");
    for (port, timer) in timers.into_values() {
        assert_eq!(
            timer, 2,
            "the connection from port {port} runs no keepalive timer"
        );
    }
}

/// An established IPv4 TCP socket of this machine, from `/proc/net/tcp`.
struct Socket {
    local_port: u16,
    remote_port: u16,
    /// The pending timer: 0 none, 1 retransmit, 2 keepalive.
    timer: u8,
    inode: u64,
}

fn tcp_table() -> Vec<Socket> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // State 01: established.
            (f[3] == "01").then(|| Socket {
                local_port: port(f[1]),
                remote_port: port(f[2]),
                timer: f[5].split(':').next().unwrap().parse().unwrap(),
                inode: f[9].parse().unwrap(),
            })
        })
        .collect()
}

/// The inodes of this process's sockets.
fn own_sockets() -> HashSet<u64> {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            target
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}
