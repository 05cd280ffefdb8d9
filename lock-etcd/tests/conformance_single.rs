//! The conformance suite against a real single-member etcd.

mod common;

conformance::conformance_tests!(
    async { common::EtcdFactory::single().await.with_fenced_resource().await },
    capabilities: [link_faults, inspect, distinct_clients, wakes_waiters],
);
