//! `lockctl leader URL ROLE`, run as an operator runs it, against a leader elected on a
//! Redis server the test starts.

use std::time::Duration;

use assert_cmd::Command;
use distlock::{Election, Locker};
use harness::redis::RedisServer;
use harness::require;
use predicates::prelude::*;
use serde_json::Value;

fn lockctl() -> Command {
    Command::cargo_bin("lockctl").expect("the lockctl binary is built")
}

/// `lockctl leader URL ROLE --json`, parsed; it exits 0 when someone leads, 1 when nobody
/// does.
fn leader_json(url: &str, role: &str) -> Value {
    let output = lockctl()
        .args(["leader", url, role, "--json"])
        .output()
        .unwrap();
    let shown: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let expected = if shown["leader"].is_null() { 1 } else { 0 };
    assert_eq!(output.status.code(), Some(expected), "{output:?}");
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_shows_the_current_leader_then_nobody_after_it_resigns() {
    const TTL: Duration = Duration::from_secs(30);
    let server = require(RedisServer::start().await);
    let url = server.url();
    let locker = Locker::builder(distlock::connect(&url).await.unwrap())
        .ttl(TTL)
        .build()
        .unwrap();
    let election = Election::new(locker, "nightly-report").unwrap();

    let nobody = leader_json(&url, "nightly-report");
    assert_eq!(nobody["leader"], Value::Null, "{nobody}");
    assert_eq!(nobody["token"], Value::Null, "{nobody}");

    let leadership = election.campaign().await.unwrap();
    let shown = leader_json(&url, "nightly-report");
    assert_eq!(shown["role"], "nightly-report");
    assert_eq!(shown["key"], "election:nightly-report");
    assert_eq!(shown["leader"], leadership.owner().to_string(), "{shown}");
    assert_eq!(shown["token"], leadership.token().get(), "{shown}");
    let left = shown["ttl_left_ms"].as_u64().expect("a TTL left");
    assert!(left > 0 && left <= TTL.as_millis() as u64, "{shown}");

    // The table form, for people.
    lockctl()
        .args(["leader", &url, "nightly-report"])
        .assert()
        .success()
        .stdout(predicate::str::contains(format!(
            "leader:   {}",
            leadership.owner()
        )))
        .stdout(predicate::str::contains(format!(
            "token:    {}",
            leadership.token()
        )))
        .stdout(predicate::str::contains("ttl left: "));

    leadership.resign().await.unwrap();
    let after = leader_json(&url, "nightly-report");
    assert_eq!(after["leader"], Value::Null, "{after}");
    // Redis keeps nothing after a release (its next token is its clock): no token shown.
    assert_eq!(after["token"], Value::Null, "{after}");
    assert_eq!(after["ttl_left_ms"], Value::Null, "{after}");
    lockctl()
        .args(["leader", &url, "nightly-report"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("leader:   none"))
        .stdout(predicate::str::contains("token:    none kept by the store"));
}

#[test]
fn an_empty_role_is_refused_before_connecting_without_leaking_the_password() {
    // Nothing listens on port 1: had lockctl connected, the error would say so.
    let output = lockctl()
        .args(["leader", "redis://:hunter2@127.0.0.1:1", ""])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("election role must not be empty"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(output.stdout.is_empty());
}

#[test]
fn leader_on_memory_says_nobody_leads() {
    lockctl()
        .args(["leader", "memory://", "scheduler"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("leader:   none"))
        .stdout(predicate::str::contains("token:    none kept by the store"));
}
