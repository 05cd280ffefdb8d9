//! The conformance cases that need server faults, on an etcd of each test's own (the
//! shared servers of the other conformance binaries cannot be killed or paused): a single
//! member, and a 3-member cluster whose leader is the member paused or killed.

mod common;

mod single {
    conformance::conformance_tests!(
        async { super::common::EtcdFactory::private_single().await.with_fenced_resource().await },
        capabilities: [link_faults, server_faults, inspect, distinct_clients],
        only_needing: server_faults,
    );
}

mod leader {
    conformance::conformance_tests!(
        async { super::common::EtcdFactory::private_cluster().await.with_fenced_resource().await },
        capabilities: [link_faults, server_faults, inspect, distinct_clients],
        only_needing: server_faults,
    );
}
