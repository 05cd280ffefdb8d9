//! The whole conformance suite on a real 3-master Redis Cluster (one per case).

mod common;

conformance::conformance_tests!(
    common::RedisClusterFactory::start(),
    capabilities: [inspect, distinct_clients],
);
