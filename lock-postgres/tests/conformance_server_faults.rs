//! The conformance cases that need server faults or a stepped clock, on both backends,
//! each test on a PostgreSQL server of its own (the shared server of the other conformance
//! binaries cannot be killed, paused or have its clock stepped), with the test role's
//! sessions also ended by `pg_terminate_backend`.

mod common;

use common::{Kind, PgFactory};
use conformance::factory::WithFencedResource;

/// A private server's factory whose fenced-counter workload writes through the guarded
/// row in that server's `distlock` schema.
async fn factory(kind: Kind) -> WithFencedResource<PgFactory> {
    PgFactory::private(kind).await.with_fenced_resource()
}

mod lease {
    conformance::conformance_tests!(
        super::factory(super::Kind::Lease),
        capabilities: [link_faults, server_faults, inspect, session_kill, clock_step],
        only_needing: server_faults,
    );
}

mod advisory {
    conformance::conformance_tests!(
        super::factory(super::Kind::Advisory),
        capabilities: [link_faults, server_faults, inspect, session_kill, clock_step],
        only_needing: server_faults,
    );
}

mod lease_clock {
    conformance::conformance_tests!(
        super::factory(super::Kind::Lease),
        capabilities: [link_faults, server_faults, inspect, session_kill, clock_step],
        only_needing: clock_step,
    );
}

mod advisory_clock {
    conformance::conformance_tests!(
        super::factory(super::Kind::Advisory),
        capabilities: [link_faults, server_faults, inspect, session_kill, clock_step],
        only_needing: clock_step,
    );
}
