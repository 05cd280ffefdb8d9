//! The torture run's checker: what the workers reported and what the ledger holds at the
//! end, against the properties a lock with fencing tokens promises.
//!
//! - **token order**: a grant that ended before another began has the lower token;
//!   no two grants of a lock share one;
//! - **overlap**: the validity windows of two grants of a lock never intersect (a window
//!   runs from the grant's reply to the end of the validity the library reported, cut
//!   short by the release, or by the holder's death: a killed process holds nothing, and
//!   a store that frees a dead session's locks at once, as PostgreSQL's advisory locks
//!   do, is right to). A paused holder is judged by its window too: the library counts
//!   validity on the monotonic clock, so a pause eats into it, and a holder that wakes
//!   past it must be told, not overlap;
//! - **stale write admitted**: taken in the order of the values they read, the ledger's
//!   admitted writes carry tokens that never go down;
//! - **lost update**: no two admitted writes read the same value (both would have
//!   written the same count, one of them lost); the ledger ends at least at the highest
//!   count an admitted write reported;
//! - **step after loss**: no step of a critical section began after a newer grant of its
//!   lock was made (the library said "held" when the lock was someone else's).

use std::collections::HashMap;
use std::fmt;

use serde::Serialize;

use super::event::Event;
use super::workers::Record;

pub mod timeline;

/// A property of [the list above](self) that the run broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Property {
    TokenOrder,
    Overlap,
    StaleWriteAdmitted,
    LostUpdate,
    StepAfterLoss,
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Property::TokenOrder => "token order",
            Property::Overlap => "overlap",
            Property::StaleWriteAdmitted => "stale write admitted",
            Property::LostUpdate => "lost update",
            Property::StepAfterLoss => "step after loss",
        })
    }
}

/// One broken property, where and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub property: Property,
    /// The lock's index among the run's keys.
    pub key: u32,
    pub detail: String,
    /// When (ns of the monotonic clock) the event it was caught at happened: the later
    /// grant, the step. The lock's printed history is centred on it; left out of the JSON
    /// report, whose times are the workers' (the printed history gives them from the
    /// run's start).
    #[serde(skip)]
    pub at: u64,
}

/// What the events say, counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    /// Locks granted.
    pub grants: u64,
    /// Critical sections that ended with a release the store confirmed.
    pub sections: u64,
    /// Fenced writes the ledger admitted.
    pub writes_admitted: u64,
    /// Fenced steps the ledger refused (a holder that had lost its lock, stopped by the
    /// fence: fencing at work, not a violation).
    pub writes_refused: u64,
    /// Leases whose holder was told it lost them, before a step.
    pub losses_noticed: u64,
    /// Releases the store answered "not held by you" (the lease had run out).
    pub releases_not_held: u64,
    /// Calls that failed (timeouts, the store unreachable).
    pub errors: u64,
}

/// One grant as the checker sees it.
#[derive(Clone, Debug)]
struct Grant {
    who: (u32, u32),
    token: u64,
    invoked: u64,
    granted: u64,
    /// The end of its validity window.
    end: u64,
}

/// When each killed worker process died: (worker, incarnation) and the time.
pub type Deaths = HashMap<(u32, u32), u64>;

/// Checks a run's `records`, the deaths of the processes it killed and the ledger's
/// final values (`finals[key]`, `None` for an entry never written); returns the counts
/// and every violation found.
pub fn check(
    records: &[Record],
    deaths: &Deaths,
    finals: &[Option<u64>],
) -> (Tally, Vec<Violation>) {
    let mut tally = Tally::default();
    let mut per_key: HashMap<u32, Vec<&Record>> = HashMap::new();
    for record in records {
        count(&mut tally, &record.event);
        if let Some(key) = record.event.key() {
            per_key.entry(key).or_default().push(record);
        }
    }
    let mut violations = Vec::new();
    let mut keys: Vec<u32> = per_key.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let events = &per_key[&key];
        let grants = grants(events, deaths);
        check_tokens(key, &grants, &mut violations);
        check_windows(key, &grants, &mut violations);
        check_steps(key, events, &grants, &mut violations);
        let last = finals.get(key as usize).copied().flatten();
        check_ledger(key, events, last, &mut violations);
    }
    (tally, violations)
}

fn count(tally: &mut Tally, event: &Event) {
    match event {
        Event::Grant { .. } => tally.grants += 1,
        Event::Step { admitted: true, .. } => tally.writes_admitted += 1,
        Event::Step { .. } => tally.writes_refused += 1,
        Event::Lost { .. } => tally.losses_noticed += 1,
        Event::Release {
            released: Some(true),
            ..
        } => tally.sections += 1,
        Event::Release {
            released: Some(false),
            ..
        } => tally.releases_not_held += 1,
        // Counted with its error.
        Event::Release { released: None, .. } => {}
        // Counted with its outcome.
        Event::Releasing { .. } => {}
        Event::Error { .. } => tally.errors += 1,
    }
}

