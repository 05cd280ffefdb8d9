//! The conformance cases that need server faults, on a single-member etcd of each test's
//! own (the shared servers of the other conformance binaries cannot be killed or paused).

mod common;

conformance::conformance_tests!(
    async {
        let factory = common::EtcdFactory::private_single().await;
        let fenced = lock_etcd::EtcdFencedResource::new(
            &factory.etcd().await,
            lock_api::EnforcementMode::Enforce,
        );
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [link_faults, server_faults, inspect, distinct_clients],
    only_needing: server_faults,
);
