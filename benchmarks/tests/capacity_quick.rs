//! Runs the capacity report with `--quick` against servers it starts itself and checks that
//! every file it promises is there and well formed, so the report cannot rot unnoticed.
//! Speed is never asserted: only the shape of the output.

use std::process::Command;

use benchmarks::report::CSV_HEADER;
use benchmarks::subjects::{Store, SubjectId};

#[test]
fn quick_capacity_run_writes_markdown_csv_and_svg_charts() {
    let out = tempfile::tempdir().expect("temp dir");
    let run = Command::new(env!("CARGO_BIN_EXE_capacity"))
        .arg("--quick")
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("running the capacity binary");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "capacity --quick failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );

    let report = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    assert!(report.starts_with("# distlock capacity report"));
    for section in [
        "| cores |",
        "| redis-server |",
        "## Targets",
        "## Throughput and latency by concurrency",
        "## Releases with a waiter on every key",
        "## Semaphore permits",
        "## A full semaphore",
        "## Redis pairs, shared and pinned",
        "## Batches",
        "## Memory per held guard",
        "## Redis server time per call",
        "throughput.svg",
    ] {
        assert!(report.contains(section), "report.md lacks {section:?}");
    }
    // Every target is printed with a verdict.
    for target in [
        "Redis acquire p50",
        "article two-step",
        "rslock",
        "acquire_many(1000)",
        "pg-lease cycles/s with a waiter on every key",
        "pg-advisory cycles/s with a waiter on every key",
        "etcd permit cycles/s / lock cycles/s (64 tasks, 64 permits)",
        "pg-lease full semaphore permits/s, N=1024 / N=64",
        "redis server µs per refusal, N=1024 / N=64",
        "memory per held guard",
        "Redis cycles/s / rslock's (16 tasks, shared)",
        "Redis cycles/s / the two-step design's (64 tasks, pinned)",
        "Redis cycles/s / raw SET NX + DEL's (16 tasks, pinned)",
        "Redis client CPU µs per cycle / rslock's (64 tasks, shared)",
    ] {
        assert!(
            report.contains(target),
            "report.md lacks the target {target:?}"
        );
    }

    let csv = std::fs::read_to_string(out.path().join("capacity.csv")).expect("capacity.csv");
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(CSV_HEADER));
    let columns = CSV_HEADER.split(',').count();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    for row in &rows {
        assert_eq!(row.len(), columns, "malformed CSV row {row:?}");
        let ops_per_sec: f64 = row[6].parse().expect("ops_per_sec is a number");
        assert!(ops_per_sec > 0.0, "a subject made no progress: {row:?}");
    }
    for subject in SubjectId::ALL {
        // Every backend and every baseline of a store that ran appears at every level.
        let levels = rows.iter().filter(|r| r[0] == subject.slug()).count();
        assert_eq!(
            levels,
            4,
            "{} has {levels} CSV rows, expected 4",
            subject.slug()
        );
    }
    assert!(rows.iter().any(|r| r[2] == Store::Etcd.name()));

    for chart in ["throughput.svg", "latency_c1.svg", "latency_c64.svg"] {
        let svg = std::fs::read_to_string(out.path().join(chart)).expect(chart);
        assert!(
            svg.trim_start().starts_with("<svg"),
            "{chart} is not an SVG"
        );
        assert!(svg.trim_end().ends_with("</svg>"), "{chart} is truncated");
        assert!(svg.contains("redis"), "{chart} has no series labels");
    }
}

#[test]
fn quick_profile_run_prints_every_round_with_cpu_per_cycle() {
    let run = Command::new(env!("CARGO_BIN_EXE_capacity"))
        .args([
            "--quick",
            "--profile",
            "redis",
            "--tasks",
            "4",
            "--rounds",
            "2",
            "--pinned",
        ])
        .output()
        .expect("running the capacity binary");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "capacity --profile failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    // Pinned, or the reason it could not be, is always printed.
    assert!(
        stdout.contains("pinned: server on CPU") || stdout.contains("not pinned"),
        "{stdout}"
    );
    let rounds: Vec<&str> = stdout.lines().filter(|l| l.starts_with("round")).collect();
    assert_eq!(rounds.len(), 2, "{stdout}");
    for round in rounds {
        assert!(
            round.contains("cycles/s") && round.contains("client"),
            "{round}"
        );
    }
}
