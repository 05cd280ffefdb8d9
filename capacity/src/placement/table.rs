//! The Redis pairs shared and pinned as a markdown table (the report prints it, and so
//! does `capacity --pairs-only`).

use std::fmt::Write;

use super::{PlacedPairs, Placement};
use crate::cells::micros;
use crate::subject::SubjectId;
use crate::waited::Side;

impl PlacedPairs {
    /// A paragraph on how the rows were measured, then one row per subject, placement and
    /// level: median cycles/s, client and server CPU µs per cycle, and distlock's per-round
    /// cycles/s ratios to it.
    pub fn markdown(&self, each: std::time::Duration) -> String {
        let mut md = String::new();
        let pinned = match (self.cpus, &self.pinned_skipped) {
            (Some((server, client)), _) => {
                format!("pinned: redis-server on CPU {server}, every client thread on CPU {client}")
            }
            (None, Some(reason)) => format!("pinned rounds not run: {reason}"),
            (None, None) => "pinned rounds not run".into(),
        };
        let _ = writeln!(
            md,
            "Shared: redis-server and the client on every core; {pinned}. {} interleaved \
             rounds of {each:?} per subject (after a warm-up), placements and subjects in \
             a new order every round; medians shown. CPU per cycle is the time the threads \
             ran (`/proc/*/task/*/schedstat`) over the cycles of the window: the client is \
             this whole process.\n",
            self.rounds
        );
        let _ = writeln!(
            md,
            "| placement | tasks | subject | cycles/s | client CPU µs/cycle | server CPU µs/cycle | distlock / it, cycles/s per round |\n\
             |---|---:|---|---:|---:|---:|---|"
        );
        for row in self.rows.iter().filter(|r| !r.rounds.per_sec.is_empty()) {
            let ratios = if row.subject == SubjectId::Redis {
                String::new()
            } else {
                self.round_ratios(
                    row.placement,
                    row.concurrency,
                    (SubjectId::Redis, row.subject),
                    |s: &Side| &s.per_sec,
                )
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.0} | {} | {} | {ratios} |",
                row.placement.name(),
                row.concurrency,
                row.subject.slug(),
                row.rounds.rate(),
                micros(row.rounds.client()),
                micros(row.rounds.server()),
            );
        }
        if self
            .rows
            .iter()
            .all(|r| r.placement != Placement::Pinned || r.rounds.per_sec.is_empty())
        {
            let _ = writeln!(md, "\n> **Pinned:** {pinned}.");
        }
        md
    }
}
