//! The lockctl command line, run as a user runs it: exit codes, tables, JSON, errors.

use assert_cmd::Command;
use predicates::prelude::*;
use serde_json::Value;

fn lockctl() -> Command {
    Command::cargo_bin("lockctl").expect("the lockctl binary is built")
}

/// Runs lockctl with `args`; it must fail and say `says` on stderr.
fn fails_saying<const N: usize>(args: [&str; N], says: &str) -> assert_cmd::assert::Assert {
    lockctl()
        .args(args)
        .assert()
        .failure()
        .stderr(predicate::str::contains(says))
}

/// The demo's JSON report with a workload small enough for a test.
fn demo_json(extra: &[&str]) -> Vec<Value> {
    let output = lockctl()
        .args(["demo", "--jobs", "60", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let rows: Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    rows.as_array().expect("a JSON array").clone()
}

fn count(row: &Value, field: &str) -> u64 {
    row[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} in {row}"))
}

#[test]
fn demo_json_has_one_object_per_strategy() {
    let rows = demo_json(&[]);
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "no-lock",
            "lock",
            "lock+renew",
            "lock+renew+fence",
            "lock+renew+fence+idempotency"
        ]
    );
    for row in &rows {
        assert_eq!(count(row, "jobs"), 60, "{row}");
        assert_eq!(
            count(row, "unpaid_jobs"),
            0,
            "every job is paid at least once: {row}"
        );
        assert_eq!(
            count(row, "payments"),
            60 + count(row, "duplicates"),
            "{row}"
        );
    }
}

#[test]
fn demo_only_the_idempotency_key_reaches_zero_duplicates() {
    let rows = demo_json(&["--seed", "7"]);
    let duplicates: Vec<u64> = rows.iter().map(|r| count(r, "duplicates")).collect();
    assert_eq!(duplicates[4], 0, "{rows:?}");
    assert!(
        duplicates[0] > 0,
        "no lock lets duplicates through: {rows:?}"
    );
    let fenced = &rows[3];
    if count(fenced, "crashes") > 0 {
        assert!(
            count(fenced, "duplicates") > 0,
            "a crash between the write and the ack defeats fencing alone: {fenced}"
        );
    }
    assert!(count(&rows[4], "idempotent_repeats") > 0, "{rows:?}");
}

