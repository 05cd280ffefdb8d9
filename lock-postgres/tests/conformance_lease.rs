//! The shared conformance suite on the lease-table backend, against a real PostgreSQL.

mod common;

use common::{Kind, PgFactory};

conformance::conformance_tests!(
    async { PgFactory::shared(Kind::Lease).await },
    capabilities: [inspect],
);
