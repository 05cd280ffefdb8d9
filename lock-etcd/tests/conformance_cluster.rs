//! The conformance suite against a real 3-member etcd cluster.

mod common;

conformance::conformance_tests!(
    common::EtcdFactory::cluster(),
    capabilities: [link_faults, inspect, distinct_clients],
);
