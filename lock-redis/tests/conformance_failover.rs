//! The conformance cases that need a fail-over, on a 3-master Redis Cluster of each case's
//! own with a replica per master: the master of the case's key is killed and its replica
//! promoted while leases are live.

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::RedisFailoverFactory::start().await;
        let fenced = lock_redis::RedisFencedResource::new(
            factory.redis().await,
            lock_api::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [inspect, distinct_clients, wakes_waiters, failover],
    only_needing: failover,
);
