//! PostgreSQL backends for distlock.
//!
//! This crate is a placeholder until the PostgreSQL backends land: it will hold the
//! advisory-lock backend, the lease-table backend, the SQL fencing gate and the
//! idempotency-key helper. It exports nothing yet.
