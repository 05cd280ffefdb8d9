//! The concurrency sweep of the capacity report run against deployments someone else
//! operates (`lockctl bench URL…`), instead of servers the benchmarks start.
//!
//! Each deployment is measured through the same closed-loop load as the report
//! ([`crate::scenarios::sweep`]), under a random key prefix of its own, so a live store is
//! touched only under that prefix; every key the run used is purged afterwards, fencing
//! counter included. The written report is the sweep's table alone: the contended,
//! batch, renewal and memory sections of the capacity report need servers the run owns.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use distlock_core::{LockBackend, LockError, LockKey};

use crate::error::BenchError;
use crate::load::Sample;
use crate::machine::Machine;
use crate::plan::Plan;
use crate::report;
use crate::scenarios;
use crate::subject::{BenchKey, Cycle, Subject, SubjectId, TTL};

/// The header of the deployments' `capacity.csv`.
pub const CSV_HEADER: &str =
    "subject,backend,concurrency,ops,seconds,ops_per_sec,p50_us,p99_us,p999_us,acquire_p50_us";

/// The concurrency levels of a full run: the capacity report's.
pub fn full_plan() -> Plan {
    Plan::full()
}

/// A short run at one and four tasks, to check that a deployment answers.
pub fn quick_plan() -> Plan {
    Plan {
        levels: vec![1, 4],
        ..Plan::quick()
    }
}

/// The capacity subject whose cycle a backend named `name` ([`LockBackend::name`]) runs,
/// used for the key names and the charts' series.
pub fn subject_for(name: &str) -> Result<SubjectId, BenchError> {
    match name {
        "memory" => Ok(SubjectId::Memory),
        "redis" => Ok(SubjectId::Redis),
        "postgres-lease" => Ok(SubjectId::PgLease),
        "postgres-advisory" => Ok(SubjectId::PgAdvisory),
        "etcd" => Ok(SubjectId::Etcd),
        _ => Err(BenchError::Unexpected {
            subject: "deployment",
            detail: format!("the {name} backend has no capacity measurement"),
        }),
    }
}

/// What happened to the keys a run used once it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cleanup {
    /// Every key was purged; the number of keys.
    Purged(usize),
    /// The backend cannot purge: its leases were released, their token counters stay.
    Unsupported {
        /// Keys left under the run's prefix.
        left: usize,
    },
}

/// One deployment measured.
#[derive(Clone, Debug)]
pub struct DeploymentRun {
    /// How the deployment is shown: its URL without the password.
    pub label: String,
    /// The backend's name ([`LockBackend::name`]).
    pub backend: &'static str,
    /// The key prefix the run worked under.
    pub prefix: String,
    /// One sample per concurrency level.
    pub samples: Vec<Sample>,
    /// What was done with the keys afterwards.
    pub cleanup: Cleanup,
}

/// One row of the table: a deployment at one concurrency level.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The deployment's label.
    pub subject: String,
    /// The backend's name.
    pub backend: &'static str,
    /// Tasks running at once.
    pub tasks: usize,
    /// Cycles in the measured window.
    pub ops: u64,
    /// The measured window, in seconds.
    pub seconds: f64,
    /// Cycles per second.
    pub cycles_per_sec: f64,
    /// Cycle latency p50, in microseconds.
    pub p50_us: f64,
    /// Cycle latency p99, in microseconds.
    pub p99_us: f64,
    /// Cycle latency p99.9, in microseconds.
    pub p999_us: f64,
    /// Acquire-step latency p50, in microseconds.
    pub acquire_p50_us: f64,
}

/// A deployment's backend behind [`Subject`]: every bench key is moved under the run's
/// prefix, and every key sent to the store is remembered so the run can purge it.
struct PrefixedBackend {
    id: SubjectId,
    backend: Arc<dyn LockBackend>,
    prefix: String,
    /// Bench key text to the store key: built once per key, so a cycle only looks it up.
    keys: Mutex<HashMap<String, LockKey>>,
}

impl PrefixedBackend {
    fn lock_err(&self, source: LockError) -> BenchError {
        BenchError::Lock {
            subject: self.id.slug(),
            source,
        }
    }

    fn poisoned(&self) -> BenchError {
        BenchError::Unexpected {
            subject: self.id.slug(),
            detail: "a load task panicked while holding the key table".into(),
        }
    }

