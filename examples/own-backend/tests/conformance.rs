//! The whole conformance suite on the table store, stamped by the public macro: one test
//! per case whose needs the store meets, and `conformance_stamped_cases`, which prints
//! how many were stamped and which were not, and why (run with `--nocapture`, or read
//! `$DISTLOCK_SUMMARY_DIR/backends.txt`).

mod common;

conformance::conformance_tests!(
    async { common::TableFactory::new() },
    capabilities: [inspect, distinct_clients, wakes_waiters],
);
