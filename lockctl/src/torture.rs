//! `lockctl torture URL…`: a long, randomised run of fenced critical sections against a
//! deployment, with a nemesis that pauses and kills the workers, and a checker.
//!
//! Worker processes (this program again, as `lockctl torture-worker`) take the run's
//! locks one after another and, under each, do a few steps of read-modify-write on a
//! ledger entry of that lock: the fenced counter of [`worker`]. Every grant, step, loss
//! and release is reported with its time on the host's monotonic clock. Meanwhile the
//! nemesis stops a worker (SIGSTOP) for longer than the TTL and lets it go on, or kills
//! one (SIGKILL) and starts another in its place. At the end the ledger is read and
//! [`check`] judges the history; on a violation the report shows the first violating
//! locks' events around it, with what the nemesis did to their workers meanwhile
//! ([`check::timeline`]). The run works under a random name prefix
//! (`torture:<16 hex digits>:`) and purges its locks when it ends; the ledger entries (one
//! small value per lock) stay, for inspection.

mod broken;
mod check;
mod event;
mod fault;
mod store;
pub mod worker;
mod workers;

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use distlock::{EnforcementMode, LockError, LockKey};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::time::Instant;

pub use broken::Break;
pub use store::{Fsync, Own};
pub use worker::WorkerArgs;

use check::timeline::{self, KeyHistory};
use check::{Property, Tally, Violation};
use fault::FaultKind;
use store::OwnStore;
use workers::{History, Workers};

/// The store under test.
#[derive(Clone, Debug)]
pub enum Target {
    /// A deployment, by URL.
    Url(String),
    /// A store the run starts itself, and restarts: which, the server binary, and how
    /// it flushes its writes.
    Own(Own, String, Fsync),
}

/// How a run is shaped.
#[derive(Clone, Debug)]
pub struct Options {
    pub target: Target,
    /// The store holding the ledger (the store under test when `None`).
    pub ledger: Option<String>,
    pub workers: u32,
    pub keys: u32,
    pub duration: Duration,
    pub ttl: Duration,
    pub steps: u32,
    pub step_time: Duration,
    /// The mean time between two nemesis actions; `None`: no nemesis.
    pub nemesis_every: Option<Duration>,
    pub pauses: bool,
    pub kills: bool,
    pub seed: u64,
    pub json: bool,
    pub r#break: Option<Break>,
}

/// What a run did and found.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The store's URL, without its password.
    pub store: String,
    pub seconds: f64,
    pub workers: u32,
    pub keys: u32,
    pub ttl_ms: u128,
    #[serde(flatten)]
    pub tally: Tally,
    pub pauses: u32,
    pub kills: u32,
    /// Restarts of a store the run started itself (SIGKILL, then started again).
    pub restarts: u32,
    /// Critical sections completed per second.
    pub sections_per_s: f64,
    /// Fenced writes admitted per second.
    pub writes_per_s: f64,
    /// How many violations of each property were found.
    pub violated: BTreeMap<Property, usize>,
    /// The first [`SHOWN`] violations found.
    pub violations: Vec<Violation>,
    /// The events of the first few violating locks around their first violation, and the
    /// nemesis's actions on the workers involved ([`timeline`]); none on a clean run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub histories: Vec<KeyHistory>,
}

/// How many violations a report lists (it counts them all).
const SHOWN: usize = 100;

/// Checks the options before anything starts.
fn validate(options: &Options) -> Result<(), LockError> {
    let memory = match &options.target {
        Target::Url(url) => crate::keys::is_memory(url),
        Target::Own(..) => false,
    };
    if memory
        || options
            .ledger
            .as_deref()
            .is_some_and(crate::keys::is_memory)
    {
        return Err(LockError::Config(
            "torture runs worker processes that must share the store: memory:// is one \
             process's; give a Redis, etcd or PostgreSQL URL"
                .into(),
        ));
    }
    let positive = [
        ("--workers", options.workers),
        ("--keys", options.keys),
        ("--steps", options.steps),
    ];
    if let Some((name, _)) = positive.iter().find(|(_, n)| *n == 0) {
        return Err(LockError::Config(format!("{name} must be at least 1")));
    }
    if options.workers > 64 {
        return Err(LockError::Config("--workers must be at most 64".into()));
    }
    if options.nemesis_every.is_some_and(|d| d.is_zero()) {
        return Err(LockError::Config(
            "--nemesis-every must be above zero".into(),
        ));
    }
    Ok(())
}

/// Runs one torture run and prints its report; exit status 1 when a property broke.
pub async fn run(options: &Options) -> Result<ExitCode, LockError> {
    validate(options)?;
    let (url, mut own) = match &options.target {
        Target::Url(url) => (url.clone(), None),
        Target::Own(Own::Redis, binary, fsync) => {
            let store = OwnStore::start(binary, *fsync)
                .await
                .map_err(|e| LockError::Config(format!("cannot start the store: {e}")))?;
            (store.url(), Some(store))
        }
    };
    let result = run_on(options, &url, own.as_mut()).await;
    if let Some(store) = own {
        store.stop().await;
    }
    result
}

