//! The conformance cases that need faults the main cluster binary's clusters lack, each
//! case on a 3-master Redis Cluster of its own: a fail-over (a replica per master; the
//! master of the case's key is killed and its replica promoted while leases are live), and
//! link faults (every node reached through a fault proxy).

mod common;

mod failover {
    conformance::conformance_tests!(
        async {
            let factory = super::common::RedisFailoverFactory::start().await;
            let fenced = lock_redis::RedisFencedResource::new(
                factory.redis().await,
                distlock_core::EnforcementMode::Enforce,
            );
            conformance::factory::WithFencedResource::new(factory, fenced)
        },
        capabilities: [inspect, distinct_clients, wakes_waiters, failover],
        only_needing: failover,
    );
}

mod link {
    conformance::conformance_tests!(
        async {
            let factory = super::common::RedisClusterFactory::behind_proxies().await;
            let fenced = lock_redis::RedisFencedResource::new(
                factory.redis().await,
                distlock_core::EnforcementMode::Enforce,
            );
            conformance::factory::WithFencedResource::new(factory, fenced)
        },
        capabilities: [link_faults, server_faults, inspect, distinct_clients, wakes_waiters, clock_step],
        only_needing: link_faults,
    );
}
