//! Writes a run's results: `report.md` (machine, targets, tables), `capacity.csv` (one row
//! per subject and concurrency) and SVG charts drawn with `plotters`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::BenchError;
use crate::handoff::HandoffRow;
use crate::load::Sample;
use crate::machine::Machine;
use crate::permits::PermitCycles;
use crate::scenarios::{Plan, RedisServerCost, Results, Target};
use crate::subject::SubjectId;
use crate::waited::WaitedReleases;

/// The header of `capacity.csv`.
pub const CSV_HEADER: &str = "subject,kind,store,concurrency,ops,seconds,ops_per_sec,\
     p50_us,p99_us,p999_us,acquire_p50_us,acquire_p99_us,baseline,ratio_to_baseline";

/// The top of a report: its title, when and in which mode it was measured, and the table
/// of the machine it ran on. With `servers_here` the servers ran on that machine too and
/// the table gives their versions; without, it is the client machine only.
pub(crate) fn write_header(
    md: &mut String,
    title: &str,
    mode: &str,
    machine: &Machine,
    servers_here: bool,
) {
    let _ = writeln!(md, "# {title}\n");
    let _ = writeln!(md, "Measured {} ({mode} run).\n", machine.date);
    let label = if servers_here {
        "machine"
    } else {
        "client machine"
    };
    let _ = writeln!(md, "| {label} | |\n|---|---|");
    let _ = writeln!(md, "| cores | {} |", machine.cores);
    let _ = writeln!(
        md,
        "| RAM | {} |",
        machine.ram_mib.map_or("unknown".into(), |r| format!(
            "{:.1} GiB",
            r as f64 / 1024.0
        ))
    );
    let _ = writeln!(md, "| CPU | {} |", machine.cpu);
    let _ = writeln!(md, "| kernel | {} |", machine.kernel);
    if servers_here {
        for (name, version) in &machine.servers {
            let _ = writeln!(md, "| {name} | {version} |");
        }
    }
}

/// Everything one run measured, ready to be written.
#[derive(Clone, Debug)]
pub struct Report {
    /// Where it ran.
    pub machine: Machine,
    /// `full` or `quick`.
    pub mode: String,
    /// How much was measured.
    pub plan: Plan,
    /// The sweep, batches and memory.
    pub results: Results,
    /// One contended key per backend.
    pub contended: Vec<Sample>,
    /// Handoffs of one key among waiting tasks, per backend, notified and polling.
    pub handoffs: Vec<HandoffRow>,
    /// Renewals per second of one lease, per backend.
    pub renew: Vec<(SubjectId, f64)>,
    /// What the Redis server spends per script and per raw command, when Redis ran.
    pub redis_cost: Option<RedisServerCost>,
    /// Backends or stores left out of this run, with the reason.
    pub absent: Vec<String>,
}

