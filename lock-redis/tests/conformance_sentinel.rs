//! The whole conformance suite on Redis in high availability (one deployment per case): a
//! master, its replica and three Sentinels with quorum 2, clients connecting with a
//! `redis+sentinel://` URL. Each data node is behind a fault proxy: the link faults cut
//! the data nodes off (a blackhole: packets dropped, no reset) from clients, Sentinels and
//! each other. The server faults pause, kill and restart both data nodes at once; the
//! fail-over kills the master and the Sentinels promote the replica, the switchover is
//! `SENTINEL FAILOVER` (the replica promoted, the old master demoted to its replica).

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::SentinelFactory::start().await;
        let fenced = lock_redis::RedisFencedResource::new(
            factory.redis().await,
            distlock_core::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [link_faults, server_faults, inspect, distinct_clients, wakes_waiters, failover, clock_step],
);

use std::time::Duration;

use common::SentinelFactory;
use conformance::Factory;
use distlock_core::LockKey;
use harness::redis::RedisServer;

/// The `INFO replication` text of `node`.
async fn replication(node: &RedisServer) -> String {
    harness::require(node.command(&["INFO", "replication"]).await)
        .as_text()
        .unwrap_or_default()
}

/// Whether `node` replicates from `master_port` over a link that is up.
async fn follows(node: &RedisServer, master_port: u16) -> bool {
    let info = replication(node).await;
    info.contains("role:slave\r\n")
        && info.contains(&format!("master_port:{master_port}\r\n"))
        && info.contains("master_link_status:up\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_reach_the_nodes_only_through_the_proxies_the_link_faults_cut() {
    let factory = SentinelFactory::start().await;
    let d = &factory.deployment;
    let (proxies, nodes) = (&d.proxies, &d.nodes);
    assert_eq!(harness::require(d.master_addr().await), proxies[0].addr());
    assert!(follows(&nodes[1], proxies[0].port()).await);
    let redis = factory.backend().await;
    let key = LockKey::new("through-the-proxy").unwrap();
    let ttl = Duration::from_secs(30);
    let lease = redis.acquire(&key, ttl).await.unwrap().expect("a free key");

    let link = factory.link().unwrap();
    link.cut().await;
    let cut = redis.renew(&lease).await;
    assert!(cut.is_err(), "a renewal answered across the cut: {cut:?}");
    link.heal().await;
    // The client reconnects (through the Sentinels) after the silence.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while redis.renew(&lease).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no renewal after the heal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(harness::require(d.master_addr().await), proxies[0].addr());
}

/// The switchover demotes the old master, which runs on as the new one's replica; the
/// fail-over then kills the new master and the Sentinels promote the old one again; the
/// server faults' restart brings both nodes back, empty, the master the Sentinels name up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hand_overs_and_the_restart_do_what_they_say() {
    let factory = SentinelFactory::start().await;
    let d = factory.deployment.clone();
    let (proxies, nodes) = (&d.proxies, &d.nodes);
    let failover = factory.failover().unwrap();
    let key = LockKey::new("handed-over").unwrap();

    failover.switch_over(&key).await;
    assert_eq!(harness::require(d.master_addr().await), proxies[1].addr());
    assert!(nodes[0].is_running() && nodes[1].is_running());
    assert!(follows(&nodes[0], proxies[1].port()).await);
    assert!(replication(&nodes[1]).await.contains("role:master\r\n"));

    failover.fail_over(&key).await;
    assert_eq!(harness::require(d.master_addr().await), proxies[0].addr());
    assert!(!nodes[1].is_running(), "the old master was killed");
    assert!(replication(&nodes[0]).await.contains("role:master\r\n"));

    let fresh = SentinelFactory::start().await;
    let redis = fresh.backend().await;
    let lease = redis
        .acquire(&key, Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a free key");
    let server = fresh.server().unwrap();
    server.kill().await;
    assert!(fresh.deployment.nodes.iter().all(|n| !n.is_running()));
    server.restart().await;
    let (proxies, nodes) = (&fresh.deployment.proxies, &fresh.deployment.nodes);
    assert_eq!(
        harness::require(fresh.deployment.master_addr().await),
        proxies[0].addr()
    );
    assert!(follows(&nodes[1], proxies[0].port()).await);
    // The client reconnects after the restart.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let info = loop {
        match redis.inspect(&key).await {
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert!(e.is_retryable(), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    assert_eq!(
        info.unwrap().owner,
        None,
        "the restarted nodes kept no data (the lease of {:?} is gone)",
        lease.owner()
    );
}
