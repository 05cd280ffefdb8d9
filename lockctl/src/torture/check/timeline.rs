//! A violating lock's history, printed under the violations, so that what led to one is
//! read off the run instead of inferred: for each of the first [`KEYS_SHOWN`] locks with
//! a violation, at most [`EVENTS_SHOWN`] of its events, centred on its earliest
//! violation, in time order, each with the worker process that reported it and its
//! token; and among them the nemesis's actions on those workers (pauses, resumes, kills,
//! restarts) and the store's restarts.
//!
//! A process of the shown events that was killed after the last of them is shown killed
//! all the same, and one still paused when they begin with its pause: a window the
//! checker kept open to a death, or one a pause ate into, is explained by those.
//! Times are µs from the run's start; a grant is placed at its reply, a step at the
//! guard's check, a release at its call (the worker reports no time for its outcome).

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::Serialize;

use super::super::event::Event;
use super::super::fault::{Fault, FaultKind};
use super::super::workers::Record;
use super::{Property, Violation};

/// How many violating locks get their history printed.
pub const KEYS_SHOWN: usize = 3;

/// How many of a lock's events its history shows at most (the nemesis's actions among
/// them come on top).
pub const EVENTS_SHOWN: usize = 60;

/// One violating lock's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyHistory {
    /// The lock's index among the run's keys.
    pub key: u32,
    /// How many events the workers reported on the lock.
    pub events: usize,
    /// How many of them come before the shown ones, left out.
    pub skipped: usize,
    /// How many of them are shown.
    pub shown: usize,
    /// The shown events and the nemesis's actions among them, in time order.
    pub entries: Vec<Entry>,
}

/// Who an [`Entry`] is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum By {
    /// An event a worker reported.
    Worker,
    /// An action of the nemesis (or of the run's end, which kills a worker that does not
    /// stop in time).
    Nemesis,
}

/// One line of a history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// µs from the run's start.
    pub at_us: i64,
    pub by: By,
    /// The worker's place: the reporter, or the action's target; none for the store.
    pub worker: Option<u32>,
    /// Which of the processes started in that place.
    pub process: Option<u32>,
    pub token: Option<u64>,
    pub what: String,
    /// The violations the checker caught at this event.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub caught: Vec<Property>,
}

/// The histories of the first [`KEYS_SHOWN`] locks among `violations` (none when there
/// are none), from the run's `records` and `faults`; `origin` is the run's start on the
/// monotonic clock.
pub fn histories(
    records: &[Record],
    faults: &[Fault],
    violations: &[Violation],
    origin: u64,
) -> Vec<KeyHistory> {
    let mut keys: Vec<u32> = Vec::new();
    for v in violations {
        if !keys.contains(&v.key) {
            if keys.len() == KEYS_SHOWN {
                break;
            }
            keys.push(v.key);
        }
    }
    let mut faults: Vec<&Fault> = faults.iter().collect();
    // In the order done, not noted: a kill is noted once the process is reaped.
    faults.sort_by_key(|f| f.at);
    keys.into_iter()
        .map(|key| history(key, records, &faults, violations, origin))
        .collect()
}

/// When an event happened: a grant at its reply, a step at its check, a release at its
/// call.
fn time(event: &Event) -> u64 {
    match *event {
        Event::Grant { granted, .. } => granted,
        Event::Step { checked, .. } => checked,
        Event::Lost { at, .. } | Event::Error { at, .. } => at,
        Event::Releasing { invoked, .. } | Event::Release { invoked, .. } => invoked,
    }
}

fn history(
    key: u32,
    records: &[Record],
    faults: &[&Fault],
    violations: &[Violation],
    origin: u64,
) -> KeyHistory {
    let caught: Vec<(u64, Property)> = violations
        .iter()
        .filter(|v| v.key == key)
        .map(|v| (v.at, v.property))
        .collect();
    let mut events: Vec<&Record> = records
        .iter()
        .filter(|r| r.event.key() == Some(key))
        .collect();
    // Stable: a worker's events of one time (its Releasing and its Release) stay in the
    // order it reported them.
    events.sort_by_key(|r| time(&r.event));
    let first = caught.iter().map(|c| c.0).min().unwrap_or(0);
    let centre = events.partition_point(|r| time(&r.event) < first);
    let end = (centre.saturating_sub(EVENTS_SHOWN / 2) + EVENTS_SHOWN).min(events.len());
    let start = end.saturating_sub(EVENTS_SHOWN);
    let shown = &events[start..end];

    let (lo, hi) = match (shown.first(), shown.last()) {
        (Some(a), Some(b)) => (time(&a.event), time(&b.event)),
        _ => (first, first),
    };
    let processes: HashSet<(u32, u32)> = shown.iter().map(|r| (r.worker, r.incarnation)).collect();
    let places: HashSet<u32> = processes.iter().map(|p| p.0).collect();
    // The last action on each of their places before the shown events: a pause there
    // still holds when they begin, and is shown with them.
    let mut last_before: HashMap<u32, usize> = HashMap::new();
    for (i, f) in faults.iter().enumerate().take_while(|(_, f)| f.at < lo) {
        if let Some((worker, _)) = f.kind.process().filter(|p| places.contains(&p.0)) {
            last_before.insert(worker, i);
        }
    }
    let still_paused: HashSet<usize> = last_before
        .into_values()
        .filter(|&i| matches!(faults[i].kind, FaultKind::Pause { .. }))
        .collect();
    let kept = faults.iter().enumerate().filter_map(|(i, f)| {
        let keep = match (f.kind, f.kind.process()) {
            (FaultKind::StoreRestart { up }, _) => f.at <= hi && up >= lo,
            (kind, Some(process)) => {
                (places.contains(&process.0) && (lo..=hi).contains(&f.at))
                    || (kind.is_death() && processes.contains(&process))
                    || still_paused.contains(&i)
            }
            (_, None) => false,
        };
        keep.then_some(*f)
    });

    let mut entries: Vec<(u64, Entry)> = shown
        .iter()
        .map(|r| (time(&r.event), event_entry(r, &caught, origin)))
        .chain(kept.map(|f| (f.at, fault_entry(f, origin))))
        .collect();
    entries.sort_by_key(|e| e.0);
    KeyHistory {
        key,
        events: events.len(),
        skipped: start,
        shown: shown.len(),
        entries: entries.into_iter().map(|e| e.1).collect(),
    }
}

