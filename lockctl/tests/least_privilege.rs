//! lockctl against Redis as a least-privilege user: the user of README's `ACL SETUSER`
//! line (its key prefix, release channels and commands, nothing else), and the same user
//! without the channel rule. Every subcommand that talks to the store works as either
//! (no NOPERM, nothing left held), and the password never appears in what lockctl prints.

use assert_cmd::Command;
use harness::redis::{RedisServer, RedisUser, RespValue};
use harness::require;
use serde_json::Value;

/// Needs percent-encoding in a URL, so both of its spellings are looked for in output.
const PASSWORD: &str = "lockctl/pw:1";
const PASSWORD_IN_URL: &str = "lockctl%2Fpw%3A1";

fn lockctl() -> Command {
    Command::cargo_bin("lockctl").expect("the lockctl binary is built")
}

/// A server with README's user, or that user without its channel rule.
async fn server_with_readme_user(channels: bool) -> RedisServer {
    let user = require(RedisUser::from_doc(
        include_str!("../../README.md"),
        PASSWORD,
    ));
    let user = if channels {
        user
    } else {
        require(user.without_rule("&distlock:*"))
    };
    require(RedisServer::builder().user(user).start().await)
}

/// Runs lockctl with `args`; it must exit with `code` (0 done, 1 the answer is no), and
/// neither its stdout nor its stderr may show the password or a refusal. Its stdout.
fn run(args: &[&str], code: i32) -> String {
    let output = lockctl().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(code),
        "lockctl {}\nstdout: {stdout}\nstderr: {stderr}",
        args[0]
    );
    for shown in [&stdout, &stderr] {
        assert!(
            !shown.contains(PASSWORD) && !shown.contains(PASSWORD_IN_URL),
            "lockctl {} printed the password",
            args[0]
        );
        assert!(
            !shown.to_uppercase().contains("NOPERM"),
            "lockctl {}: {shown}",
            args[0]
        );
    }
    stdout
}

fn json(stdout: &str) -> Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

async fn assert_nothing_held(server: &RedisServer) {
    // Lock keys only: the tokens' high-water key stays.
    assert_eq!(
        require(server.command(&["KEYS", "distlock:{*"]).await),
        RespValue::Array(Some(Vec::new())),
        "a key was left behind"
    );
}

/// `setup`, `check`, `acquire`, `inspect`, `leader`, `release`, the demo and a quick
/// `bench`, as the server's user.
fn every_subcommand_works(url: &str, out: &std::path::Path) {
    let setup = run(&["setup", url], 0);
    assert!(setup.contains("needs no tables"), "{setup}");

    let check = run(&["check", url], 0);
    assert!(check.contains(" 0 failed"), "{check}");

    let lease = json(&run(
        &["acquire", url, "payout:9", "--ttl", "60s", "--json"],
        0,
    ));
    let (owner, token) = (
        lease["owner"].as_str().unwrap().to_owned(),
        lease["token"].as_u64().unwrap(),
    );
    // Held: a second acquire is refused, without an error from the store.
    run(&["acquire", url, "payout:9", "--json"], 1);
    let info = json(&run(&["inspect", url, "payout:9", "--json"], 0));
    assert_eq!(info["holder"], owner.as_str(), "{info}");
    assert_eq!(info["token"], token, "{info}");
    run(&["inspect", url, "payout:9"], 0);

    let leader = json(&run(&["leader", url, "nightly", "--json"], 1));
    assert_eq!(leader["leader"], Value::Null, "{leader}");
    run(&["leader", url, "nightly"], 1);

    let released = run(
        &[
            "release",
            url,
            "payout:9",
            "--owner",
            &owner,
            "--token",
            &token.to_string(),
        ],
        0,
    );
    assert!(released.contains("released payout:9"), "{released}");
    let info = json(&run(&["inspect", url, "payout:9", "--json"], 0));
    assert_eq!(info["holder"], Value::Null, "{info}");

    let demo = json(&run(
        &["demo", "--backend", url, "--jobs", "60", "--json"],
        0,
    ));
    let rows = demo.as_array().unwrap();
    assert_eq!(rows.len(), 5, "{demo}");
    assert_eq!(rows[4]["duplicates"], 0, "{demo}");

    let out = out.display().to_string();
    let bench = json(&run(&["bench", "--quick", "--json", "--out", &out, url], 0));
    assert!(!bench.as_array().unwrap().is_empty(), "{bench}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_works_as_readmes_user_and_nothing_is_refused() {
    let server = server_with_readme_user(true).await;
    let out = tempfile::tempdir().unwrap();
    every_subcommand_works(&server.url_as("distlock").unwrap(), out.path());
    assert_nothing_held(&server).await;
    assert_eq!(require(server.acl_refusals().await), []);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_works_as_a_user_without_channel_rights() {
    let server = server_with_readme_user(false).await;
    let out = tempfile::tempdir().unwrap();
    every_subcommand_works(&server.url_as("distlock").unwrap(), out.path());
    assert_nothing_held(&server).await;
    // What was refused is the release announcements and the probe for them, nothing else.
    let refused = require(server.acl_refusals().await);
    assert!(!refused.is_empty());
    assert!(
        refused.iter().all(|(reason, _)| reason == "channel"),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_fails_without_showing_either_password() {
    let server = server_with_readme_user(true).await;
    let url = format!(
        "redis://distlock:{PASSWORD_IN_URL}x@127.0.0.1:{}/",
        server.port()
    );
    for args in [
        ["inspect", url.as_str(), "payout:9"],
        ["check", url.as_str(), "--filter=acquire"],
    ] {
        let output = lockctl().args(args).output().unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("lockctl/pw") && !stderr.contains("lockctl%2Fpw"),
            "{stderr}"
        );
        assert!(stderr.contains("127.0.0.1"), "{stderr}");
    }
}