fn output_err(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Output {
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

impl Report {
    /// The targets judged on this run.
    pub fn targets(&self) -> Vec<Target> {
        let mut out = self.results.targets();
        let cost = self.redis_cost.as_ref();
        let at_most = |what: &str, goal: f64, value: Option<f64>| Target {
            what: what.to_owned(),
            goal: format!("<= {goal:.2}x"),
            measured: value.map_or("not measured in this run".into(), |v| format!("{v:.3}x")),
            met: value.map(|v| v <= goal),
        };
        out.push(at_most(
            "Redis server µs per cycle / rslock's, one task, fresh keys (INFO commandstats, \
             median of the alternating rounds' ratios)",
            2.5,
            cost.and_then(RedisServerCost::sequential_ratio),
        ));
        out.push(at_most(
            "Redis server CPU per cycle / rslock's, 64 tasks (INFO cpu)",
            2.0,
            cost.and_then(RedisServerCost::loaded_ratio),
        ));
        let retention = cost.and_then(|c| c.retention.as_ref());
        out.push(Target {
            what: "Redis used_memory left after one-off keys (1,000,000 in a full run) and their retention".into(),
            goal: "<= 1,048,576 B".into(),
            measured: retention.map_or("not measured in this run".into(), |r| {
                format!("{} B ({} keys)", r.left_behind(), r.keys)
            }),
            met: retention.map(|r| r.left_behind() <= 1 << 20),
        });
        out
    }

    /// Writes every file into `dir` (created if needed) and returns their paths.
    pub fn write_all(&self, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
        let groups: Vec<(String, Vec<&Sample>)> = self
            .subjects()
            .into_iter()
            .map(|subject| {
                let samples = self.results.sweep.iter().filter(|s| s.subject == subject);
                (subject.slug().to_owned(), samples.collect())
            })
            .collect();
        write_files(dir, self.markdown(), self.csv(), &self.plan.levels, &groups)
    }

    /// The ratio of a sample's throughput to its matching baseline's at the same level.
    fn ratio(&self, sample: &Sample) -> Option<(SubjectId, f64)> {
        let baseline = sample.subject.baseline()?;
        let ratio = self
            .results
            .throughput_ratio(sample.subject, baseline, sample.concurrency)?;
        Some((baseline, ratio))
    }

    /// The summary: machine, targets, and the throughput table at every level.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        write_header(
            &mut md,
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

        let _ = writeln!(md, "## Targets\n");
        let _ = writeln!(
            md,
            "| target | goal | measured | result |\n|---|---|---|---|"
        );
        for t in self.targets() {
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

        if let Some(placed) = &self.results.placed {
            let _ = writeln!(md, "\n## Redis pairs, shared and pinned\n");
            let _ = writeln!(md, "{}", placed.markdown(self.plan.duration / 3));
        }

        write_waited(&mut md, &self.plan, &self.results.waited);
        write_permits(&mut md, &self.plan, &self.results.permits);

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

        let _ = writeln!(md, "\n## Renew (one lease, one task)\n");
        let _ = writeln!(md, "| backend | renewals/s |\n|---|---:|");
        for (subject, rate) in &self.renew {
            let _ = writeln!(md, "| {} | {rate:.0} |", subject.slug());
        }

        let _ = writeln!(md, "\n## Batches (`acquire_many` / `renew_many`)\n");
        let _ = writeln!(
            md,
            "| backend | keys | native batch | acquire keys/s | renew keys/s | note |\n|---|---:|---|---:|---:|---|"
        );
        for b in &self.results.batches {
            let rate = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.0}"));
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                b.subject.slug(),
                b.size,
                if b.native { "yes" } else { "no (one by one)" },
                rate(b.acquire_keys_per_sec),
                rate(b.renew_keys_per_sec),
                b.note.as_deref().unwrap_or("")
            );
        }

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

        let _ = writeln!(md, "\n## Subjects\n");
        let _ = writeln!(md, "| subject | one cycle |\n|---|---|");
        let mut seen = Vec::new();
        for s in &self.results.sweep {
            if !seen.contains(&s.subject) {
                seen.push(s.subject);
                let _ = writeln!(md, "| {} | {} |", s.subject.slug(), s.subject.describe());
            }
        }

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
        md
    }

    /// One row per subject and concurrency level.
    pub fn csv(&self) -> String {
        let mut csv = String::from(CSV_HEADER);
        csv.push('\n');
        for s in &self.results.sweep {
            let (baseline, ratio) = self
                .ratio(s)
                .map_or((String::new(), String::new()), |(b, r)| {
                    (b.slug().to_owned(), format!("{r:.4}"))
                });
            let _ = writeln!(
                csv,
                "{},{},{},{},{},{:.4},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{},{}",
                s.subject.slug(),
                if s.subject.is_backend() {
                    "backend"
                } else {
                    "baseline"
                },
                s.subject.store().name(),
                s.concurrency,
                s.ops,
                s.elapsed.as_secs_f64(),
                s.ops_per_sec(),
                s.cycle_us(0.5),
                s.cycle_us(0.99),
                s.cycle_us(0.999),
                s.acquire_us(0.5),
                s.acquire_us(0.99),
                baseline,
                ratio
            );
        }
        csv
    }

    fn subjects(&self) -> Vec<SubjectId> {
        let mut subjects: Vec<SubjectId> = Vec::new();
        for s in &self.results.sweep {
            if !subjects.contains(&s.subject) {
                subjects.push(s.subject);
            }
        }
        subjects
    }
}