/// `at` in µs from `origin`.
fn micros(at: u64, origin: u64) -> i64 {
    ((i128::from(at) - i128::from(origin)) / 1000) as i64
}

/// µs with a sign and thousands separated, as `+1,203,456`.
fn signed(us: i64) -> String {
    let digits = us.unsigned_abs().to_string();
    let mut out = String::from(if us < 0 { "-" } else { "+" });
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(d);
    }
    out
}

fn event_entry(r: &Record, caught: &[(u64, Property)], origin: u64) -> Entry {
    let at = |t: u64| signed(micros(t, origin));
    let (token, what) = match r.event {
        Event::Grant {
            token,
            invoked,
            valid,
            ..
        } => (
            Some(token),
            format!("granted (asked at {}), valid to {}", at(invoked), at(valid)),
        ),
        Event::Step {
            token,
            valid,
            read,
            admitted,
            ..
        } => {
            let step = match (read, admitted) {
                (Some(read), true) => format!("wrote {}, admitted", read + 1),
                (Some(read), false) => format!("wrote {}, refused by the fence", read + 1),
                (None, _) => "step refused by the fence".to_owned(),
            };
            (
                Some(token),
                format!("{step} (held, valid to {})", at(valid)),
            )
        }
        Event::Lost { token, .. } => (Some(token), "told the lease is lost".to_owned()),
        Event::Releasing { token, .. } => (Some(token), "releasing".to_owned()),
        Event::Release {
            token, released, ..
        } => (
            Some(token),
            match released {
                Some(true) => "release: released",
                Some(false) => "release: not held by it (ran out)",
                None => "release: failed, the store may have carried it out",
            }
            .to_owned(),
        ),
        Event::Error { ref what, .. } => (None, format!("error: {what}")),
    };
    let t = time(&r.event);
    let is_check = matches!(r.event, Event::Grant { .. } | Event::Step { .. });
    Entry {
        at_us: micros(t, origin),
        by: By::Worker,
        worker: Some(r.worker),
        process: Some(r.incarnation),
        token,
        what,
        caught: caught
            .iter()
            .filter(|c| is_check && c.0 == t)
            .map(|c| c.1)
            .collect(),
    }
}

fn fault_entry(f: &Fault, origin: u64) -> Entry {
    let what = match f.kind {
        FaultKind::Pause { .. } => "paused (SIGSTOP)".to_owned(),
        FaultKind::Resume { .. } => "resumed (SIGCONT)".to_owned(),
        FaultKind::Kill { .. } => "killed (SIGKILL)".to_owned(),
        FaultKind::KillAtEnd { .. } => {
            "killed (SIGKILL) at the run's end: it did not stop in time".to_owned()
        }
        FaultKind::Restart { .. } => "started in the killed process's place".to_owned(),
        FaultKind::StoreRestart { up } => format!(
            "store killed (SIGKILL) and started again, up at {}",
            signed(micros(up, origin))
        ),
    };
    let process = f.kind.process();
    Entry {
        at_us: micros(f.at, origin),
        by: By::Nemesis,
        worker: process.map(|p| p.0),
        process: process.map(|p| p.1),
        token: None,
        what,
        caught: Vec::new(),
    }
}

impl Entry {
    fn who(&self) -> String {
        match (self.worker, self.process) {
            (Some(worker), Some(process)) => format!("worker {worker} process {process}"),
            _ => "store".to_owned(),
        }
    }

    fn token(&self) -> String {
        self.token
            .map_or_else(String::new, |t| format!("token {t}"))
    }
}

impl fmt::Display for KeyHistory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let which = if self.shown == self.events {
            format!("its {} events", self.events)
        } else {
            format!(
                "its events {} to {} of {}, around its first violation",
                self.skipped + 1,
                self.skipped + self.shown,
                self.events
            )
        };
        writeln!(
            f,
            "  history of lock {} ({which}, and the nemesis's actions on their workers; \
             µs from the run's start, a release at its call):",
            self.key
        )?;
        let width =
            |column: &dyn Fn(&Entry) -> usize| self.entries.iter().map(column).max().unwrap_or(0);
        let (time_w, who_w, token_w) = (
            width(&|e| signed(e.at_us).len()),
            width(&|e| e.who().len()),
            width(&|e| e.token().len()),
        );
        for e in &self.entries {
            let by = match e.by {
                By::Worker => "",
                By::Nemesis => "nemesis: ",
            };
            let caught: String = e.caught.iter().map(|p| format!("  <- {p}")).collect();
            writeln!(
                f,
                "    {:>time_w$}  {:<who_w$}  {:<token_w$}  {by}{}{caught}",
                signed(e.at_us),
                e.who(),
                e.token(),
                e.what,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
