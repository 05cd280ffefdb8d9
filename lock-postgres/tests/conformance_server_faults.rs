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

/// The cases on a private server of `kind` that need `only`, in a module `module`; both
/// backends declare the same capabilities here.
macro_rules! private_server_cases {
    ($module:ident, $kind:ident, $only:ident) => {
        mod $module {
            conformance::conformance_tests!(
                super::factory(super::Kind::$kind),
                capabilities: [link_faults, server_faults, inspect, session_kill, clock_step],
                only_needing: $only,
            );
        }
    };
}

private_server_cases!(lease, Lease, server_faults);
private_server_cases!(advisory, Advisory, server_faults);
private_server_cases!(lease_clock, Lease, clock_step);
private_server_cases!(advisory_clock, Advisory, clock_step);
