//! The whole conformance suite on a real single `redis-server` (one per case), with link
//! faults through a proxy and server faults through the harness.

mod common;

conformance::conformance_tests!(
    common::RedisFactory::start(),
    capabilities: [link_faults, server_faults, inspect, distinct_clients],
);
