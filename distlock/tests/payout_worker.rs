//! The `payout_worker` example's scenario against servers the test starts: every payout
//! is applied exactly once, the frozen worker's late write is rejected by the fencing
//! check, and repeated deliveries are absorbed by the idempotency key.

#[path = "../examples/payout/scenario.rs"]
mod scenario;

use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use harness::require;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_payout_is_applied_once_despite_duplicates_and_a_frozen_worker() {
    let redis = require(RedisServer::start().await);
    let postgres = require(PostgresServer::start().await);
    let options = scenario::Options {
        payouts: 9,
        workers: 3,
    };
    let report = scenario::run(&redis.url(), &postgres.superuser_url(), &options)
        .await
        .unwrap();

    assert!(report.is_correct(), "{report}");
    assert_eq!(report.applied, 9, "{report}");
    assert!(
        report.stale_rejected >= 1,
        "the frozen worker's write was rejected: {report}"
    );
    // Payout 1 three times (the frozen worker's among them), 3, 6 and 9 twice.
    assert_eq!(report.deliveries, 9 + 4 + 1, "{report}");
    assert!(report.repeats_absorbed >= 1, "{report}");
    assert_eq!(
        report.applied + report.repeats_absorbed + report.stale_rejected,
        report.deliveries,
        "every delivery is accounted for: {report}"
    );

    // A second run on the same servers does not meet the first one's rows.
    let again = scenario::run(&redis.url(), &postgres.superuser_url(), &options)
        .await
        .unwrap();
    assert!(again.is_correct(), "{again}");
    assert_eq!(again.applied, 9, "{again}");
}
