//! `lockctl bench URL…`: the files it writes, its JSON rows, the keys it leaves (none) and
//! its failures. Speed is never asserted: the machine is shared and noisy.

use std::path::Path;

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;

fn lockctl() -> Command {
    Command::cargo_bin("lockctl").expect("the lockctl binary is built")
}

/// `lockctl bench --quick --json --out <out> <urls>`, which must succeed; its rows.
fn bench_json(urls: &[&str], out: &Path) -> Vec<Value> {
    let output = lockctl()
        .args(["bench", "--quick", "--json", "--out"])
        .arg(out)
        .args(urls)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    rows.as_array().expect("a JSON array").clone()
}

/// The `tasks` of each row, in order.
fn tasks(rows: &[Value]) -> Vec<u64> {
    rows.iter().map(|r| r["tasks"].as_u64().unwrap()).collect()
}

#[test]
fn quick_bench_on_memory_writes_the_report_csv_and_charts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    lockctl()
        .args(["bench", "memory://", "--quick", "--out"])
        .arg(&out)
        .assert()
        .success()
        .stdout(
            predicate::str::contains("cycles/s")
                .and(predicate::str::contains("p99.9 µs"))
                .and(predicate::str::contains("report.md")),
        );

    let csv = std::fs::read_to_string(out.join("capacity.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(
        lines[0].starts_with("subject,backend,concurrency,"),
        "{csv}"
    );
    let levels: Vec<&str> = lines[1..]
        .iter()
        .map(|l| {
            let fields: Vec<&str> = l.split(',').collect();
            assert_eq!(&fields[..2], ["memory://", "memory"], "{l}");
            fields[2]
        })
        .collect();
    assert_eq!(levels, ["1", "4"], "{csv}");

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| cores |"), "the machine block: {md}");
    assert!(
        md.contains("| subject | tasks | cycles/s | p50 µs | p99 µs | p99.9 µs |"),
        "{md}"
    );
    assert!(md.contains("| memory:// | 4 |"), "{md}");
    let svg = std::fs::read_to_string(out.join("throughput.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
}

#[test]
fn quick_bench_json_has_a_row_per_level_with_work_done() {
    let dir = tempfile::tempdir().unwrap();
    let rows = bench_json(&["memory://"], dir.path());
    assert_eq!(tasks(&rows), [1, 4], "{rows:?}");
    for row in &rows {
        assert_eq!(row["subject"], "memory://", "{row}");
        assert_eq!(row["backend"], "memory", "{row}");
        assert!(row["ops"].as_u64().unwrap() > 0, "{row}");
        let p50 = row["p50_us"].as_f64().unwrap();
        let p999 = row["p999_us"].as_f64().unwrap();
        assert!(p50 <= p999, "{row}");
    }
}

#[test]
fn a_store_that_is_down_fails_cleanly_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let output = lockctl()
        .args(["bench", "--quick", "--out"])
        .arg(&out)
        .args(["memory://", "redis://:hunter2@127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("127.0.0.1:1"), "names the store: {stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(output.stdout.is_empty());
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn a_bad_url_fails_before_anything_is_measured() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    lockctl()
        .args(["bench", "--quick", "--out"])
        .arg(&out)
        .args(["memory://", "carrier-pigeon://coop"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("carrier-pigeon://coop"));
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn bench_needs_at_least_one_url() {
    lockctl()
        .args(["bench", "--quick"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("<URLS>"));
}

mod on_redis {
    use super::*;
    use harness::redis::{RedisServer, RespValue};
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bench_measures_a_redis_server_and_leaves_no_key_behind() {
        let server = require(RedisServer::start().await);
        let dir = tempfile::tempdir().unwrap();
        let url = server.url();
        let rows = bench_json(&[&url, "memory://"], dir.path());

        assert_eq!(tasks(&rows), [1, 4, 1, 4], "{rows:?}");
        assert_eq!(rows[0]["backend"], "redis", "{rows:?}");
        assert_eq!(rows[2]["backend"], "memory", "{rows:?}");
        for row in &rows[..2] {
            assert!(row["ops"].as_u64().unwrap() > 0, "{row}");
        }
        // Lock keys only: the tokens' high-water keys (`<prefix>:tokens`, one per prefix)
        // stay, as they must for tokens to keep rising.
        let left = require(server.command(&["KEYS", "*{*"]).await);
        assert_eq!(left, RespValue::Array(Some(Vec::new())), "keys left behind");
        let calls = require(server.command(&["INFO", "commandstats"]).await);
        let calls = calls.as_text().unwrap_or_default();
        assert!(calls.contains("cmdstat_evalsha"), "the load ran: {calls}");
    }
}
