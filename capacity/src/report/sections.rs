//! The sections of [`Report::markdown`], one method each, in the order they appear.

use std::fmt::Write as _;

use super::full::write_full_semaphore;
use super::{Report, write_header, write_permits, write_waited};
use crate::cells;
use crate::subject::SubjectId;

impl Report {
    /// The title, the machine and how the runs were made; what was left out.
    pub(super) fn intro(&self, md: &mut String) {
        write_header(
            md,
            "distlock capacity report",
            &self.mode,
            &self.machine,
            true,
        );
        let _ = writeln!(
            md,
            "\nEvery server runs on this machine, on 127.0.0.1, started by the benchmark \
             (PostgreSQL as deployed: `fsync=on`, `synchronous_commit=on`), and shares its \
             cores with the client. Compare \
             ratios within this report, not absolute numbers across machines or runs. Each \
             level ran {:?} after {:?} of warm-up; a cycle is one acquire then one release \
             of a free key (one key per task); TTL {:?}.\n",
            self.plan.duration,
            self.plan.warmup,
            crate::subject::TTL
        );
        for note in &self.absent {
            let _ = writeln!(md, "> **Absent:** {note}\n");
        }
    }

    /// The targets and whether this run met them.
    pub(super) fn targets_section(&self, md: &mut String) {
        let _ = writeln!(md, "## Targets\n");
        let _ = writeln!(
            md,
            "| target | goal | measured | result |\n|---|---|---|---|"
        );
        let targets = self.targets();
        for t in &targets {
            let result = match t.met {
                Some(true) => "met",
                Some(false) => "**missed**",
                None => "not measured",
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                t.what, t.goal, t.measured, result
            );
        }
        md.push_str(&crate::target::misses_markdown(&targets));
    }