    fn store_key(&self, key: &BenchKey) -> Result<LockKey, BenchError> {
        let mut keys = self.keys.lock().map_err(|_| self.poisoned())?;
        if let Some(k) = keys.get(key.as_str()) {
            return Ok(k.clone());
        }
        let k = LockKey::new(format!("{}:{}", self.prefix, key.as_str()))
            .map_err(|e| self.lock_err(e))?;
        keys.insert(key.as_str().to_owned(), k.clone());
        Ok(k)
    }

    /// Purges every key the run sent to the store.
    async fn purge(&self) -> Result<Cleanup, BenchError> {
        let keys: Vec<LockKey> = self
            .keys
            .lock()
            .map_err(|_| self.poisoned())?
            .values()
            .cloned()
            .collect();
        for (done, key) in keys.iter().enumerate() {
            match self.backend.purge(key).await {
                Ok(()) => {}
                Err(LockError::Unsupported { .. }) => {
                    return Ok(Cleanup::Unsupported {
                        left: keys.len() - done,
                    });
                }
                Err(e) => return Err(self.lock_err(e)),
            }
        }
        Ok(Cleanup::Purged(keys.len()))
    }
}

#[async_trait]
impl Subject for PrefixedBackend {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let key = self.store_key(key)?;
        Cycle::of_backend(self.id, self.backend.as_ref(), &key).await
    }

    fn backend(&self) -> Option<Arc<dyn LockBackend>> {
        Some(self.backend.clone())
    }
}

/// Sweeps `plan.levels` on `backend` under a fresh random prefix, then purges every key
/// the sweep used — also when the sweep failed, whose error is then returned.
/// `progress` is called with each level before it runs.
pub async fn measure(
    label: String,
    backend: Arc<dyn LockBackend>,
    plan: &Plan,
    progress: impl FnMut(usize),
) -> Result<DeploymentRun, BenchError> {
    let name = backend.name();
    let subject = Arc::new(PrefixedBackend {
        id: subject_for(name)?,
        backend,
        prefix: format!("deployment-bench:{}", random_hex()),
        keys: Mutex::new(HashMap::new()),
    });
    let swept = scenarios::sweep(subject.clone(), plan, progress).await;
    let cleanup = subject.purge().await;
    let samples = swept?;
    Ok(DeploymentRun {
        label,
        backend: name,
        prefix: subject.prefix.clone(),
        samples,
        cleanup: cleanup?,
    })
}

/// 16 random hex digits.
fn random_hex() -> String {
    let mut hex = uuid::Uuid::new_v4().simple().to_string();
    hex.truncate(16);
    hex
}

/// Every deployment of one `lockctl bench` run, ready to be written.
#[derive(Clone, Debug)]
pub struct DeploymentReport {
    /// The machine the client ran on.
    pub machine: Machine,
    /// `full` or `quick`.
    pub mode: String,
    /// Levels and durations.
    pub plan: Plan,
    /// One entry per deployment, in the order given.
    pub runs: Vec<DeploymentRun>,
}

impl DeploymentReport {
    /// One row per deployment and level, in order.
    pub fn rows(&self) -> Vec<Row> {
        self.runs
            .iter()
            .flat_map(|run| {
                run.samples.iter().map(|s| Row {
                    subject: run.label.clone(),
                    backend: run.backend,
                    tasks: s.concurrency,
                    ops: s.ops,
                    seconds: s.elapsed.as_secs_f64(),
                    cycles_per_sec: s.ops_per_sec(),
                    p50_us: s.cycle_us(0.5),
                    p99_us: s.cycle_us(0.99),
                    p999_us: s.cycle_us(0.999),
                    acquire_p50_us: s.acquire_us(0.5),
                })
            })
            .collect()
    }

