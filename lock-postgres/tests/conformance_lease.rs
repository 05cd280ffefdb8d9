//! The shared conformance suite on the lease-table backend, against a real PostgreSQL.

mod common;

use common::{Kind, PgFactory};
use lock_api::EnforcementMode;
use lock_postgres::PgFencedResource;

/// The fenced resource the fenced-counter workload writes through: the guarded row in
/// the shared server's `distlock` schema.
async fn fenced_resource() -> PgFencedResource {
    let server = common::shared_server().await;
    let backend = common::builder(&server)
        .build_lease_backend()
        .expect("valid settings");
    PgFencedResource::new(backend.pool().clone(), "distlock", EnforcementMode::Enforce)
        .expect("a valid schema name")
}

conformance::conformance_tests!(
    async {
        let factory = PgFactory::shared(Kind::Lease).await;
        let fenced = fenced_resource().await;
        conformance::factory::WithFencedResource::new(factory, fenced)
    },
    capabilities: [link_faults, inspect, wakes_waiters],
);
