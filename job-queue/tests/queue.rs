//! The payout scenario on a real apalis queue (its Redis storage) with worker processes
//! of the `job-queue` binary, against a redis-server and a PostgreSQL the test starts:
//! under the lock layer every payout is made once, whatever the queue redelivers;
//! without it, the same faults make payouts twice.

use std::path::Path;

use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use harness::require;
use job_queue::scenario::{self, Options, Report};
use tokio::sync::Mutex;

/// The runs take seconds of heartbeats each; one at a time keeps them from starving each
/// other's workers on a small machine.
static ONE_RUN_AT_A_TIME: Mutex<()> = Mutex::const_new(());

async fn run(locked: bool) -> Report {
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let redis = require(RedisServer::start().await);
    let postgres = require(PostgresServer::start().await);
    let options = Options {
        locked,
        ..Options::default()
    };
    let exe = Path::new(env!("CARGO_BIN_EXE_job-queue"));
    let report = scenario::run(exe, &redis.url(), &postgres.superuser_url(), &options)
        .await
        .unwrap();
    println!("{report}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_lock_layer_every_payout_is_made_once() {
    let report = run(true).await;
    assert!(report.paid_twice.is_empty(), "{report}");
    assert!(report.unpaid.is_empty(), "{report}");
    assert_eq!(report.made, report.jobs, "{report}");
    // The paused worker's call went out after another worker had paid under a newer
    // token: the provider refused it.
    assert_eq!(report.paused_call, "stale_rejected", "{report}");
    assert!(report.stale_rejected >= 1, "{report}");
    // The killed worker's payout, redelivered, and the payouts enqueued twice were
    // absorbed by the idempotency key.
    assert!(report.absorbed >= 1, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_layer_the_same_faults_pay_twice() {
    let report = run(false).await;
    assert_eq!(report.paused_call, "applied", "{report}");
    for job in [report.paused_job, report.killed_job, 5, 6] {
        assert!(
            report.paid_twice.contains(&job),
            "payout {job} should have been paid twice: {report}"
        );
    }
    assert!(report.unpaid.is_empty(), "{report}");
}
