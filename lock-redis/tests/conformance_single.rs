//! The whole conformance suite on a real single `redis-server` (one per case), with link
//! faults through a proxy and server faults through the harness.

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::RedisFactory::start().await;
        let fenced = lock_redis::RedisFencedResource::new(
            factory.redis().await,
            distlock_core::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [link_faults, server_faults, inspect, distinct_clients, wakes_waiters, clock_step],
);
