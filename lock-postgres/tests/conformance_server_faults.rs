//! The conformance cases that need server faults, on both backends, each test on a
//! PostgreSQL server of its own (the shared server of the other conformance binaries
//! cannot be killed or paused), with the test role's sessions also ended by
//! `pg_terminate_backend`.

mod common;

use common::{Kind, PgFactory};
use conformance::factory::WithFencedResource;
use lock_api::EnforcementMode;
use lock_postgres::PgFencedResource;

/// A private server's factory whose fenced-counter workload writes through the guarded
/// row in that server's `distlock` schema.
async fn factory(kind: Kind) -> WithFencedResource<PgFactory> {
    let factory = PgFactory::private(kind).await;
    let backend = common::builder(factory.server())
        .build_lease_backend()
        .expect("valid settings");
    let fenced =
        PgFencedResource::new(backend.pool().clone(), "distlock", EnforcementMode::Enforce)
            .expect("a valid schema name");
    WithFencedResource::new(factory, fenced)
}

mod lease {
    conformance::conformance_tests!(
        super::factory(super::Kind::Lease),
        capabilities: [link_faults, server_faults, inspect, session_kill],
        only_needing: server_faults,
    );
}

mod advisory {
    conformance::conformance_tests!(
        super::factory(super::Kind::Advisory),
        capabilities: [link_faults, server_faults, inspect, session_kill],
        only_needing: server_faults,
    );
}
