//! The whole conformance suite on a real 3-master Redis Cluster (one per case).

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::RedisClusterFactory::start().await;
        let fenced = lock_redis::RedisFencedResource::new(
            factory.redis().await,
            lock_api::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [inspect, distinct_clients, wakes_waiters],
);
