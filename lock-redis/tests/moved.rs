//! A slot that moves to another master after the client cached the slot map: batches
//! get `MOVED` for it, send those calls again through the client's routing, and succeed.

mod common;

use std::time::Duration;

use common::RedisClusterFactory;
use distlock_core::{Lease, LockBackend, LockKey, Release, Renewal};
use harness::{redis::RedisServer, redis::RespValue, redis::key_slot};
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(20);

async fn node_id(node: &RedisServer) -> String {
    harness::require(node.command(&["CLUSTER", "MYID"]).await)
        .as_text()
        .expect("CLUSTER MYID")
}

fn ok(reply: RespValue) {
    assert_eq!(reply, RespValue::Simple("OK".into()));
}

/// A master of the cluster other than `source`.
fn other_node<'a>(f: &'a RedisClusterFactory, source: &RedisServer) -> &'a RedisServer {
    f.cluster
        .nodes()
        .iter()
        .find(|n| n.port() != source.port())
        .unwrap()
}

/// Acquires `keys` in one batch and renews them in another, which caches the slot map;
/// the leases.
async fn acquire_and_cache(redis: &RedisBackend, keys: &[LockKey]) -> Vec<Lease> {
    let leases = common::acquire_all(redis, keys, TTL).await;
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })));
    leases
}

/// Starts moving `slot` from `source` to `target` (MIGRATING on the source, IMPORTING on
/// the target) and migrates every key of the slot there (the lock's key, and the
/// high-water key of the slot's tokens); the target's node id.
async fn migrate_keys(
    source: &RedisServer,
    target: &RedisServer,
    slot: u16,
    lock_key: &str,
) -> String {
    let (source_id, target_id) = (node_id(source).await, node_id(target).await);
    let slot_text = slot.to_string();
    ok(harness::require(
        target
            .command(&["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &source_id])
            .await,
    ));
    ok(harness::require(
        source
            .command(&["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &target_id])
            .await,
    ));
    let target_port = target.port().to_string();
    let RespValue::Array(Some(in_slot)) = harness::require(
        source
            .command(&["CLUSTER", "GETKEYSINSLOT", &slot_text, "100"])
            .await,
    ) else {
        panic!("CLUSTER GETKEYSINSLOT answered no array");
    };
    let in_slot: Vec<String> = in_slot.iter().filter_map(RespValue::as_text).collect();
    assert!(in_slot.iter().any(|k| k == lock_key), "{in_slot:?}");
    let mut migrate = vec![
        "MIGRATE",
        "127.0.0.1",
        &target_port,
        "",
        "0",
        "5000",
        "KEYS",
    ];
    migrate.extend(in_slot.iter().map(String::as_str));
    ok(harness::require(source.command(&migrate).await));
    target_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_follow_a_slot_migrated_after_the_slot_map_was_cached() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let moving = LockKey::new("migrating").unwrap();
    let staying = LockKey::new("staying-put").unwrap();
    let lock_key = redis.redis_key(&moving);
    let slot = key_slot(lock_key.as_bytes());
    let source = harness::require(f.cluster.node_for_slot(slot).await);
    let target = other_node(&f, source);

    // The first batch caches which master serves which slot.
    let leases = acquire_and_cache(&redis, &[moving.clone(), staying.clone()]).await;

    // Move the slot, with the lock's key, to the target master.
    let target_id = migrate_keys(source, target, slot, &lock_key).await;
    let slot_text = slot.to_string();
    for node in f.cluster.nodes() {
        ok(harness::require(
            node.command(&["CLUSTER", "SETSLOT", &slot_text, "NODE", &target_id])
                .await,
        ));
    }
    assert_eq!(
        harness::require(source.command(&["GET", lock_key.as_str()]).await),
        RespValue::Error(format!("MOVED {slot} 127.0.0.1:{}", target.port()))
    );

    // The cached map still names the source: the batch gets MOVED and sends again.
    let renewed = redis.renew_many(&leases).await.unwrap();
    assert!(
        renewed.iter().all(|r| matches!(r, Renewal::Renewed { .. })),
        "{renewed:?}"
    );
    assert!(matches!(
        redis.renew(&leases[0]).await.unwrap(),
        Renewal::Renewed { .. }
    ));
    let exists_on_target =
        || async { harness::require(target.command(&["EXISTS", lock_key.as_str()]).await) };
    assert_eq!(exists_on_target().await, RespValue::Integer(1));
    let released = redis.release_many(&leases).await.unwrap();
    assert_eq!(released, vec![Release::Released, Release::Released]);
    // The lock was freed on its new master.
    assert_eq!(exists_on_target().await, RespValue::Integer(0));
    let again = redis
        .acquire(&moving, TTL)
        .await
        .unwrap()
        .expect("free key");
    assert!(again.token() > leases[0].token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_follow_a_slot_in_the_middle_of_a_migration() {
    let f = RedisClusterFactory::start().await;
    let redis = f.redis().await;
    let keys = [
        LockKey::new("mid-migration-a").unwrap(),
        LockKey::new("mid-migration-b").unwrap(),
    ];
    // Batches cache the slot map before the migration starts.
    let leases = acquire_and_cache(&redis, &keys).await;

    for lease in &leases {
        // The slot stays MIGRATING / IMPORTING, with the lock's keys already moved: the
        // source answers ASK, and only `ASKING` first gets the target to run the call.
        let lock_key = redis.redis_key(lease.key());
        let slot = key_slot(lock_key.as_bytes());
        let source = harness::require(f.cluster.node_for_slot(slot).await);
        let target = other_node(&f, source);
        migrate_keys(source, target, slot, &lock_key).await;
    }

    assert_eq!(redis.release(&leases[0]).await.unwrap(), Release::Released);
    assert_eq!(
        redis.release_many(&leases[1..]).await.unwrap(),
        vec![Release::Released]
    );
}
