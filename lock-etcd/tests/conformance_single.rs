//! The conformance suite against a real single-member etcd.

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::EtcdFactory::single().await;
        let fenced = lock_etcd::EtcdFencedResource::new(
            &factory.etcd().await,
            lock_api::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [link_faults, inspect, distinct_clients, wakes_waiters],
);
