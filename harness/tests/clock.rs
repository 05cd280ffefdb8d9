//! The shifted wall clock: processes started under a `ShiftedClock` (a plain C program,
//! redis-server, PostgreSQL and its backends, a re-run test) read it, follow its steps
//! while they run, and keep their monotonic clocks.

use std::ffi::OsString;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness::postgres::PostgresServer;
use harness::{ShiftedClock, require, rerun_under};

/// The step the tests take: far beyond the slack of a reading on a loaded machine.
const STEP: Duration = Duration::from_secs(60);
/// How far, in seconds, a reading may be from the one expected.
const SLACK: f64 = 5.0;

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// The real wall clock, read by `date` started without the shim, so that it is real also
/// inside a process that runs under a clock.
fn real_now() -> f64 {
    date(&[])
}

/// `date +%s.%N` run with `envs`.
fn date(envs: &[(OsString, OsString)]) -> f64 {
    let out = Command::new("date")
        .arg("+%s.%N")
        .env_remove("LD_PRELOAD")
        .env_remove("DISTLOCK_CLOCK_FILE")
        .envs(envs.iter().cloned())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[track_caller]
fn assert_about(what: &str, read: f64, expected: f64) {
    assert!(
        (read - expected).abs() < SLACK,
        "{what}: read {read:.3}, expected about {expected:.3} (off by {:.3} s)",
        read - expected
    );
}

#[test]
fn a_program_reads_the_clock_only_with_its_state_file() {
    let clock = require(ShiftedClock::new());
    require(clock.step_back(STEP));
    let envs = clock.envs();
    let (preload, file): (Vec<_>, Vec<_>) =
        envs.iter().cloned().partition(|(k, _)| k == "LD_PRELOAD");

    assert_about(
        "date under the clock",
        date(&envs),
        real_now() - STEP.as_secs_f64(),
    );
    assert_about("date with the shim alone", date(&preload), real_now());
    let missing = [(file[0].0.clone(), OsString::from("/nonexistent/state"))];
    assert_about(
        "date with a missing state file",
        date(&[preload, missing.to_vec()].concat()),
        real_now(),
    );
}

#[test]
fn a_rerun_test_reads_its_clock_and_steps_it_while_instant_runs_on() {
    const NAME: &str = "a_rerun_test_reads_its_clock_and_steps_it_while_instant_runs_on";
    let Some(clock) = ShiftedClock::of_this_process() else {
        let clock = require(ShiftedClock::new());
        require(clock.step_back(Duration::from_secs(3600)));
        require(rerun_under(&clock, NAME));
        // The child's step is the step of the one clock.
        assert_about(
            "the clock after the child stepped it",
            epoch_secs(require(clock.now())),
            real_now() - 3600.0 - STEP.as_secs_f64(),
        );
        return;
    };

    assert_about(
        "SystemTime::now in the child",
        epoch_secs(SystemTime::now()),
        real_now() - 3600.0,
    );
    let started = Instant::now();
    let before = SystemTime::now();
    require(clock.step_back(STEP));
    let after = SystemTime::now();
    let elapsed = started.elapsed();
    let went_back = before.duration_since(after).unwrap();
    assert!(
        went_back > STEP - Duration::from_secs(1) && went_back <= STEP,
        "the wall clock went back by {went_back:?}"
    );
    assert!(
        elapsed < Duration::from_secs(1),
        "Instant (CLOCK_MONOTONIC) must run on across the step, measured {elapsed:?}"
    );
    assert!(Instant::now() > started);
}

#[test]
fn a_test_started_under_a_clock_the_shim_did_not_take_cannot_rerun_itself() {
    const NAME: &str = "a_test_started_under_a_clock_the_shim_did_not_take_cannot_rerun_itself";
    let clock = require(ShiftedClock::new());
    if std::env::var_os("DISTLOCK_CLOCK_FILE").is_some() {
        // The child, without the shim: it would take the parent's branch again and again.
        assert!(ShiftedClock::of_this_process().is_none());
        let err = rerun_under(&clock, NAME).unwrap_err();
        assert!(err.to_string().contains("the shim is not loaded"), "{err}");
        return;
    }
    let (var, file) = clock
        .envs()
        .into_iter()
        .find(|(k, _)| k == "DISTLOCK_CLOCK_FILE")
        .unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact"])
        .env_remove("LD_PRELOAD")
        .env(var, file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{out:?}"
    );
}

#[tokio::test]
async fn postgres_backends_read_the_shifted_clock_and_follow_its_steps() {
    let clock = require(ShiftedClock::new());
    let pg = require(PostgresServer::builder().clock(&clock).start().await);
    let epoch = async |expr: &str| -> f64 {
        require(pg.psql(&format!("SELECT extract(epoch FROM {expr})")).await)
            .parse()
            .unwrap()
    };
    assert_about(
        "clock_timestamp()",
        epoch("clock_timestamp()").await,
        real_now(),
    );

    require(clock.step_back(STEP));
    let behind = real_now() - STEP.as_secs_f64();
    assert_about(
        "clock_timestamp() after a step back",
        epoch("clock_timestamp()").await,
        behind,
    );
    assert_about("now() in a new transaction", epoch("now()").await, behind);

    // A backend that is running when the clock steps reads the step. pg_sleep measures
    // its second on the wall clock, so the step forward also ends it early.
    let session = pg.psql(
        "SELECT extract(epoch FROM clock_timestamp()); SELECT pg_sleep(1); \
         SELECT extract(epoch FROM clock_timestamp())",
    );
    let step = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        require(clock.step_forward(STEP));
    };
    let (out, ()) = tokio::join!(session, step);
    let out = require(out);
    let readings: Vec<f64> = [out.lines().next(), out.lines().last()]
        .map(|line| line.unwrap().parse().unwrap())
        .to_vec();
    let moved = readings[1] - readings[0];
    assert!(
        moved > STEP.as_secs_f64() && moved < STEP.as_secs_f64() + SLACK,
        "one backend read {readings:?}, moved {moved:.3} s across a step of {STEP:?}"
    );

    require(clock.freeze());
    let first = epoch("clock_timestamp()").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        epoch("clock_timestamp()").await,
        first,
        "a frozen clock stands still"
    );
    require(clock.thaw());

    require(clock.step_back(STEP));
    require(pg.restart().await);
    assert_about(
        "clock_timestamp() after a restart",
        epoch("clock_timestamp()").await,
        real_now() - STEP.as_secs_f64(),
    );
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use harness::redis::{RedisCluster, RedisServer, RespValue};

    /// `TIME`: seconds and microseconds.
    async fn time(server: &RedisServer) -> (i64, i64) {
        match require(server.command(&["TIME"]).await) {
            RespValue::Array(Some(parts)) => match parts.as_slice() {
                [secs, micros] => (
                    secs.as_text().unwrap().parse().unwrap(),
                    micros.as_text().unwrap().parse().unwrap(),
                ),
                other => panic!("TIME replied {other:?}"),
            },
            other => panic!("TIME replied {other:?}"),
        }
    }

    async fn time_secs(server: &RedisServer) -> f64 {
        let (secs, micros) = time(server).await;
        secs as f64 + micros as f64 / 1e6
    }

    async fn text(server: &RedisServer, args: &[&str]) -> Option<String> {
        require(server.command(args).await).as_text()
    }

    #[tokio::test]
    async fn redis_time_and_key_expiry_follow_the_shifted_clock() {
        let clock = require(ShiftedClock::new());
        let server = require(RedisServer::builder().clock(&clock).start().await);
        assert_about("TIME", time_secs(&server).await, real_now());
        assert_eq!(
            text(&server, &["SET", "lease", "held", "PX", "1000"])
                .await
                .as_deref(),
            Some("OK")
        );

        require(clock.step_back(STEP));
        let behind = real_now() - STEP.as_secs_f64();
        assert_about("TIME after a step back", time_secs(&server).await, behind);
        let info = text(&server, &["INFO", "server"]).await.unwrap();
        let usec: f64 = info
            .lines()
            .find_map(|l| l.strip_prefix("server_time_usec:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_about("INFO server_time_usec", usec / 1e6, behind);
        assert_eq!(
            text(&server, &["SET", "fresh", "v", "PX", "5000"])
                .await
                .as_deref(),
            Some("OK")
        );
        assert_eq!(text(&server, &["GET", "fresh"]).await.as_deref(), Some("v"));

        // The lease's second runs out on the real clock, not on the server's.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            text(&server, &["GET", "lease"]).await.as_deref(),
            Some("held")
        );
        let pttl: i64 = text(&server, &["PTTL", "lease"])
            .await
            .unwrap()
            .parse()
            .unwrap();
        assert!(pttl > 50_000, "PTTL of the lease after a step back: {pttl}");

        require(clock.step_forward(STEP * 2));
        assert_about(
            "TIME after a step forward",
            time_secs(&server).await,
            real_now() + STEP.as_secs_f64(),
        );
        assert_eq!(text(&server, &["GET", "lease"]).await, None);
        assert_eq!(text(&server, &["GET", "fresh"]).await, None);

        require(server.restart().await);
        assert_about(
            "TIME after a restart",
            time_secs(&server).await,
            real_now() + STEP.as_secs_f64(),
        );
    }

    #[tokio::test]
    async fn a_frozen_clock_stands_still_in_redis_until_thawed() {
        let clock = require(ShiftedClock::new());
        let server = require(RedisServer::builder().clock(&clock).start().await);
        require(clock.freeze());
        let first = time(&server).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(time(&server).await, first);
        let at = require(clock.now()).duration_since(UNIX_EPOCH).unwrap();
        assert_eq!(first, (at.as_secs() as i64, i64::from(at.subsec_micros())));

        require(clock.step_back(STEP));
        assert_eq!(
            time(&server).await,
            (first.0 - STEP.as_secs() as i64, first.1)
        );

        require(clock.thaw());
        let thawed = time(&server).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(time(&server).await > thawed);
        assert_about(
            "TIME after thawing",
            time_secs(&server).await,
            real_now() - STEP.as_secs_f64(),
        );
    }

    #[tokio::test]
    async fn every_cluster_node_and_replica_shares_the_one_clock() {
        let clock = require(ShiftedClock::new());
        let cluster = require(RedisCluster::builder().clock(&clock).start().await);
        require(clock.step_back(STEP));
        let replica = require(cluster.start_replica(&cluster.nodes()[0]).await);
        for node in cluster.nodes().iter().chain([&replica]) {
            assert_about(
                &format!("TIME of node {}", node.port()),
                time_secs(node).await,
                real_now() - STEP.as_secs_f64(),
            );
        }
    }
}
