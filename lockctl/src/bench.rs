//! `lockctl bench URL…`: the capacity report's concurrency sweep against live stores.
//!
//! Every URL is connected before anything is measured, so a bad URL or a store that is
//! down fails the command before any load is sent and before any file is written. Each
//! store is then measured under a random key prefix and the keys used are purged
//! afterwards (see [`capacity::deployment`]). Progress goes to stderr; stdout carries
//! the summary table, or the rows as JSON with `--json`.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use capacity::deployment::{self, Cleanup, DeploymentReport, Row};
use capacity::machine::Machine;
use distlock::LockBackend;
use indicatif::{ProgressBar, ProgressStyle};

/// What `lockctl bench` was asked for.
pub struct Options<'a> {
    /// The stores' URLs.
    pub urls: &'a [String],
    /// Short durations at one and four tasks only.
    pub quick: bool,
    /// Where the report goes.
    pub out: &'a Path,
    /// Print the rows as JSON instead of a table.
    pub json: bool,
}

/// Measures every URL, writes the report and prints the summary.
pub async fn run(options: &Options<'_>) -> ExitCode {
    match measure_and_write(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("lockctl bench: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn measure_and_write(options: &Options<'_>) -> Result<(), String> {
    let mut stores: Vec<(String, Arc<dyn LockBackend>)> = Vec::new();
    for url in options.urls {
        let label = distlock::redact_url(url);
        let backend = distlock::connect(url)
            .await
            .map_err(|e| format!("{label}: {e}"))?;
        deployment::subject_for(backend.name()).map_err(|e| format!("{label}: {e}"))?;
        stores.push((label, backend));
    }

    let plan = if options.quick {
        deployment::quick_plan()
    } else {
        deployment::full_plan()
    };
    let machine = Machine::detect();
    let steps = u64::try_from(stores.len() * plan.levels.len()).unwrap_or(u64::MAX);
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut runs = Vec::with_capacity(stores.len());
    for (label, backend) in stores {
        let mut started = false;
        let run = deployment::measure(label.clone(), backend, &plan, |level| {
            if started {
                bar.inc(1);
            }
            started = true;
            bar.set_message(format!("{label}: {level} tasks"));
        })
        .await
        .map_err(|e| format!("{label}: {e}"))?;
        bar.inc(1);
        if let Cleanup::Unsupported { left } = run.cleanup {
            bar.suspend(|| {
                eprintln!(
                    "lockctl bench: {label}: the {} backend cannot purge keys; {left} released \
                     keys under {} stay (their token counters with them)",
                    run.backend, run.prefix
                );
            });
        }
        runs.push(run);
    }
    bar.finish_and_clear();

    let report = DeploymentReport {
        machine,
        mode: if options.quick { "quick" } else { "full" }.into(),
        plan,
        runs,
    };
    let written = report.write_all(options.out).map_err(|e| e.to_string())?;
    let rows = report.rows();
    if options.json {
        let json: Vec<serde_json::Value> = rows.iter().map(row_json).collect();
        println!("{}", serde_json::Value::Array(json));
    } else {
        println!("{}", table(&rows));
        println!("wrote:");
        for path in written {
            println!("  {}", path.display());
        }
    }
    Ok(())
}

fn row_json(r: &Row) -> serde_json::Value {
    serde_json::json!({
        "subject": r.subject,
        "backend": r.backend,
        "tasks": r.tasks,
        "ops": r.ops,
        "seconds": r.seconds,
        "cycles_per_sec": r.cycles_per_sec,
        "p50_us": r.p50_us,
        "p99_us": r.p99_us,
        "p999_us": r.p999_us,
        "acquire_p50_us": r.acquire_p50_us,
    })
}

/// The rows as an aligned text table.
fn table(rows: &[Row]) -> String {
    let width = rows
        .iter()
        .map(|r| r.subject.chars().count())
        .chain(["subject".len()])
        .max()
        .unwrap_or(0);
    let mut out = format!(
        "{:<width$}  {:>5}  {:>10}  {:>9}  {:>9}  {:>9}",
        "subject", "tasks", "cycles/s", "p50 µs", "p99 µs", "p99.9 µs"
    );
    for r in rows {
        out.push_str(&format!(
            "\n{:<width$}  {:>5}  {:>10.0}  {:>9.0}  {:>9.0}  {:>9.0}",
            r.subject, r.tasks, r.cycles_per_sec, r.p50_us, r.p99_us, r.p999_us
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_a_line_per_row_under_the_header() {
        let row = |tasks| Row {
            subject: "redis://127.0.0.1:6379".into(),
            backend: "redis",
            tasks,
            ops: 10,
            seconds: 1.0,
            cycles_per_sec: 10.0,
            p50_us: 1.0,
            p99_us: 2.0,
            p999_us: 3.0,
            acquire_p50_us: 0.5,
        };
        let text = table(&[row(1), row(4)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("subject "), "{text}");
        assert!(
            lines[2].starts_with("redis://127.0.0.1:6379      4"),
            "{text}"
        );
    }
}