    /// The interleaved pairs the target ratios come from.
    pub(super) fn pairs(&self, md: &mut String) {
        if !self.results.paired.is_empty() {
            let _ = writeln!(
                md,
                "\nThe ratios above come from the pairs below, measured in alternation \
                 ({} rounds of {:?} each, order swapped every round) so that both sides see \
                 the same machine; the median round is reported.\n",
                self.plan.pair_rounds,
                self.plan.duration / 3
            );
            let _ = writeln!(
                md,
                "| subject | compared with | tasks | cycles/s ratio (median) | acquire p50 ratio (median) | per-round cycles/s ratios |\n|---|---|---:|---:|---:|---|"
            );
            for p in &self.results.paired {
                let rounds: Vec<String> = p
                    .throughput_ratios
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.2}x | {:.2}x | {} |",
                    p.a.slug(),
                    p.b.slug(),
                    p.concurrency,
                    p.throughput_ratio(),
                    p.acquire_p50_ratio(),
                    rounds.join(" ")
                );
            }
        }
    }

    /// The Redis pairs with client and server sharing the cores and each on its own.
    pub(super) fn placed(&self, md: &mut String) {
        if let Some(placed) = &self.results.placed {
            let _ = writeln!(md, "\n## Redis pairs, shared and pinned\n");
            let _ = writeln!(md, "{}", placed.markdown(self.plan.duration / 3));
        }
    }

    /// Releases with a waiter on every key, a semaphore's permit cycles, and a full
    /// semaphore.
    pub(super) fn waited(&self, md: &mut String) {
        write_waited(md, &self.plan, &self.results.waited);
        write_permits(md, &self.plan, &self.results.permits);
        write_full_semaphore(md, &self.plan, &self.results.full);
    }

    /// Throughput and latency of every subject at every concurrency.
    pub(super) fn sweep(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Throughput and latency by concurrency\n");
        let _ = writeln!(
            md,
            "Latency is per cycle (acquire + release); `acquire p50` is the acquire step alone. \
             The ratio is the backend's cycles/s over its matching baseline's (the raw client \
             doing the same primitive operations) at the same concurrency, from this sweep, where \
             the two were measured at different moments: the targets use the interleaved \
             pairs above instead.\n"
        );
        let _ = writeln!(
            md,
            "| subject | tasks | cycles/s | p50 µs | p99 µs | p99.9 µs | acquire p50 µs | ratio to baseline |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---|");
        for s in &self.results.sweep {
            let ratio = self
                .ratio(s)
                .map_or(String::new(), |(b, r)| format!("{r:.2}x {}", b.slug()));
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
                s.subject.slug(),
                s.concurrency,
                s.ops_per_sec(),
                s.cycle_us(0.5),
                s.cycle_us(0.99),
                s.cycle_us(0.999),
                s.acquire_us(0.5),
                ratio
            );
        }
    }

    /// One key and many tasks trying it.
    pub(super) fn contended(&self, md: &mut String) {
        let _ = writeln!(
            md,
            "\n## Contended: one key, {} tasks\n",
            self.plan.contended_tasks
        );
        let _ = writeln!(
            md,
            "| backend | attempts/s | grants/s | attempt p50 µs | attempt p99 µs |\n|---|---:|---:|---:|---:|"
        );
        for s in &self.contended {
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} |",
                s.subject.slug(),
                s.ops_per_sec(),
                s.acquired_per_sec(),
                s.cycle_us(0.5),
                s.cycle_us(0.99)
            );
        }
    }

    /// Release-to-next-grant time with waiters woken or polling.
    pub(super) fn handoffs(&self, md: &mut String) {
        if !self.handoffs.is_empty() {
            let _ = writeln!(
                md,
                "\n## Handoff: one key, {} tasks waiting in `Locker::lock`\n\n\
                 In rounds: the tasks queue behind a held key for {:?}, then the key passes \
                 from task to task, each holding it {:?}. Time from sending a release to \
                 the next grant, and the acquire calls the store served per handoff, with \
                 the backend's release notifications and with waiters polling (default \
                 backoff, 10 ms doubling to 1 s, jittered).\n",
                self.plan.contended_tasks,
                crate::handoff::QUEUED,
                crate::handoff::HOLD,
            );
            let _ = writeln!(
                md,
                "| backend | waiters woken by | handoffs | p50 µs | p99 µs | acquires per handoff |\n|---|---|---:|---:|---:|---:|"
            );
            for h in &self.handoffs {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.0} | {:.0} | {:.2} |",
                    h.subject.slug(),
                    if h.notified {
                        "notification"
                    } else {
                        "polling"
                    },
                    h.handoffs,
                    h.p50_us,
                    h.p99_us,
                    h.acquires_per_handoff
                );
            }
        }
    }

    /// Renewals of one lease.
    pub(super) fn renew(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Renew (one lease, one task)\n");
        let _ = writeln!(md, "| backend | renewals/s |\n|---|---:|");
        for (subject, rate) in &self.renew {
            let _ = writeln!(md, "| {} | {rate:.0} |", subject.slug());
        }
    }

    /// `acquire_many` and `renew_many` keys per second.
    pub(super) fn batches(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Batches (`acquire_many` / `renew_many`)\n");
        let _ = writeln!(
            md,
            "| backend | keys | native batch | acquire keys/s | renew keys/s | note |\n|---|---:|---|---:|---:|---|"
        );
        for b in &self.results.batches {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                b.subject.slug(),
                b.size,
                if b.native { "yes" } else { "no (one by one)" },
                cells::rate(b.acquire_keys_per_sec),
                cells::rate(b.renew_keys_per_sec),
                b.note.as_deref().unwrap_or("")
            );
        }
    }

    /// Redis server time per call and per cycle, and the token counters after their retention.
    pub(super) fn redis_cost(&self, md: &mut String) {
        if let Some(cost) = &self.redis_cost {
            let _ = writeln!(md, "\n## Redis server time per call\n");
            let _ = writeln!(
                md,
                "From `INFO commandstats` (`usec_per_call`) over {} sequential calls each: what \
                 the server itself spends, without the network and the client.\n",
                cost.calls
            );
            let _ = writeln!(md, "| call | server µs |\n|---|---:|");
            let _ = writeln!(
                md,
                "| distlock acquire script | {:.2} |",
                cost.acquire_script_us
            );
            let _ = writeln!(md, "| raw SET NX PX | {:.2} |", cost.set_nx_us);
            let _ = writeln!(
                md,
                "| distlock release script | {:.2} |",
                cost.release_script_us
            );
            let _ = writeln!(md, "| raw DEL | {:.2} |", cost.del_us);
            if !cost.cycle_us.is_empty() {
                let _ = writeln!(
                    md,
                    "\nA whole acquire + release cycle on fresh keys, summed over the commands \
                     each client sends (a script's time includes the commands it runs):\n"
                );
                let _ = writeln!(md, "| cycle | server µs | vs rslock |\n|---|---:|---:|");
                let rslock = cost
                    .cycle_us
                    .iter()
                    .find(|(subject, _)| *subject == SubjectId::Rslock)
                    .map(|(_, us)| *us);
                for (subject, us) in &cost.cycle_us {
                    let ratio =
                        rslock.map_or_else(|| "—".to_owned(), |r| format!("{:.2}×", us / r));
                    let _ = writeln!(md, "| {} | {us:.2} | {ratio} |", subject.slug());
                }
                let rounds: Vec<String> = cost
                    .sequential_ratios()
                    .iter()
                    .map(|r| format!("{r:.2}×"))
                    .collect();
                let _ = writeln!(
                    md,
                    "
Medians of {} rounds, the subjects alternating; distlock over rslock \
                     round by round: {}.",
                    cost.cycle_rounds.len(),
                    rounds.join(", ")
                );
            }
            if !cost.loaded.is_empty() {
                let _ = writeln!(
                    md,
                    "\nUnder load: {} tasks on per-task keys, distlock and rslock in alternation; \
                     the server's CPU time (`INFO cpu`: commands, scripts and socket work) and \
                     the commands it ran (scripts' own commands included) per cycle. distlock \
                     sends single calls that arrive while one is on its way as one multi-key \
                     script call, so its script overhead is shared here.\n",
                    cost.loaded[0].concurrency
                );
                let _ = writeln!(
                    md,
                    "| subject | cycles/s | server CPU µs per cycle | commands per cycle |\n\
                     |---|---:|---:|---:|"
                );
                for l in &cost.loaded {
                    let _ = writeln!(
                        md,
                        "| {} | {:.0} | {:.2} | {:.2} |",
                        l.subject.slug(),
                        l.cycles_per_sec,
                        l.cpu_us_per_cycle,
                        l.commands_per_cycle
                    );
                }
                if let Some(ratio) = cost.loaded_ratio() {
                    let _ = writeln!(
                        md,
                        "\nMedian server CPU per cycle, distlock over rslock: {ratio:.2}×."
                    );
                }
            }
            if let Some(r) = &cost.retention {
                let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
                let _ = writeln!(md, "\n## Token counters after their retention\n");
                let _ = writeln!(
                    md,
                    "{} distinct keys locked and released once each with a {:?} fence \
                     retention. Redis `used_memory`: {:.1} MiB before, {:.1} MiB right after the \
                     releases, {:.1} MiB {:.1} s after the retention ran out: {} bytes left \
                     behind (target: within 1 MiB).",
                    r.keys,
                    r.retention,
                    mib(r.before),
                    mib(r.after_release),
                    mib(r.after_retention),
                    r.expired_within.as_secs_f64(),
                    r.left_behind()
                );
            }
        }
    }

    /// Memory per held guard.
    pub(super) fn memory(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Memory per held guard\n");
        match &self.results.memory {
            Some(mem) => {
                let _ = writeln!(
                    md,
                    "{} guards held on the memory backend with the watchdog renewing them \
                     (TTL {:?}, in a process of their own): resident memory grew {:.0} B per \
                     guard, store entry included; the same number of plain leases without guards \
                     cost {:.0} B each, so a guard itself costs **{:.0} B**. After more than one \
                     TTL, {} of {} guards were still held (renewed in time).",
                    mem.guards,
                    self.plan.guard_ttl,
                    mem.bytes_per_guard,
                    mem.bytes_per_plain_lease,
                    mem.bytes_beyond_store(),
                    mem.held_after_renewals,
                    mem.guards
                );
            }
            None => {
                let _ = writeln!(md, "Not measured in this run.");
            }
        }
    }

    /// What one cycle is for each subject.
    pub(super) fn subjects_section(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Subjects\n");
        let _ = writeln!(md, "| subject | one cycle |\n|---|---|");
        let mut seen = Vec::new();
        for s in &self.results.sweep {
            if !seen.contains(&s.subject) {
                seen.push(s.subject);
                let _ = writeln!(md, "| {} | {} |", s.subject.slug(), s.subject.describe());
            }
        }
    }

    /// Links to the charts.
    pub(super) fn charts(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Charts\n");
        let _ = writeln!(md, "![throughput vs concurrency](throughput.svg)\n");
        for level in [self.plan.levels.first(), self.plan.levels.last()]
            .into_iter()
            .flatten()
        {
            let _ = writeln!(
                md,
                "![latency percentiles at {level} tasks](latency_c{level}.svg)\n"
            );
        }
    }
}