#[test]
fn demo_table_shows_zero_duplicates_only_for_the_last_strategy() {
    let output = lockctl().args(["demo", "--jobs", "60"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    let header = text
        .lines()
        .find(|l| l.starts_with("strategy"))
        .expect("a header row");
    let column = header
        .split("  ")
        .filter(|c| !c.is_empty())
        .position(|c| c.trim() == "duplicates")
        .expect("a duplicates column");
    let duplicates = |strategy: &str| -> u64 {
        let row = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(strategy))
            .unwrap_or_else(|| panic!("no row for {strategy} in\n{text}"));
        row.split_whitespace().nth(column).unwrap().parse().unwrap()
    };
    assert_eq!(duplicates("lock+renew+fence+idempotency"), 0, "{text}");
    let weaker = ["no-lock", "lock", "lock+renew", "lock+renew+fence"];
    assert!(weaker.iter().any(|s| duplicates(s) > 0), "{text}");
}

/// `lockctl demo --tenants --json` on `backend`: the row of each strategy, by name.
fn tenant_rows(backend: &str) -> std::collections::HashMap<String, Value> {
    let output = lockctl()
        .args(["demo", "--tenants", "--json", "--backend", backend])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let rows: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    rows.into_iter()
        .map(|row| (row["strategy"].as_str().unwrap().to_owned(), row))
        .collect()
}

/// The tenant limit (2) holds, counted from the export ledger, only with the semaphore and
/// the fence: a paused export's stale step gets through the semaphore alone.
fn assert_the_fenced_semaphore_alone_keeps_the_limit(
    rows: &std::collections::HashMap<String, Value>,
) {
    for (name, row) in rows {
        assert_eq!(count(row, "exports"), 18, "{name}: {row}");
        assert_eq!(count(row, "pauses"), 3, "{name}: {row}");
        assert_eq!(count(row, "crashes"), 3, "{name}: {row}");
    }
    assert!(count(&rows["no-limit"], "most_at_once") > 2, "{rows:?}");
    assert!(count(&rows["semaphore"], "most_at_once") > 2, "{rows:?}");
    assert!(
        count(&rows["semaphore+fence"], "most_at_once") <= 2,
        "{rows:?}"
    );
    assert!(
        count(&rows["semaphore+fence"], "stale_refused") > 0,
        "{rows:?}"
    );
}

#[test]
fn demo_tenants_keeps_the_limit_only_with_the_fenced_semaphore() {
    assert_the_fenced_semaphore_alone_keeps_the_limit(&tenant_rows("memory://"));
    lockctl()
        .args(["demo", "--tenants"])
        .assert()
        .success()
        .stdout(predicate::str::contains("most at once (ledger)"));
}

#[test]
fn demo_refuses_a_bad_backend_and_an_empty_workload() {
    fails_saying(
        ["demo", "--backend", "nosuch://x"],
        "unknown URL scheme `nosuch`",
    );
    fails_saying(["demo", "--workers", "0"], "at least one worker");
}

#[test]
fn check_passes_on_the_memory_backend() {
    lockctl()
        .args(["check", "memory://"])
        .assert()
        .success()
        .stdout(predicate::str::contains("ok    acquire_excludes_others"))
        .stdout(predicate::str::contains(" 0 failed"));
}

#[test]
fn bad_urls_fail_with_a_clear_error() {
    for (url, says) in [
        ("127.0.0.1:6379", "malformed URL"),
        ("redis://127.0.0.1:99999", "invalid port"),
        ("mysql://127.0.0.1", "unknown URL scheme `mysql`"),
        ("memory://somewhere", "memory://"),
    ] {
        for command in ["check", "inspect"] {
            let mut cmd = lockctl();
            cmd.arg(command).arg(url);
            if command == "inspect" {
                cmd.arg("job:1");
            }
            cmd.assert()
                .failure()
                .stderr(predicate::str::contains(says));
        }
    }
}

#[cfg(not(feature = "etcd"))]
#[test]
fn a_store_whose_feature_is_off_names_the_feature() {
    fails_saying(
        ["check", "etcd://127.0.0.1:2379"],
        "feature `etcd` is not enabled",
    )
    .stderr(predicate::str::contains("--features etcd"));
}

#[test]
fn a_ttl_no_store_can_honour_is_refused_before_connecting() {
    // Port 1 on loopback refuses connections: a connect attempt would say so instead.
    for ttl in ["0s", "1500us"] {
        fails_saying(
            ["acquire", "redis://127.0.0.1:1", "job:1", "--ttl", ttl],
            "invalid ttl",
        )
        .stderr(predicate::str::contains("unavailable").not());
    }
}

#[test]
fn an_unreachable_store_fails_without_leaking_the_password() {
    let output = lockctl()
        .args(["inspect", "redis://:hunter2@127.0.0.1:1", "job:1"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("redis"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    assert!(output.stdout.is_empty());
}

#[test]
fn acquire_prints_the_owner_and_token() {
    let output = lockctl()
        .args(["acquire", "memory://", "job:1", "--ttl", "30s", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let lease: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(lease["token"], 1);
    assert_eq!(lease["ttl_ms"], 30_000);
    let owner = lease["owner"].as_str().unwrap();
    assert_eq!(owner.len(), 32);
    assert!(owner.bytes().all(|b| b.is_ascii_hexdigit()));
}

/// 1: the answer is no; 2: wrong input, nothing sent; 3: the store did not answer.
#[test]
fn exit_statuses_tell_a_no_from_wrong_input_from_an_unreachable_store() {
    for (args, code) in [
        (vec!["acquire", "memory://", "", "--ttl", "1s"], 2),
        (vec!["acquire", "memory://", "job:1", "--ttl", "0s"], 2),
        (vec!["inspect", "redis://127.0.0.1:99999", "job:1"], 2),
        (vec!["inspect", "redis://127.0.0.1:1/?nosuch=1", "job:1"], 2),
        (vec!["inspect", "--nosuch", "memory://", "job:1"], 2),
        // Port 1 on loopback refuses connections.
        (vec!["inspect", "redis://127.0.0.1:1", "job:1"], 3),
        (vec!["leader", "memory://", "scheduler"], 1),
        (
            vec![
                "release",
                "memory://",
                "job:1",
                "--owner",
                &"a".repeat(32),
                "--token",
                "1",
            ],
            1,
        ),
    ] {
        let output = lockctl().args(&args).output().unwrap();
        assert_eq!(output.status.code(), Some(code), "{args:?}: {output:?}");
    }
    lockctl()
        .arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("Exit status:"));
    lockctl()
        .args(["acquire", "--help"])
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "3  the store could not be reached",
        ));
}

/// `setup`, `release` and `check` print JSON with `--json`, as `acquire`, `inspect` and
/// `leader` do.
#[test]
fn setup_release_and_check_print_json() {
    let output = lockctl()
        .args(["setup", "memory://", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let setup: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(setup["tables"], false, "{setup}");

    let owner = "a".repeat(32);
    let output = lockctl()
        .args([
            "release",
            "memory://",
            "job:1",
            "--owner",
            &owner,
            "--token",
            "7",
        ])
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let release: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(release["outcome"], "not_held", "{release}");
    assert_eq!(release["token"], 7, "{release}");

    let output = lockctl()
        .args(["check", "memory://", "--filter", "release", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let check: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let cases = check["cases"].as_array().unwrap();
    assert!(!cases.is_empty(), "{check}");
    assert_eq!(check["failed"], 0, "{check}");
    assert_eq!(
        check["passed"].as_u64().unwrap() as usize,
        cases.len(),
        "{check}"
    );
    assert!(check["cleanup"]["purged"].is_u64(), "{check}");
}

/// Every command `lockctl` has, but `completions`.
const COMMANDS: [&str; 9] = [
    "demo",
    "check",
    "setup",
    "inspect",
    "acquire",
    "release",
    "leader",
    "semaphore",
    "bench",
];

#[test]
fn completions_name_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let output = lockctl().args(["completions", shell]).output().unwrap();
        assert!(output.status.success(), "{shell}: {output:?}");
        let script = String::from_utf8(output.stdout).unwrap();
        for command in COMMANDS {
            assert!(script.contains(command), "{shell} lacks {command}");
        }
    }
    lockctl().args(["completions", "tcsh"]).assert().code(2);
}

#[test]
fn acquire_refuses_a_duration_it_cannot_read() {
    lockctl()
        .args(["acquire", "memory://", "job:1", "--ttl", "5 fortnights"])
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--ttl"));
}

#[test]
fn a_command_without_a_url_or_distlock_url_says_which_to_give() {
    for args in [
        &["inspect", "k"][..],
        &["leader", "role"],
        &["check"],
        &["setup"],
    ] {
        lockctl()
            .env_remove("DISTLOCK_URL")
            .args(args)
            .assert()
            .code(2)
            .stderr(predicate::str::contains("DISTLOCK_URL"));
    }
}

#[test]
fn a_semaphore_with_no_or_too_many_permits_is_refused_before_connecting() {
    for permits in ["0", "1025"] {
        lockctl()
            .args([
                "semaphore",
                "redis://127.0.0.1:1",
                "exports",
                "--permits",
                permits,
            ])
            .assert()
            .code(2)
            .stderr(predicate::str::contains("1 to 1024 permits"));
    }
}

#[test]
fn inspect_shows_a_free_key() {
    lockctl()
        .args(["inspect", "memory://", "job:1"])
        .assert()
        .success()
        .stdout(predicate::str::contains("holder:    none"));
}

#[test]
fn release_on_memory_explains_that_the_store_is_per_process() {
    fails_saying(
        [
            "release",
            "memory://",
            "job:1",
            "--owner",
            "0123456789abcdef0123456789abcdef",
            "--token",
            "1",
        ],
        "nothing changed",
    )
    .stderr(predicate::str::contains(
        "memory:// is a store inside each lockctl process",
    ));
    fails_saying(
        [
            "release",
            "memory://",
            "job:1",
            "--owner",
            "xyz",
            "--token",
            "1",
        ],
        "32 hexadecimal digits",
    );
}

#[test]
fn setup_of_a_store_without_tables_does_nothing() {
    lockctl()
        .args(["setup", "memory://"])
        .assert()
        .success()
        .stdout(predicate::str::contains("nothing to set up"));
}

#[test]
fn setup_never_prints_a_password() {
    for url in [
        "redis://app@127.0.0.1:1/?password=hunter2",
        "redis://app:12#ter2@127.0.0.1:1/",
        "rediss://hun?ter2@127.0.0.1:1/",
    ] {
        let output = lockctl().args(["setup", url]).output().unwrap();
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(shown.contains("127.0.0.1:1"), "{url}: {shown}");
        assert!(!shown.contains("ter2"), "{url}: {shown}");
    }
}

#[test]
fn every_command_has_help() {
    lockctl()
        .arg("--help")
        .assert()
        .success()
        .stdout(predicate::str::contains("demo").and(predicate::str::contains("check")));
    for command in COMMANDS {
        lockctl()
            .args([command, "--help"])
            .assert()
            .success()
            .stdout(predicate::str::contains("Usage: lockctl"));
    }
}

/// `lockctl acquire --json` on `url`: the owner id and token it printed.
fn acquire_json(url: &str, key: &str) -> (String, u64) {
    let output = lockctl()
        .args(["acquire", url, key, "--ttl", "60s", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let lease: Value = serde_json::from_slice(&output.stdout).unwrap();
    (
        lease["owner"].as_str().unwrap().to_owned(),
        lease["token"].as_u64().unwrap(),
    )
}

/// `lockctl inspect --json` on `url`.
fn inspect_json(url: &str, key: &str) -> Value {
    let output = lockctl()
        .args(["inspect", url, key, "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `lockctl check` on `url`, which must pass; its stdout.
fn check_passes(url: &str) -> String {
    let check = lockctl().args(["check", url]).output().unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout).into_owned();
    assert!(
        check.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
    stdout
}

mod on_redis {
    use super::*;
    use harness::redis::{RedisServer, RespValue};
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn check_and_demo_pass_on_a_redis_server_the_test_starts() {
        let server = require(RedisServer::start().await);
        let url = server.url();
        check_passes(&url);

        let rows = demo_json(&["--backend", &url]);
        assert_eq!(count(&rows[4], "duplicates"), 0, "{rows:?}");
        assert_the_fenced_semaphore_alone_keeps_the_limit(&tenant_rows(&url));
        assert!(count(&rows[0], "duplicates") > 0, "{rows:?}");
        for row in &rows {
            assert_eq!(count(row, "unpaid_jobs"), 0, "{row}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn check_leaves_no_key_behind_and_never_touches_other_keys() {
        let server = require(RedisServer::start().await);
        let url = server.url();
        let theirs = require(server.command(&["SET", "app:config", "keep me"]).await);
        assert!(!theirs.is_error(), "{theirs:?}");

        let stdout = check_passes(&url);
        assert!(stdout.contains("cleanup: purged the "), "{stdout}");

        let keys = require(server.command(&["KEYS", "*"]).await);
        // The tokens' high-water key of the check's prefix stays, as it must for tokens
        // to keep rising.
        let left: Vec<String> = match &keys {
            RespValue::Array(Some(items)) => items
                .iter()
                .filter_map(RespValue::as_text)
                .filter(|k| !k.ends_with(":tokens"))
                .collect(),
            other => panic!("KEYS answered {other:?}"),
        };
        assert_eq!(
            left,
            ["app:config"],
            "only the key the check did not make is left"
        );
        let value = require(server.command(&["GET", "app:config"]).await);
        assert_eq!(value.as_text().as_deref(), Some("keep me"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphore_shows_who_holds_each_permit() {
        let server = require(RedisServer::start().await);
        let url = server.url();
        let (first, _) = acquire_json(&url, "exports:permit:0");
        let (third, token) = acquire_json(&url, "exports:permit:2");
        let output = lockctl()
            .args(["semaphore", &url, "exports", "--permits", "3", "--json"])
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        let shown: Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(shown["held"], 2, "{shown}");
        let holders: Vec<&Value> = (0..3).map(|i| &shown["slots"][i]["holder"]).collect();
        assert_eq!(
            holders,
            [&Value::from(first), &Value::Null, &Value::from(third)]
        );
        assert_eq!(shown["slots"][2]["token"], token, "{shown}");
        assert!(
            shown["slots"][2]["ttl_left_ms"].as_u64().unwrap() > 50_000,
            "{shown}"
        );
        lockctl()
            .args(["semaphore", &url, "exports", "--permits", "3"])
            .assert()
            .success()
            .stdout(predicate::str::contains("2 of 3 permits held"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn commands_left_without_a_url_use_distlock_url() {
        let server = require(RedisServer::start().await);
        let url = server.url();
        let with_env = |args: &[&str]| {
            let mut command = lockctl();
            command.env("DISTLOCK_URL", &url).args(args);
            command
        };
        let out = with_env(&["acquire", "payout:8", "--json"])
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let acquired: Value = serde_json::from_slice(&out).unwrap();
        // The lock is on the server DISTLOCK_URL names: seen there with the URL given.
        assert_eq!(inspect_json(&url, "payout:8")["holder"], acquired["owner"]);
        let out = with_env(&["inspect", "payout:8", "--json"])
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let seen: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(seen["holder"], acquired["owner"]);
        let (owner, token) = (
            acquired["owner"].as_str().unwrap().to_owned(),
            acquired["token"].to_string(),
        );
        with_env(&["release", "payout:8", "--owner", &owner, "--token", &token])
            .assert()
            .success();
        assert!(inspect_json(&url, "payout:8")["holder"].is_null());
        // A URL given wins over the environment's.
        with_env(&["inspect", "memory://", "payout:8"])
            .assert()
            .success()
            .stderr(predicate::str::contains("memory://"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn release_frees_a_lock_another_lockctl_process_acquired() {
        let server = require(RedisServer::start().await);
        let url = server.url();
        let (owner, token) = acquire_json(&url, "payout:7");
        assert_eq!(inspect_json(&url, "payout:7")["holder"], owner.as_str());

        // Held by someone else: the answer is no.
        lockctl()
            .args(["acquire", &url, "payout:7"])
            .assert()
            .code(1)
            .stderr(predicate::str::contains("held by someone else"));
        // A wrong token changes nothing.
        lockctl()
            .args(["release", &url, "payout:7", "--owner", &owner])
            .args(["--token", &(token + 1).to_string()])
            .assert()
            .code(1)
            .stderr(predicate::str::contains("nothing changed"));
        assert_eq!(inspect_json(&url, "payout:7")["holder"], owner.as_str());

        lockctl()
            .args(["release", &url, "payout:7", "--owner", &owner])
            .args(["--token", &token.to_string()])
            .assert()
            .success()
            .stdout(predicate::str::contains("released payout:7"));
        let info = inspect_json(&url, "payout:7");
        assert_eq!(info["holder"], Value::Null, "{info}");
        // Redis keeps nothing after a release: its next token is its clock.
        assert_eq!(
            info["token"],
            Value::Null,
            "a free key keeps no token: {info}"
        );
    }
}

mod on_postgres {
    use super::*;
    use harness::postgres::{PASSWORD, PostgresServer};
    use harness::require;

    /// A server whose test role may use schema `public`, set up through `lockctl setup`.
    async fn server_with_tables() -> (PostgresServer, String) {
        let server = require(PostgresServer::start().await);
        let url = format!("{}?schema=public", server.url());
        lockctl()
            .args(["setup", &url])
            .assert()
            .success()
            .stdout(predicate::str::contains("tables distlock uses are ready"));
        (server, url)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn check_passes_in_both_modes_and_cleans_up() {
        let (server, url) = server_with_tables().await;
        // Both modes at once, as two deployments sharing a server would: the longest test of
        // the workspace otherwise.
        let checks = std::thread::scope(|scope| {
            ["lease", "advisory"]
                .map(|mode| {
                    let url = format!("{url}&mode={mode}");
                    (mode, scope.spawn(move || check_passes(&url)))
                })
                .map(|(mode, check)| (mode, check.join().expect("the check's thread")))
        });
        for (mode, stdout) in checks {
            assert!(stdout.contains("cleanup: purged the "), "{mode}: {stdout}");
        }
        let rows = require(
            server
                .psql(
                    "SELECT (SELECT count(*) FROM public.distlock_leases) \
                          + (SELECT count(*) FROM public.distlock_advisory_tokens)",
                )
                .await,
        );
        assert_eq!(rows.trim(), "0", "no row is left behind");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn setup_hides_a_password_given_as_a_parameter() {
        let server = require(PostgresServer::start().await);
        let url = server.url().replacen(&format!(":{PASSWORD}@"), "@", 1);
        let url = format!("{url}?schema=public&password={PASSWORD}");
        let output = lockctl().args(["setup", &url]).output().unwrap();
        assert!(output.status.success(), "{output:?}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert!(
            stdout.contains("tables distlock uses are ready"),
            "{stdout}"
        );
        assert!(stdout.contains("password=***"), "{stdout}");
        assert!(!stdout.contains(PASSWORD), "{stdout}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_setup_the_error_says_to_run_it() {
        let server = require(PostgresServer::start().await);
        let url = format!("{}?schema=public", server.url());
        fails_saying(["inspect", &url, "job:1"], "setup()");
        fails_saying(
            ["check", &format!("{url}&mdoe=advisory")],
            "unknown parameter `mdoe`",
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn release_works_on_the_lease_table_and_says_why_not_on_advisory_locks() {
        let (_server, url) = server_with_tables().await;
        let (owner, token) = acquire_json(&url, "payout:9");
        lockctl()
            .args(["release", &url, "payout:9", "--owner", &owner])
            .args(["--token", &token.to_string()])
            .assert()
            .success();
        assert_eq!(inspect_json(&url, "payout:9")["holder"], Value::Null);

        lockctl()
            .args(["release", &format!("{url}&mode=advisory"), "payout:9"])
            .args(["--owner", &owner, "--token", &token.to_string()])
            .assert()
            .code(2)
            .stderr(predicate::str::contains(
                "cannot release a lock held by another process",
            ));
    }

    /// An advisory lock ends with the session that took it, so a lock taken by lockctl
    /// would be free again the moment lockctl exits: refused, and nothing taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acquire_refuses_an_advisory_lock_that_would_end_with_lockctl() {
        let (server, url) = server_with_tables().await;
        lockctl()
            .args(["acquire", &format!("{url}&mode=advisory"), "payout:10"])
            .assert()
            .code(2)
            .stderr(predicate::str::contains("end with the session"))
            .stderr(predicate::str::contains("mode=lease"))
            .stdout(predicate::str::is_empty());
        let rows = require(
            server
                .psql("SELECT count(*) FROM public.distlock_advisory_tokens")
                .await,
        );
        assert_eq!(rows.trim(), "0", "no token was counted");
    }
}

#[cfg(feature = "etcd")]
mod on_etcd {
    use super::*;
    use harness::etcd::{EtcdCluster, EtcdServer};
    use harness::require;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn check_passes_on_an_etcd_server_the_test_starts() {
        let server = require(EtcdServer::start().await);
        let url = server.endpoint().replace("http://", "etcd://");
        let stdout = check_passes(&format!("{url}?key_prefix=lockctl-check"));
        assert!(stdout.contains("cleanup: "), "{stdout}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn release_frees_a_lock_another_lockctl_process_acquired_on_a_cluster() {
        let cluster = require(EtcdCluster::start().await);
        let members: Vec<String> = cluster
            .endpoints()
            .iter()
            .map(|e| e.replace("http://", ""))
            .collect();
        let url = format!("etcd://{}", members.join(","));
        let (owner, token) = acquire_json(&url, "payout:11");
        assert_eq!(inspect_json(&url, "payout:11")["holder"], owner.as_str());
        lockctl()
            .args(["release", &url, "payout:11", "--owner", &owner])
            .args(["--token", &token.to_string()])
            .assert()
            .success();
        let info = inspect_json(&url, "payout:11");
        assert_eq!(info["holder"], Value::Null, "{info}");
        assert_eq!(info["token"], token, "{info}");
    }
}
