//! The shared conformance suite on the advisory-lock backend, against a real PostgreSQL.

mod common;

use common::{Kind, PgFactory};

conformance::conformance_tests!(
    async { PgFactory::shared(Kind::Advisory).await.with_fenced_resource() },
    capabilities: [link_faults, inspect, wakes_waiters],
);
