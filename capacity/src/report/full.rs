//! The report's "A full semaphore" section: waits and refusals at N = 1, 64 and 1024
//! beside a lock's, per backend.

use std::fmt::Write as _;

use crate::cells;
use crate::full_semaphore::{Full, FullSemaphore, Rounds, wait_bound};
use crate::plan::Plan;

/// Writes the section, if any backend was measured.
pub(super) fn write_full_semaphore(md: &mut String, plan: &Plan, rows: &[FullSemaphore]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n## A full semaphore\n\n\
         {} tasks on one semaphore of N permits, through a `Locker`, while another \
         instance of the backend holds permits of it. *Waits*: it holds N − 1, and the \
         tasks wait for the one left (`Semaphore::acquire`, each wait bounded by {:?}) and \
         release it at once: permits granted per second. *Refusals*: it holds all N, and \
         the tasks call `try_acquire`, each refused: refusals per second. The lock row \
         does the same with one key (`Locker::lock`, `try_lock` on a key held elsewhere). \
         Cases alternate, {} rounds of {:?} after {:?} of warm-up, the order turning \
         every round; medians. CPU µs per grant (per refusal), client / server; server µs \
         in commands from `INFO commandstats` (Redis).\n",
        plan.full_tasks,
        wait_bound(plan),
        plan.pair_rounds,
        plan.duration / 3,
        plan.warmup
    );
    let _ = writeln!(
        md,
        "| backend | N | waits: grants/s | CPU µs per grant | refusals/s | CPU µs per refusal | server µs in commands per refusal |\n|---|---:|---:|---|---:|---|---:|"
    );
    for row in rows {
        write_row(md, row.subject.slug(), "lock", &row.lock);
        for (n, full) in &row.sizes {
            write_row(md, row.subject.slug(), &n.to_string(), full);
        }
        for (n, why) in &row.left_out {
            let _ = writeln!(
                md,
                "| {} | {n} | not measured: {why} | | | | |",
                row.subject.slug()
            );
        }
    }
    if !rows
        .iter()
        .any(|r| r.at(1024).is_some() && r.at(64).is_some())
    {
        return;
    }
    let _ = writeln!(
        md,
        "\nN = 1024 against N = 64, median of the rounds' ratios:\n\n\
         | backend | grants/s | refusals/s | server µs per refusal |\n|---|---:|---:|---:|"
    );
    for row in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} |",
            row.subject.slug(),
            cells::ratio(row.ratio(1024, 64, |f| &f.waits.side.per_sec)),
            cells::ratio(row.ratio(1024, 64, |f| &f.refusals.side.per_sec)),
            cells::ratio(row.ratio(1024, 64, |f| &f.refusals.command_us)),
        );
    }
}

fn write_row(md: &mut String, backend: &str, n: &str, full: &Full) {
    let _ = writeln!(
        md,
        "| {backend} | {n} | {:.0} | {} | {:.0} | {} | {} |",
        full.waits.side.rate(),
        cpu(&full.waits),
        full.refusals.side.rate(),
        cpu(&full.refusals),
        cells::micros(full.refusals.command()),
    );
}

/// CPU µs per counted cycle, client / server.
fn cpu(rounds: &Rounds) -> String {
    format!(
        "{} / {}",
        cells::micros(rounds.side.client()),
        cells::micros(rounds.side.server())
    )
}