/// [`run`] on the store at `url`; `own` is that store when the run started it.
async fn run_on(
    options: &Options,
    url: &str,
    own: Option<&mut OwnStore>,
) -> Result<ExitCode, LockError> {
    let ledger_url = options.ledger.clone().unwrap_or_else(|| url.to_owned());
    // Opened here first, so a wrong URL or an unreachable store fails before any worker.
    let backend = distlock::connect(url).await?;
    let ledger = distlock::fenced_resource(&ledger_url, EnforcementMode::Enforce).await?;
    distlock::Locker::builder(backend.clone())
        .ttl(options.ttl)
        .build()?;
    let prefix = format!("torture:{:016x}", rand::random::<u64>());
    let args = WorkerArgs {
        url: small_pool(url),
        ledger: small_pool(&ledger_url),
        prefix: prefix.clone(),
        keys: options.keys,
        ttl: options.ttl,
        steps: options.steps,
        step_time: options.step_time,
        seed: options.seed,
        r#break: options.r#break,
    };
    let history = Arc::new(History::default());
    // The origin of the printed histories' times: before any worker reports.
    let origin = event::now();
    let mut workers = Workers::start(args, options.workers, history.clone())
        .map_err(|e| LockError::Config(format!("cannot start the worker processes: {e}")))?;
    let shown = distlock::redact_url(url);
    let started = Instant::now();
    let done = nemesis(options, &mut workers, own, &history, &shown).await?;
    let patience = options.ttl * 4 + options.step_time * options.steps + Duration::from_secs(5);
    workers.stop(patience).await;
    let seconds = started.elapsed().as_secs_f64();

    let mut finals = Vec::new();
    for key in 0..options.keys {
        let value = read_ledger(&*ledger, &worker::name(&prefix, key)).await?;
        finals.push(value.as_deref().map(worker::parse).transpose()?);
    }
    for key in 0..options.keys {
        // Best effort: a store that cannot purge keeps the keys until their TTL.
        if let Ok(key) = LockKey::new(worker::name(&prefix, key)) {
            let _ = backend.purge(&key).await;
        }
    }
    let records = std::mem::take(&mut *history.records.lock());
    let faults = std::mem::take(&mut *history.faults.lock());
    let (tally, mut violations) = check::check(&records, &fault::deaths(&faults), &finals);
    let histories = timeline::histories(&records, &faults, &violations, origin);
    let mut violated = BTreeMap::new();
    for v in &violations {
        *violated.entry(v.property).or_insert(0) += 1;
    }
    violations.truncate(SHOWN);
    let report = Report {
        store: shown,
        seconds,
        workers: options.workers,
        keys: options.keys,
        ttl_ms: options.ttl.as_millis(),
        sections_per_s: tally.sections as f64 / seconds,
        writes_per_s: tally.writes_admitted as f64 / seconds,
        tally,
        pauses: done.pauses,
        kills: done.kills,
        restarts: done.restarts,
        violated,
        violations,
        histories,
    };
    print(&report, options.json);
    Ok(if report.violated.is_empty() {
        ExitCode::SUCCESS
    } else {
        crate::exit::no()
    })
}

/// How long the run tries to read the ledger at the end while the store says "try
/// again" (a connection the last restart or failover broke, a store still loading).
const LEDGER_PATIENCE: Duration = Duration::from_secs(15);

/// Reads a ledger entry, asking again while the error is one worth retrying: a read
/// changes nothing, and the store may just have been restarted by the nemesis.
async fn read_ledger(
    ledger: &dyn distlock::FencedResource,
    name: &str,
) -> Result<Option<Vec<u8>>, LockError> {
    let give_up = Instant::now() + LEDGER_PATIENCE;
    let mut pause = Duration::from_millis(50);
    loop {
        match ledger.read(name).await {
            Err(e) if e.is_retryable() && Instant::now() + pause < give_up => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            read => return read,
        }
    }
}

/// What the nemesis did.
#[derive(Debug, Default)]
struct Done {
    pauses: u32,
    kills: u32,
    restarts: u32,
}

