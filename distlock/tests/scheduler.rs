//! The `scheduler` example's scenario against a PostgreSQL server the test starts: the
//! leader is stopped past its TTL, a standby takes over, the stopped leader's late trigger
//! is refused by the fencing token, and no interval is triggered twice.
//!
//! The scenario runs its schedulers as child processes of this executable, so this test
//! has its own `main` (`harness = false`): called with `--child`, it is a scheduler.

#[path = "../examples/scheduler/scenario.rs"]
mod scenario;

use harness::postgres::PostgresServer;
use harness::require;

/// The one test of this target, as test runners name it.
const TEST: &str = "a_stopped_leaders_trigger_is_refused_and_no_interval_runs_twice";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // A test runner that lists tests first (cargo-nextest) asks `--list --format terse`,
    // and `--list --ignored` for the ignored ones: there are none.
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            println!("{TEST}: test");
        }
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let Some(child) = scenario::child_args(&args) {
        let (id, url, run) = child.expect("valid child arguments");
        runtime
            .block_on(scenario::child_main(id, &url, &run))
            .expect("the scheduler runs");
        return;
    }
    runtime.block_on(a_stopped_leaders_trigger_is_refused_and_no_interval_runs_twice());
    println!("test {TEST} ... ok");
}

async fn a_stopped_leaders_trigger_is_refused_and_no_interval_runs_twice() {
    let postgres = require(PostgresServer::start().await);
    let report = scenario::run(&postgres.superuser_url()).await.unwrap();
    println!("{report}");

    assert!(report.is_correct(), "{report}");
    let (stopped, old) = report.stopped.expect("a leader was stopped");
    let (successor, new) = report.successor.expect("a standby took over");
    assert_ne!(stopped, successor, "{report}");
    assert!(new > old, "{report}");
    assert!(
        report
            .stale_rejected
            .iter()
            .any(|&(id, _, token)| id == stopped && token == old),
        "the stopped leader's trigger was refused: {report}"
    );
    assert_eq!(report.stale_accepted, 0, "{report}");
    assert!(report.doubled.is_empty(), "{report}");
    // Both terms enqueued jobs; every job carries its leader's token.
    assert!(
        report
            .terms
            .iter()
            .any(|t| t.0 as u32 == stopped && t.1 as u64 == old.get())
            && report
                .terms
                .iter()
                .any(|t| t.0 as u32 == successor && t.1 as u64 == new.get()),
        "{report}"
    );
}