/// The grants of one lock, in the order of their replies, each with its window's end.
fn grants(events: &[&Record], deaths: &Deaths) -> Vec<Grant> {
    let lease = |r: &Record, token: u64| (r.worker, r.incarnation, token);
    // The latest validity each lease reported, and its first release.
    let mut valid: HashMap<(u32, u32, u64), u64> = HashMap::new();
    let mut released: HashMap<(u32, u32, u64), u64> = HashMap::new();
    for r in events {
        match r.event {
            Event::Step {
                token, valid: v, ..
            }
            | Event::Grant {
                token, valid: v, ..
            } => {
                let e = valid.entry(lease(r, token)).or_insert(v);
                *e = (*e).max(v);
            }
            Event::Releasing { token, invoked, .. } | Event::Release { token, invoked, .. } => {
                let e = released.entry(lease(r, token)).or_insert(invoked);
                *e = (*e).min(invoked);
            }
            _ => {}
        }
    }
    let mut grants: Vec<Grant> = events
        .iter()
        .filter_map(|r| match r.event {
            Event::Grant {
                token,
                invoked,
                granted,
                ..
            } => {
                let id = lease(r, token);
                let mut end = valid.get(&id).copied().unwrap_or(granted);
                if let Some(&died) = deaths.get(&(r.worker, r.incarnation)) {
                    end = end.min(died);
                }
                Some(Grant {
                    who: (r.worker, r.incarnation),
                    token,
                    invoked,
                    granted,
                    end: released.get(&id).map_or(end, |&at| at.min(end)),
                })
            }
            _ => None,
        })
        .collect();
    grants.sort_by_key(|g| g.granted);
    grants
}

/// For each grant in reply order, the grant with the highest token among it and those
/// before it.
fn running_max(grants: &[Grant]) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(grants.len());
    for (i, g) in grants.iter().enumerate() {
        let prev = best.last().copied();
        best.push(match prev {
            Some(p) if grants[p].token >= g.token => p,
            _ => i,
        });
    }
    best
}

/// The grant with the highest token among those whose reply came before `at`.
fn highest_before<'a>(grants: &'a [Grant], best: &[usize], at: u64) -> Option<&'a Grant> {
    let before = grants.partition_point(|g| g.granted < at);
    before.checked_sub(1).map(|i| &grants[best[i]])
}

fn describe(g: &Grant) -> String {
    format!(
        "token {} (worker {} process {}, granted at {} ns)",
        g.token, g.who.0, g.who.1, g.granted
    )
}

fn check_tokens(key: u32, grants: &[Grant], out: &mut Vec<Violation>) {
    let best = running_max(grants);
    let mut seen: HashMap<u64, &Grant> = HashMap::new();
    for g in grants {
        if let Some(first) = seen.insert(g.token, g) {
            out.push(Violation {
                property: Property::TokenOrder,
                key,
                detail: format!(
                    "two grants share a token: {} and {}",
                    describe(first),
                    describe(g)
                ),
                at: g.granted,
            });
        }
        if let Some(earlier) = highest_before(grants, &best, g.invoked)
            && earlier.token >= g.token
        {
            out.push(Violation {
                property: Property::TokenOrder,
                key,
                detail: format!(
                    "{} was granted before {} was asked for, yet has a token not below it",
                    describe(earlier),
                    describe(g)
                ),
                at: g.granted,
            });
        }
    }
}

fn check_windows(key: u32, grants: &[Grant], out: &mut Vec<Violation>) {
    let mut open: Option<&Grant> = None;
    // A grant whose reply came after its validity ended (its holder was stopped while
    // the call was on its way) has an empty window: the library reports it as not held.
    for g in grants.iter().filter(|g| g.end > g.granted) {
        if let Some(a) = open
            && g.granted < a.end
        {
            out.push(Violation {
                property: Property::Overlap,
                key,
                detail: format!(
                    "{} was granted {} µs before the validity of {} ended",
                    describe(g),
                    (a.end - g.granted) / 1000,
                    describe(a)
                ),
                at: g.granted,
            });
        }
        if open.is_none_or(|a| g.end > a.end) {
            open = Some(g);
        }
    }
}

fn check_steps(key: u32, events: &[&Record], grants: &[Grant], out: &mut Vec<Violation>) {
    let best = running_max(grants);
    for r in events {
        let Event::Step { token, checked, .. } = r.event else {
            continue;
        };
        if let Some(newer) = highest_before(grants, &best, checked)
            && newer.token > token
        {
            out.push(Violation {
                property: Property::StepAfterLoss,
                key,
                detail: format!(
                    "worker {} process {} took a step with token {token} at {checked} ns, after {} was granted",
                    r.worker,
                    r.incarnation,
                    describe(newer)
                ),
                at: checked,
            });
        }
    }
}

fn check_ledger(key: u32, events: &[&Record], last: Option<u64>, out: &mut Vec<Violation>) {
    // (read, token, who, checked): in the order of the values read.
    let mut admitted: Vec<(u64, u64, (u32, u32), u64)> = events
        .iter()
        .filter_map(|r| match r.event {
            Event::Step {
                read: Some(read),
                admitted: true,
                token,
                checked,
                ..
            } => Some((read, token, (r.worker, r.incarnation), checked)),
            _ => None,
        })
        .collect();
    admitted.sort_unstable();
    for pair in admitted.windows(2) {
        let ((read_a, token_a, who_a, _), (read_b, token_b, who_b, at)) = (pair[0], pair[1]);
        if read_a == read_b {
            out.push(Violation {
                property: Property::LostUpdate,
                key,
                detail: format!(
                    "two admitted writes read {read_a}: token {token_a} (worker {} process {}) \
                     and token {token_b} (worker {} process {})",
                    who_a.0, who_a.1, who_b.0, who_b.1
                ),
                at,
            });
        } else if token_b < token_a {
            out.push(Violation {
                property: Property::StaleWriteAdmitted,
                key,
                detail: format!(
                    "the write of count {} with token {token_b} was admitted after the write \
                     of count {} with token {token_a}",
                    read_b + 1,
                    read_a + 1
                ),
                at,
            });
        }
    }
    if let Some(&(read, token, _, at)) = admitted.last()
        && last.unwrap_or(0) < read + 1
    {
        out.push(Violation {
            property: Property::LostUpdate,
            key,
            detail: format!(
                "the ledger ends at {}, below the count {} that token {token} wrote",
                last.unwrap_or(0),
                read + 1
            ),
            at,
        });
    }
}

#[cfg(test)]
mod tests;