/// The section of the releases with a waiter on every key, if they were measured.
fn write_waited(md: &mut String, plan: &Plan, rows: &[WaitedReleases]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n## Releases with a waiter on every key\n\n\
         {} tasks run acquire + release cycles, each on a key of its own. In the *waited* \
         rounds every key has a waiter: a task blocked in `ReleaseWatch::released` on it \
         (the wake-up path of `Locker::lock`), so every release must be announced; in the \
         *unwaited* rounds the same cycles run on keys nobody watches. Rates are cycles/s \
         (one release each); the two alternate, {} rounds of {:?} after {:?} of warm-up, \
         order swapped every round, and the ratio is the median round's. The run fails \
         unless every waiter was woken by the waited rounds' releases; `wake-ups per \
         release` is below one where wake-ups of one key coalesce.\n",
        crate::waited::TASKS,
        plan.pair_rounds,
        plan.duration / 3,
        plan.warmup
    );
    let _ = writeln!(
        md,
        "CPU per cycle is this process's (the cycles, and on the waited side the listener \
         and the waiters' wake-ups) and the server's (every process of its tree), \
         warm-up included: what a cycle costs the machine, which a busy machine moves less \
         than it moves the rates.\n"
    );
    let _ = writeln!(
        md,
        "| backend | waited cycles/s | unwaited cycles/s | ratio (median) | per-round ratios | wake-ups per release | client CPU µs/cycle waited / unwaited | server CPU µs/cycle waited / unwaited |\n|---|---:|---:|---:|---|---:|---|---|"
    );
    let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for w in rows {
        let rounds: Vec<String> = w.ratios().iter().map(|r| format!("{r:.2}")).collect();
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.0} | {} | {} | {:.2} | {} / {} | {} / {} |",
            w.subject.slug(),
            w.waited.rate(),
            w.unwaited.rate(),
            w.ratio().map_or("-".into(), |r| format!("{r:.2}x")),
            rounds.join(" "),
            w.wakes_per_release(),
            us(w.waited.client()),
            us(w.unwaited.client()),
            us(w.waited.server()),
            us(w.unwaited.server()),
        );
    }
}

fn write_permits(md: &mut String, plan: &Plan, rows: &[PermitCycles]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n## Semaphore permits\n\n\
         N tasks share one semaphore of N permits; each takes a permit as \
         `Semaphore::try_acquire` does (`LockBackend::acquire_any` over its slots, from a \
         random one) and releases it. Every attempt gets a permit, but the slots it tries \
         first may be held: a backend that asks slot by slot pays a round trip for each, \
         one with a script of its own (Redis single node) none. Beside it, the same \
         backend's lock cycles on a key per task. The two alternate, {} rounds of {:?} \
         after {:?} of warm-up, order swapped every round; the ratio is the median \
         round's. CPU per cycle as above.\n",
        plan.pair_rounds,
        plan.duration / 3,
        plan.warmup
    );
    let _ = writeln!(
        md,
        "| backend | tasks = permits | permit cycles/s | lock cycles/s | ratio (median) | per-round ratios | client CPU µs/cycle permit / lock | server CPU µs/cycle permit / lock |\n|---|---:|---:|---:|---:|---|---|---|"
    );
    let us = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for p in rows {
        let rounds: Vec<String> = p.ratios().iter().map(|r| format!("{r:.2}")).collect();
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.0} | {} | {} | {} / {} | {} / {} |",
            p.subject.slug(),
            p.tasks,
            p.permit.rate(),
            p.lock.rate(),
            p.ratio().map_or("-".into(), |r| format!("{r:.2}x")),
            rounds.join(" "),
            us(p.permit.client()),
            us(p.lock.client()),
            us(p.permit.server()),
            us(p.lock.server()),
        );
    }
}

/// Writes a report into `dir` (created if needed): `report.md`, `capacity.csv`, and the
/// charts, one line per group; returns the paths written.
pub(crate) fn write_files(
    dir: &Path,
    markdown: String,
    csv: String,
    levels: &[usize],
    groups: &[(String, Vec<&Sample>)],
) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| output_err(dir, e))?;
    let mut written = Vec::new();
    for (name, text) in [("report.md", markdown), ("capacity.csv", csv)] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| output_err(&path, e))?;
        written.push(path);
    }
    written.extend(write_charts(dir, levels, groups)?);
    Ok(written)
}

