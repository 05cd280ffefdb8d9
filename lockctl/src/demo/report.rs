//! The demo's result: one row per strategy, printed as a table or as JSON.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use super::strategy::Run;
use super::workload::{Census, Timing};

/// One strategy's counts, all measured during its run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    /// The strategy's name.
    pub strategy: &'static str,
    /// Jobs in the workload.
    pub jobs: u64,
    /// Deliveries the queue made, redeliveries and duplicates included.
    pub deliveries: u64,
    /// Executions of a job's body.
    pub executions: u64,
    /// Payments the ledger recorded.
    pub payments: u64,
    /// Payments beyond the first for a job.
    pub duplicates: u64,
    /// The money those duplicates paid out, in cents.
    pub overpaid_cents: u64,
    /// Writes refused by the fencing check.
    pub stale_rejected: u64,
    /// Writes the idempotency key turned into no-ops.
    pub idempotent_repeats: u64,
    /// Deliveries that found the job's lock taken.
    pub lock_misses: u64,
    /// Leases lost while held: run out or taken over before their holder released them.
    pub lost_leases: u64,
    /// Worker crashes (after the write, before the ack).
    pub crashes: u64,
    /// Pauses before a write.
    pub pauses: u64,
    /// Jobs never paid (at-least-once delivery keeps this at zero).
    pub unpaid_jobs: u64,
    /// How long the run took, in seconds.
    pub seconds: f64,
}

impl Row {
    /// The row for a finished run.
    pub fn from_run(run: &Run, took: Duration) -> Self {
        let jobs = u32::try_from(run.workload.jobs.len()).unwrap_or(u32::MAX);
        let ledger = run.ledger.summary(jobs);
        let c = &run.counters;
        let get = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
        Self {
            strategy: run.strategy.name(),
            jobs: u64::from(jobs),
            deliveries: run.queue.deliveries(),
            executions: get(&c.executions),
            payments: ledger.payments,
            duplicates: ledger.duplicate_payments,
            overpaid_cents: ledger.overpaid_cents,
            stale_rejected: get(&c.stale_rejected),
            idempotent_repeats: get(&c.idempotent_repeats),
            lock_misses: get(&c.lock_misses),
            lost_leases: get(&c.lost_leases),
            crashes: get(&c.crashes),
            pauses: get(&c.pauses),
            unpaid_jobs: ledger.unpaid_jobs,
            seconds: (took.as_secs_f64() * 100.0).round() / 100.0,
        }
    }
}

/// The rows as a JSON array, one object per strategy.
pub fn json(rows: &[Row]) -> String {
    serde_json::to_string_pretty(rows).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// What the table is about: the workload, and what each column counts.
pub struct Header<'a> {
    /// The backend URL, redacted.
    pub backend: &'a str,
    /// The seed.
    pub seed: u64,
    /// Workers per strategy.
    pub workers: u32,
    /// The timings.
    pub timing: Timing,
    /// The planted failures.
    pub census: Census,
}

const COLUMNS: [&str; 11] = [
    "strategy",
    "jobs",
    "deliveries",
    "executions",
    "payments",
    "duplicates",
    "overpaid",
    "stale rejected",
    "idempotent repeats",
    "lock misses",
    "lost leases",
];

/// The rows as a text table, with the workload above it and a legend below.
pub fn table(header: &Header<'_>, rows: &[Row]) -> String {
    let cells: Vec<[String; 11]> = rows
        .iter()
        .map(|r| {
            [
                r.strategy.to_owned(),
                r.jobs.to_string(),
                r.deliveries.to_string(),
                r.executions.to_string(),
                r.payments.to_string(),
                r.duplicates.to_string(),
                dollars(r.overpaid_cents),
                r.stale_rejected.to_string(),
                r.idempotent_repeats.to_string(),
                r.lock_misses.to_string(),
                r.lost_leases.to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..COLUMNS.len())
        .map(|i| {
            cells
                .iter()
                .map(|row| row[i].len())
                .chain([COLUMNS[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |row: &[&str]| {
        let mut out = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i == 0 {
                let _ = write!(out, "{cell:<w$}", w = widths[i]);
            } else {
                let _ = write!(out, "  {cell:>w$}", w = widths[i]);
            }
        }
        out.trim_end().to_owned() + "\n"
    };

    let t = &header.timing;
    let c = &header.census;
    let jobs = rows.first().map_or(0, |r| r.jobs);
    let mut out = format!(
        "{jobs} payment jobs, {workers} workers per strategy, on {backend} (seed {seed})\n\
         lease TTL {ttl:?}, queue visibility timeout {vis:?}; planted: {dups} duplicate deliveries, \
         {long} jobs longer than the TTL, {pauses} pauses of ~5 TTLs before the write, \
         {crashes} crashes after the write before the ack\n\n",
        workers = header.workers,
        backend = header.backend,
        seed = header.seed,
        ttl = t.ttl,
        vis = t.visibility_timeout,
        dups = c.duplicate_deliveries,
        long = c.longer_than_ttl,
        pauses = c.pauses,
        crashes = c.crashes,
    );
    out += &line(&COLUMNS);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    out += &line(&rule.iter().map(String::as_str).collect::<Vec<_>>());
    for row in &cells {
        out += &line(&row.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out += "\n\
        duplicates          payments beyond the first for one job (the side effect applied twice); overpaid: their sum\n\
        stale rejected      writes the fencing check refused: a newer lease of the job had written already\n\
        idempotent repeats  writes the idempotency key payment:{jobId} turned into no-ops\n\
        lock misses         deliveries that found the job's lock held and went back to the queue\n\
        lost leases         leases that ran out while held (no renewal, or a pause froze the renewal)\n\
        \n\
        A lock stops duplicate deliveries; renewal keeps long jobs' leases; fencing rejects the\n\
        writes of paused workers whose lease moved on; only the idempotency key makes the re-run\n\
        after a crash between the write and the ack harmless.\n";
    out
}

fn dollars(cents: u64) -> String {
    format!("${}.{:02}", cents / 100, cents % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn money_is_shown_in_dollars_and_cents() {
        assert_eq!(dollars(0), "$0.00");
        assert_eq!(dollars(123_456), "$1234.56");
        assert_eq!(dollars(5), "$0.05");
    }

    #[test]
    fn the_json_names_are_the_table_headers() {
        let row = Row {
            strategy: "no-lock",
            jobs: 1,
            deliveries: 1,
            executions: 1,
            payments: 1,
            duplicates: 0,
            overpaid_cents: 0,
            stale_rejected: 0,
            idempotent_repeats: 0,
            lock_misses: 0,
            lost_leases: 0,
            crashes: 0,
            pauses: 0,
            unpaid_jobs: 0,
            seconds: 0.0,
        };
        let object = serde_json::to_value(&row).unwrap();
        for header in COLUMNS {
            // The table shows dollars; the JSON keeps cents and says so.
            let name = match header {
                "overpaid" => "overpaid_cents".to_owned(),
                other => other.replace(' ', "_"),
            };
            assert!(
                object.get(&name).is_some(),
                "the JSON has no {name:?}: {object}"
            );
        }
    }
}
