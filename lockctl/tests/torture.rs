//! `lockctl torture` against servers the tests start: a few seconds per store with the
//! nemesis pausing and killing workers, 0 violations on each; the same run with a store
//! that loses held locks is caught.

use std::time::Duration;

use assert_cmd::Command;
use serde_json::Value;

fn lockctl() -> Command {
    Command::cargo_bin("lockctl").expect("the lockctl binary is built")
}

/// Runs a CI-sized torture run against `url` with lease TTL `ttl` (the shortest the
/// store takes, within reason) and `extra` options: 12 TTLs long, a nemesis action every
/// 3/4 TTL on average (about 16 actions, each pause past the TTL), 4 workers on 2 locks.
/// Returns its exit code and JSON report.
fn torture(url: &str, ttl: Duration, extra: &[&str]) -> (i32, Value) {
    torture_of(&[url], ttl, extra)
}

/// [`torture`] of the store `target` names: a URL, or `--own redis`.
fn torture_of(target: &[&str], ttl: Duration, extra: &[&str]) -> (i32, Value) {
    let text = |d: Duration| format!("{}ms", d.as_millis());
    let output = lockctl()
        .arg("torture")
        .args(target)
        .args(["--json", "--workers", "4", "--keys", "2"])
        .args(["--ttl", &text(ttl), "--duration", &text(ttl * 12)])
        .args(["--nemesis-every", &text(ttl * 3 / 4)])
        .args(extra)
        .timeout(ttl * 12 + Duration::from_secs(60))
        .output()
        .expect("lockctl runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), report)
}

/// Redis and PostgreSQL take leases this short.
const SHORT: Duration = Duration::from_millis(400);

fn n(report: &Value, field: &str) -> u64 {
    report[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {report}"))
}

/// A run that passed, and was not empty: it granted locks, admitted writes, and its
/// nemesis paused workers past the TTL and killed some. (How many grants a run makes
/// depends on the machine's load and on how long the nemesis kept locks held by
/// stopped or dead workers: a loaded run on two cores made 5 where an idle one makes 45.)
fn assert_clean_run(code: i32, report: &Value) {
    assert_eq!(report["violations"], Value::Array(vec![]), "{report:#}");
    assert_eq!(report.get("histories"), None, "{report:#}");
    assert_eq!(code, 0, "{report:#}");
    for done in ["grants", "writes_admitted", "pauses", "kills"] {
        assert!(n(report, done) > 0, "{done}: {report:#}");
    }
}

mod on_redis {
    use super::*;
    use harness::redis::RedisServer;
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_torture_run_breaks_nothing() {
        let server = require(RedisServer::start().await);
        let (code, report) = torture(&server.url(), SHORT, &[]);
        assert_clean_run(code, &report);
    }

    /// A run on a redis-server it starts itself, which its nemesis also kills and starts
    /// again on the same append-only file (`appendfsync always`): tokens keep rising and
    /// no lock is held twice across the restarts.
    #[test]
    fn a_torture_run_that_restarts_its_own_store_breaks_nothing() {
        let (code, report) = torture_of(&["--own", "redis"], SHORT, &[]);
        assert_clean_run(code, &report);
        assert!(n(&report, "restarts") > 0, "{report:#}");
    }

    /// A worker started while its store is down (as a replacement the nemesis starts
    /// while it restarts its own store): it waits for the store instead of exiting, and
    /// works once the store is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_started_while_its_store_is_down_waits_for_it() {
        use std::io::{BufRead, BufReader};
        use std::process::Stdio;

        let server = require(RedisServer::start().await);
        let url = server.url();
        server.kill().unwrap();
        let mut worker = std::process::Command::new(assert_cmd::cargo::cargo_bin("lockctl"))
            .args(["torture-worker", "--url", &url, "--ledger", &url])
            .args(["--prefix", "down", "--keys", "1", "--ttl", "400ms"])
            .args(["--steps", "1", "--step-time", "10ms", "--seed", "1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Several of its connects fail meanwhile (one every 100 ms).
        tokio::time::sleep(Duration::from_secs(1)).await;
        let exited = worker.try_wait().unwrap();
        if exited.is_some() {
            let output = worker.wait_with_output().unwrap();
            panic!(
                "the worker exited ({exited:?}) while its store was down: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        server.restart().await.unwrap();
        let lines = BufReader::new(worker.stdout.take().unwrap()).lines();
        let granted = tokio::task::spawn_blocking(move || {
            lines
                .map_while(Result::ok)
                .any(|line| line.contains(r#""event":"grant""#))
        });
        // A hang guard, not a bound: the store is back and the worker takes the lock.
        let granted = tokio::time::timeout(Duration::from_secs(30), granted)
            .await
            .expect("no grant reported")
            .unwrap();
        assert!(granted, "the worker ended without a grant");
        drop(worker.stdin.take());
        assert!(worker.wait().unwrap().success());
    }

    /// The checker at work: a store that loses held locks (as one evicting keys, or
    /// failing over to a replica that missed the grants, does) gives overlapping holders.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_loses_held_locks_is_caught() {
        let server = require(RedisServer::start().await);
        let (code, report) = torture(&server.url(), SHORT, &["--break", "lose-held-keys"]);
        assert_eq!(code, 1, "{report:#}");
        let overlaps = report["violations"]
            .as_array()
            .expect("violations")
            .iter()
            .filter(|v| v["property"] == "overlap")
            .count();
        assert!(overlaps > 0, "{report:#}");
        // Each violating lock's history (of the 2 locks, at most 3 shown), in the order
        // of the locks, the first one's the lock of the first violation: its events
        // around its first violation, which is marked. (The report lists the first 100
        // violations only: the other lock's may all be past them.)
        let histories = report["histories"].as_array().expect("histories");
        let keys: Vec<u64> = histories
            .iter()
            .map(|h| h["key"].as_u64().expect("key"))
            .collect();
        assert!(
            keys.is_sorted_by(|a, b| a < b) && keys.iter().all(|&k| k < 2),
            "{keys:?}"
        );
        assert_eq!(
            histories.first().map(|h| &h["key"]),
            Some(&report["violations"][0]["key"]),
            "{report:#}"
        );
        for history in histories {
            let entries = history["entries"].as_array().expect("entries");
            let events = entries.iter().filter(|e| e["by"] == "worker").count();
            assert!(events > 0 && events <= 60, "{history:#}");
            assert!(
                entries.iter().any(|e| e.get("caught").is_some()),
                "{history:#}"
            );
        }
    }
}

mod on_postgres {
    use super::*;
    use harness::postgres::PostgresServer;
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_torture_run_breaks_nothing_on_the_lease_table_and_on_advisory_locks() {
        let server = require(PostgresServer::start().await);
        let url = format!("{}?schema=public", server.url());
        lockctl().args(["setup", &url]).assert().success();
        for mode in ["lease", "advisory"] {
            let (code, report) = torture(&format!("{url}&mode={mode}"), SHORT, &[]);
            assert_clean_run(code, &report);
        }
    }
}

#[cfg(feature = "etcd")]
mod on_etcd {
    use super::*;
    use harness::etcd::EtcdServer;
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_torture_run_breaks_nothing() {
        let server = require(EtcdServer::start().await);
        let url = server.endpoint().replace("http://", "etcd://");
        // etcd's shortest lease is 2 s.
        let (code, report) = torture(&url, Duration::from_secs(2), &[]);
        assert_clean_run(code, &report);
    }
}

#[test]
fn a_store_of_one_process_is_refused_before_anything_runs() {
    let output = lockctl()
        .args(["torture", "memory://", "--duration", "1s"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("memory://"), "{stderr}");
}
