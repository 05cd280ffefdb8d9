//! The shared conformance suite on the advisory-lock backend, against a real PostgreSQL.

mod common;

use common::{Kind, PgFactory};

conformance::conformance_tests!(
    async { PgFactory::shared(Kind::Advisory).await },
    capabilities: [inspect],
);