    /// The report: the client machine, how the run was made, the table, the charts.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        report::write_header(
            &mut md,
            "distlock capacity report: deployments",
            &self.mode,
            &self.machine,
            false,
        );
        let _ = writeln!(
            md,
            "\nThe stores are the deployments named below, reached over the network from this \
             machine: latency includes the network. Each level ran {:?} after {:?} of warm-up; \
             a cycle is one acquire then one release of a free key (one key per task, under a \
             random prefix per deployment); TTL {:?}.\n",
            self.plan.duration, self.plan.warmup, TTL
        );
        let _ = writeln!(
            md,
            "| subject | tasks | cycles/s | p50 µs | p99 µs | p99.9 µs | acquire p50 µs |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|");
        for r in self.rows() {
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
                r.subject,
                r.tasks,
                r.cycles_per_sec,
                r.p50_us,
                r.p99_us,
                r.p999_us,
                r.acquire_p50_us
            );
        }
        let _ = writeln!(md, "\n## Deployments\n");
        let _ = writeln!(
            md,
            "| subject | backend | key prefix | cleanup |\n|---|---|---|---|"
        );
        for run in &self.runs {
            let cleanup = match run.cleanup {
                Cleanup::Purged(n) => format!("purged the {n} keys used"),
                Cleanup::Unsupported { left } => {
                    format!("the backend cannot purge: {left} released keys stay")
                }
            };
            let _ = writeln!(
                md,
                "| {} | {} | `{}` | {cleanup} |",
                run.label, run.backend, run.prefix
            );
        }
        let _ = writeln!(md, "\n## Charts\n");
        let _ = writeln!(
            md,
            "Series are named by backend; deployments of the same backend share a name.\n"
        );
        let _ = writeln!(md, "![throughput vs concurrency](throughput.svg)\n");
        for level in self.chart_levels() {
            let _ = writeln!(
                md,
                "![latency percentiles at {level} tasks](latency_c{level}.svg)\n"
            );
        }
        md
    }

    /// One row per deployment and level.
    pub fn csv(&self) -> String {
        let mut csv = String::from(CSV_HEADER);
        csv.push('\n');
        for r in self.rows() {
            let _ = writeln!(
                csv,
                "{},{},{},{},{:.4},{:.1},{:.1},{:.1},{:.1},{:.1}",
                csv_field(&r.subject),
                r.backend,
                r.tasks,
                r.ops,
                r.seconds,
                r.cycles_per_sec,
                r.p50_us,
                r.p99_us,
                r.p999_us,
                r.acquire_p50_us
            );
        }
        csv
    }

    /// The levels the latency charts are drawn at: the first and the last.
    fn chart_levels(&self) -> Vec<usize> {
        let mut levels: Vec<usize> = [self.plan.levels.first(), self.plan.levels.last()]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        levels.dedup();
        levels
    }

    /// Writes `report.md`, `capacity.csv` and the SVG charts into `dir` (created if
    /// needed) and returns their paths.
    pub fn write_all(&self, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
        // One chart line per deployment, named by its (redacted) URL.
        let groups: Vec<(String, Vec<&Sample>)> = self
            .runs
            .iter()
            .map(|run| (run.label.clone(), run.samples.iter().collect()))
            .collect();
        report::write_files(dir, self.markdown(), self.csv(), &self.plan.levels, &groups)
    }
}

/// Quotes a CSV field that holds a comma or a quote (a URL's query or host list may).
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::memory::MemoryBackend;

    #[test]
    fn every_backend_name_has_a_subject() {
        for id in SubjectId::BACKENDS {
            let name = match id {
                SubjectId::PgLease => "postgres-lease",
                SubjectId::PgAdvisory => "postgres-advisory",
                other => other.slug(),
            };
            assert_eq!(subject_for(name).unwrap(), id);
        }
        assert!(subject_for("carrier-pigeon").is_err());
    }

    #[test]
    fn csv_fields_with_commas_are_quoted() {
        assert_eq!(csv_field("redis://a"), "redis://a");
        assert_eq!(
            csv_field("etcd://a:1,b:2?x=\"y\""),
            "\"etcd://a:1,b:2?x=\"\"y\"\"\""
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_measured_store_keeps_none_of_the_keys_the_run_used() {
        let store = Arc::new(MemoryBackend::new());
        let plan = Plan {
            levels: vec![1, 3],
            warmup: std::time::Duration::from_millis(5),
            duration: std::time::Duration::from_millis(30),
            ..Plan::quick()
        };
        let mut seen = Vec::new();
        let run = measure("memory://".into(), store.clone(), &plan, |l| seen.push(l))
            .await
            .unwrap();
        assert_eq!(seen, [1, 3]);
        // At most one key per task and level; a task the runtime never got to before the
        // window closed used none.
        assert!(
            matches!(run.cleanup, Cleanup::Purged(n) if (1..=4).contains(&n)),
            "{:?}",
            run.cleanup
        );
        let levels: Vec<usize> = run.samples.iter().map(|s| s.concurrency).collect();
        assert_eq!(levels, [1, 3]);
        assert!(run.samples.iter().all(|s| s.ops > 0));
        let used = ["c1:0", "c3:0", "c3:1", "c3:2"];
        for key in used.map(|k| format!("{}:bench:memory:{k}", run.prefix)) {
            let key = LockKey::new(key).unwrap();
            let info = store.inspect(&key).await.unwrap();
            assert_eq!((info.owner, info.token), (None, None), "{key}");
        }
    }
}
