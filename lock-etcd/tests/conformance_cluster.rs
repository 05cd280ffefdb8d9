//! The conformance suite against a real 3-member etcd cluster.

mod common;

conformance::conformance_tests!(
    async { common::EtcdFactory::cluster().await.with_fenced_resource().await },
    capabilities: [link_faults, inspect, distinct_clients, wakes_waiters],
);