/// Pauses and kills workers, and restarts the store when the run started it (one action
/// in four), at random until the run's time is up, printing a progress line each second.
async fn nemesis(
    options: &Options,
    workers: &mut Workers,
    mut own: Option<&mut OwnStore>,
    history: &History,
    shown: &str,
) -> Result<Done, LockError> {
    let mut rng = StdRng::seed_from_u64(options.seed ^ 0x5eed);
    let start = Instant::now();
    let end = start + options.duration;
    let tick = Duration::from_millis(20);
    let mut resume_at: Vec<Option<Instant>> = vec![None; workers.len() as usize];
    let mut next_action = options
        .nemesis_every
        .map(|every| start + every.mul_f64(rng.random_range(0.5..1.5)));
    let mut next_progress = start + Duration::from_secs(1);
    let mut done = Done::default();
    while Instant::now() < end {
        tokio::time::sleep(tick).await;
        let now = Instant::now();
        if let Some((worker, status)) = workers.exited().map_err(io_error)? {
            return Err(LockError::Config(format!(
                "worker {worker} exited on its own ({status}); what it said is above"
            )));
        }
        for (worker, at) in resume_at.iter_mut().enumerate() {
            if at.is_some_and(|at| at <= now) {
                workers.resume(worker as u32);
                *at = None;
            }
        }
        if let (Some(at), Some(every)) = (next_action, options.nemesis_every)
            && at <= now
        {
            next_action = Some(now + every.mul_f64(rng.random_range(0.5..1.5)));
            let worker = rng.random_range(0..workers.len());
            let pause = options.pauses && (!options.kills || rng.random_bool(0.6));
            if let Some(store) = own.as_deref_mut().filter(|_| rng.random_bool(0.25)) {
                let at = event::now();
                store.restart().await.map_err(io_error)?;
                let up = event::now();
                history.fault(at, FaultKind::StoreRestart { up });
                done.restarts += 1;
            } else if workers.is_paused(worker) {
                // Already stopped: leave it to its pause.
            } else if pause {
                workers.pause(worker);
                // Past the TTL, so its lease runs out while it cannot renew.
                let held = options.ttl.mul_f64(rng.random_range(1.2..2.0));
                resume_at[worker as usize] = Some(now + held);
                done.pauses += 1;
            } else if options.kills {
                workers.kill_and_restart(worker).await.map_err(io_error)?;
                done.kills += 1;
            }
        }
        if now >= next_progress {
            next_progress += Duration::from_secs(1);
            let c = &history.counts;
            eprintln!(
                "torture {shown}: {:>3}s/{}s  grants {}  writes {} (refused {})  pauses {}  kills {}  restarts {}  errors {}",
                now.duration_since(start).as_secs(),
                options.duration.as_secs(),
                c.grants.load(Ordering::Relaxed),
                c.writes.load(Ordering::Relaxed),
                c.refused.load(Ordering::Relaxed),
                done.pauses,
                done.kills,
                done.restarts,
                c.errors.load(Ordering::Relaxed),
            );
        }
    }
    Ok(done)
}

/// How many connections a worker's PostgreSQL pools open when the URL does not say: a
/// worker holds one lock at a time, and every worker opens pools of its own (one for the
/// locks, one for the ledger), which at the default size of 10 would take a default
/// server's 100 connections with four workers.
const WORKER_POOL_SIZE: u32 = 2;

/// `url` for a worker: a PostgreSQL URL without `pool_size` gets [`WORKER_POOL_SIZE`].
fn small_pool(url: &str) -> String {
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    if !postgres || query.split('&').any(|p| p.starts_with("pool_size=")) {
        return url.to_owned();
    }
    let query = [query.to_owned(), format!("pool_size={WORKER_POOL_SIZE}")]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("&");
    format!("{base}?{query}")
}

fn io_error(e: std::io::Error) -> LockError {
    LockError::Config(format!("cannot run the worker processes: {e}"))
}

fn print(report: &Report, json: bool) {
    if json {
        match serde_json::to_string_pretty(report) {
            Ok(text) => println!("{text}"),
            Err(e) => eprintln!("lockctl: cannot print the report: {e}"),
        }
        return;
    }
    let t = &report.tally;
    println!(
        "torture {}: {:.1} s, {} workers, {} locks, TTL {} ms",
        report.store, report.seconds, report.workers, report.keys, report.ttl_ms
    );
    println!(
        "  grants {}  critical sections {} ({:.1}/s)  writes admitted {} ({:.1}/s)",
        t.grants, t.sections, report.sections_per_s, t.writes_admitted, report.writes_per_s
    );
    println!(
        "  stale writes refused by the fence {}  losses noticed {}  releases after expiry {}  errors {}",
        t.writes_refused, t.losses_noticed, t.releases_not_held, t.errors
    );
    println!(
        "  nemesis: {} pauses past the TTL, {} kills, {} store restarts",
        report.pauses, report.kills, report.restarts
    );
    if report.violated.is_empty() {
        println!("  violations: none");
    } else {
        let counts: Vec<String> = report
            .violated
            .iter()
            .map(|(property, n)| format!("{property} {n}"))
            .collect();
        println!("  violations: {}", counts.join(", "));
        for v in report.violations.iter().take(20) {
            println!("    {} on lock {}: {}", v.property, v.key, v.detail);
        }
        for history in &report.histories {
            print!("{history}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_opens_small_postgres_pools_unless_the_url_says_otherwise() {
        for (url, worker) in [
            ("postgres://u@h/db", "postgres://u@h/db?pool_size=2"),
            (
                "postgresql://u@h/db?mode=advisory",
                "postgresql://u@h/db?mode=advisory&pool_size=2",
            ),
            (
                "postgres://u@h/db?pool_size=5",
                "postgres://u@h/db?pool_size=5",
            ),
            ("redis://h:6379", "redis://h:6379"),
        ] {
            assert_eq!(small_pool(url), worker);
        }
    }
}
