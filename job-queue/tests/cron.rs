//! The cron scenario on apalis-cron with three scheduler processes of the `job-queue`
//! binary, against a redis-server (the election) and a PostgreSQL (the tick table) the
//! test starts: each tick runs once, and a leader stopped past its TTL is replaced; and a
//! rolling restart of instances whose clocks disagree runs each tick once, none lost.

use std::path::Path;

use harness::postgres::PostgresServer;
use harness::redis::RedisServer;
use harness::require;
use job_queue::cron::instance::TTL;
use job_queue::cron::{rolling, scenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tick_runs_once_and_a_stopped_leader_is_replaced_within_its_ttl() {
    let redis = require(RedisServer::start().await);
    let postgres = require(PostgresServer::start().await);
    let exe = Path::new(env!("CARGO_BIN_EXE_job-queue"));
    let report = scenario::run(exe, &redis.url(), &postgres.superuser_url())
        .await
        .unwrap();
    println!("{report}");

    assert!(report.run_twice.is_empty(), "{report}");
    assert_ne!(report.successor.instance, report.stopped.0, "{report}");
    assert_eq!(report.written_by_stopped_after, 0, "{report}");
    // The stopped leader's lease ends at most one TTL after the stop; the successor then
    // runs the next whole-second tick.
    let bound = (TTL + std::time::Duration::from_secs(1)).as_secs_f64() + 0.5;
    assert!(
        report.takeover() <= bound,
        "the successor's first tick came {:.2} s after the stop (bound {bound} s): {report}",
        report.takeover()
    );
    // Ticks ran before the stop, while stopped and after the resume: all by the leaders.
    assert!(report.written.len() >= 8, "{report}");
}

/// Two instances at a time, every other one's clock 400 ms behind, each stopped with
/// SIGTERM and replaced in turn: the role moves four times, twice to a clock behind right
/// after a tick (a layer that runs a tick once per leadership runs it again) and twice to a
/// clock ahead just before the leader's next tick (it loses that tick). Every tick from the
/// first to the last is written exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_across_skewed_clocks_runs_each_tick_once_and_loses_none() {
    let redis = require(RedisServer::start().await);
    let postgres = require(PostgresServer::start().await);
    let exe = Path::new(env!("CARGO_BIN_EXE_job-queue"));
    let report = rolling::run(exe, &redis.url(), &postgres.superuser_url())
        .await
        .unwrap();
    println!("{report}");

    assert_eq!(report.hand_overs.len(), rolling::RESTARTS, "{report}");
    // The skew is what makes the hand-overs hard: it must exceed the time a hand-over
    // takes, which is at most the stopped instance's time from SIGTERM to its exit.
    for h in &report.hand_overs {
        assert!(h.exit_took < rolling::SKEW, "{report}");
    }
    assert!(report.run_twice.is_empty(), "{report}");
    assert!(report.missing.is_empty(), "{report}");
    // Each hand-over's successor wrote ticks: the role did move.
    for h in &report.hand_overs {
        assert!(
            report.written.iter().any(|w| w.instance == h.to),
            "{report}"
        );
    }
}
