//! The conformance suite against a real single-member etcd.

mod common;

conformance::conformance_tests!(
    common::EtcdFactory::single(),
    capabilities: [link_faults, inspect, distinct_clients],
);
