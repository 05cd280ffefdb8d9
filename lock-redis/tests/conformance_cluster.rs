//! The whole conformance suite on a real 3-master Redis Cluster (one per case), with server
//! faults on every node at once (paused, killed, restarted).

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::RedisClusterFactory::start().await;
        let fenced = lock_redis::RedisFencedResource::new(
            factory.redis().await,
            distlock_core::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [server_faults, inspect, distinct_clients, wakes_waiters, clock_step],
);
