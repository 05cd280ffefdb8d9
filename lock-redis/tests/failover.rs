//! A master dies and its replica takes over: batches stop sending to the dead address once
//! the cluster has healed, so leases in its slots are renewed again within one TTL.

mod common;

use std::time::Duration;

use common::{RedisClusterFactory, acquire_all};
use distlock_core::{LockBackend, LockKey, Renewal};
use harness::{redis::RedisServer, redis::RespValue};
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(20);

fn text(reply: RespValue) -> String {
    reply.as_text().unwrap_or_default()
}

/// Polls `probe` every 100 ms until it holds, for at most `limit`.
async fn wait_for<F, Fut>(what: &str, limit: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !probe().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A cluster-enabled node that joins the cluster as a replica of `master`.
async fn replica_of(master: &RedisServer) -> RedisServer {
    let replica = harness::require(RedisServer::builder().cluster(true).start().await);
    let master_id = text(harness::require(master.command(&["CLUSTER", "MYID"]).await));
    let master_port = master.port().to_string();
    harness::require(
        replica
            .command(&["CLUSTER", "MEET", "127.0.0.1", &master_port])
            .await,
    );
    wait_for(
        "the replica to meet its master",
        Duration::from_secs(20),
        || async {
            let reply = harness::require(
                replica
                    .command(&["CLUSTER", "REPLICATE", master_id.as_str()])
                    .await,
            );
            reply == RespValue::Simple("OK".into())
        },
    )
    .await;
    wait_for("the replica to sync", Duration::from_secs(20), || async {
        text(harness::require(
            replica.command(&["INFO", "replication"]).await,
        ))
        .contains("master_link_status:up")
    })
    .await;
    replica
}

async fn dbsize(node: &RedisServer) -> i64 {
    match harness::require(node.command(&["DBSIZE"]).await) {
        RespValue::Integer(n) => n,
        other => panic!("DBSIZE: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_a_failed_over_master_are_renewed_once_the_cluster_has_healed() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let moving = LockKey::new("failing-over").unwrap();
    let master = harness::require(
        f.cluster
            .node_for_key(redis.redis_key(&moving).as_bytes())
            .await,
    );
    // A lock on another master, which answers throughout.
    let mut staying = None;
    for i in 0.. {
        let key = LockKey::new(format!("staying-{i}")).unwrap();
        let node = harness::require(
            f.cluster
                .node_for_key(redis.redis_key(&key).as_bytes())
                .await,
        );
        if node.port() != master.port() {
            staying = Some(key);
            break;
        }
    }
    let replica = replica_of(master).await;

    let leases = acquire_all(&redis, &[moving.clone(), staying.unwrap()], TTL).await;
    // This batch caches the slot map, with the master that is about to die.
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    wait_for(
        "the replica to have the lock",
        Duration::from_secs(10),
        || async {
            let held = dbsize(master).await;
            held > 0 && dbsize(&replica).await == held
        },
    )
    .await;

    harness::require(master.kill());
    let deadline = leases[0].valid_until();
    loop {
        if let Ok(renewals) = redis.renew_many(&leases).await {
            if matches!(renewals[0], Renewal::Renewed { .. }) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the lease on the failed-over master was never renewed within its TTL"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The promoted replica serves the slot now.
    let role = text(harness::require(replica.command(&["ROLE"]).await.map(
        |r| match r {
            RespValue::Array(Some(items)) => {
                items.into_iter().next().unwrap_or(RespValue::Bulk(None))
            }
            other => other,
        },
    )));
    assert_eq!(role, "master");
}