/// Writes `throughput.svg` (cycles/s against concurrency) and the latency percentile
/// charts at the first and last of `levels`, one line per labelled group of samples.
fn write_charts(
    dir: &Path,
    levels: &[usize],
    groups: &[(String, Vec<&Sample>)],
) -> Result<Vec<PathBuf>, BenchError> {
    let mut written = Vec::new();
    let throughput = dir.join("throughput.svg");
    throughput_chart(&throughput, levels, groups)?;
    written.push(throughput);
    let mut charted = Vec::new();
    for level in [levels.first(), levels.last()]
        .into_iter()
        .flatten()
        .copied()
    {
        if charted.contains(&level) {
            continue;
        }
        charted.push(level);
        let path = dir.join(format!("latency_c{level}.svg"));
        latency_chart(&path, level, groups)?;
        written.push(path);
    }
    Ok(written)
}

/// Cycles/s against concurrency, one line per group, both axes logarithmic.
fn throughput_chart(
    path: &Path,
    levels: &[usize],
    groups: &[(String, Vec<&Sample>)],
) -> Result<(), BenchError> {
    let series: Vec<(String, Vec<(f64, f64)>)> = groups
        .iter()
        .map(|(label, samples)| {
            let points = samples
                .iter()
                .map(|s| (s.concurrency as f64, s.ops_per_sec().max(1.0)))
                .collect();
            (label.clone(), points)
        })
        .collect();
    let levels: Vec<f64> = levels.iter().map(|&l| l as f64).collect();
    line_chart(
        path,
        "Cycles per second by concurrency (acquire + release)",
        "concurrent tasks",
        "cycles/s",
        &series,
        &levels,
    )
}

/// Cycle latency at p50, p90, p99 and p99.9 for every group at `level` tasks.
fn latency_chart(
    path: &Path,
    level: usize,
    groups: &[(String, Vec<&Sample>)],
) -> Result<(), BenchError> {
    const QUANTILES: [f64; 4] = [0.5, 0.9, 0.99, 0.999];
    let series: Vec<(String, Vec<(f64, f64)>)> = groups
        .iter()
        .flat_map(|(label, samples)| {
            samples.iter().filter(|s| s.concurrency == level).map(|s| {
                let points = QUANTILES
                    .iter()
                    .enumerate()
                    .map(|(i, &q)| (i as f64, s.cycle_us(q).max(0.1)))
                    .collect();
                (label.clone(), points)
            })
        })
        .collect();
    line_chart(
        path,
        &format!("Cycle latency percentiles at {level} tasks (p50, p90, p99, p99.9)"),
        "percentile: 0 = p50, 1 = p90, 2 = p99, 3 = p99.9",
        "latency (µs)",
        &series,
        &[0.0, 1.0, 2.0, 3.0],
    )
}

/// Draws `series` as lines with points on a logarithmic y axis; the x axis is logarithmic
/// when every x is positive and spans more than one decade.
fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    xs: &[f64],
) -> Result<(), BenchError> {
    let err = |e: &dyn std::fmt::Display| output_err(path, e);
    let ys = series.iter().flat_map(|(_, p)| p.iter().map(|&(_, y)| y));
    let (y_min, y_max) = ys.fold((f64::MAX, f64::MIN), |(lo, hi), y| (lo.min(y), hi.max(y)));
    let (y_min, y_max) = if y_min <= y_max {
        (y_min / 2.0, y_max * 2.0)
    } else {
        (1.0, 10.0)
    };
    let x_min = xs.iter().copied().fold(f64::MAX, f64::min);
    let x_max = xs.iter().copied().fold(f64::MIN, f64::max);
    let (x_min, x_max) = if x_min < x_max {
        (x_min, x_max)
    } else {
        (x_min - 1.0, x_min + 1.0)
    };
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let log_x = x_min > 0.0 && x_max / x_min >= 10.0;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70);
    let palette = |i: usize| Palette99::pick(i).to_rgba();
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .draw()
                .map_err(|e| err(&e))?;
            for (i, (name, points)) in series.iter().enumerate() {
                let color = palette(i);
                chart
                    .draw_series(LineSeries::new(
                        points.iter().copied(),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| err(&e))?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    if log_x {
        draw!(
            builder
                .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())
                .map_err(|e| err(&e))?
        );
    } else {
        draw!(
            builder
                .build_cartesian_2d(x_min..x_max, (y_min..y_max).log_scale())
                .map_err(|e| err(&e))?
        );
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
