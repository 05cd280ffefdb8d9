//! The checker: reads a history's events after the fact and reports every [`Violation`]
//! of the invariants I1–I6, which the [module root](super) states.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use distlock_core::{DRIFT_FACTOR, FencingToken, LockKey, OwnerId};
use tokio::time::Instant;

use super::event::{Event, History, Op, Reply};

/// One of the design's invariants.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum Invariant {
    /// Tokens unique and strictly increasing in real-time grant order, per key.
    I1,
    /// The fenced resource admits non-decreasing tokens only; no update is lost.
    I2,
    /// Validity windows of different grants never overlap.
    I3,
    /// A lost lease's release/renewal fails and leaves the holder untouched.
    I4,
    /// Renewal extends, keeps the token, never resurrects.
    I5,
    /// A semaphore's permits: never more validity windows of its grants at once than it
    /// has permits.
    I6,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A broken invariant, with the events that show it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Violation {
    /// The invariant.
    pub invariant: Invariant,
    /// What the events show.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.invariant, self.message)
    }
}

/// How a history is judged.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Faults were injected (cut links, paused or restarted servers, lost replies): the
    /// timing invariants (I3, the "holder untouched" half of I4, and the resurrection
    /// bound of I5) are not checked, because a lost reply may have extended a lease the
    /// client never heard about. Token and fencing invariants are always checked.
    pub faults: bool,
    /// How long past a lease's TTL (counted from the completion of its last successful
    /// grant or renewal) the store is allowed to still consider it held, for I5's
    /// resurrection check: covers the store's expiry lag.
    pub expiry_slack: Duration,
    /// The semaphores the run used, whose permits I6 counts.
    pub semaphores: Vec<SemaphoreSpec>,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            faults: false,
            expiry_slack: Duration::from_millis(100),
            semaphores: Vec::new(),
        }
    }
}

/// A semaphore I6 checks: every key under `<name>:permit:` is one of its permits, and at
/// most `permits` of them may be held at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SemaphoreSpec {
    /// The semaphore's name.
    pub name: LockKey,
    /// How many permits it has.
    pub permits: u32,
}

/// Everything the checker derives about one grant.
struct Grant<'a> {
    event: &'a Event,
    owner: OwnerId,
    token: FencingToken,
    /// The successful extensions in completion order: (invoked, completed, valid_until).
    extensions: Vec<(Instant, Instant, Instant)>,
    /// The invocation of the first release of this lease, if any.
    released_at: Option<Instant>,
}

impl Grant<'_> {
    /// The end of the client validity window: the latest extension, cut short by release.
    fn window_end(&self) -> Instant {
        let valid = self
            .extensions
            .iter()
            .map(|e| e.2)
            .max()
            .unwrap_or(self.event.completed);
        self.released_at.map_or(valid, |r| r.min(valid))
    }

    /// The validity the client had been told of before `at` (grant and renewals that
    /// completed by then).
    fn validity_known_at(&self, at: Instant) -> Option<(Instant, bool)> {
        self.extensions
            .iter()
            .enumerate()
            .filter(|(_, e)| e.1 <= at)
            .max_by_key(|(_, e)| e.2)
            .map(|(i, e)| (e.2, i > 0))
    }
}

impl History {
    /// Checks every invariant of the [settled](Self::settled) history; see [`check`].
    pub fn check(&self, options: &CheckOptions) -> Vec<Violation> {
        check(&self.settled(), options)
    }
}

/// Checks a history against I1–I6 and returns every violation found (empty when clean).
pub fn check(events: &[Event], options: &CheckOptions) -> Vec<Violation> {
    let mut violations = Vec::new();
    let mut by_key: HashMap<&LockKey, Vec<&Event>> = HashMap::new();
    for event in events {
        by_key.entry(&event.key).or_default().push(event);
    }
    let mut keys: Vec<_> = by_key.keys().copied().collect();
    keys.sort();
    for key in keys {
        check_key(&by_key[key], options, &mut violations);
    }
    if !options.faults {
        for semaphore in &options.semaphores {
            check_permits(&by_key, semaphore, &mut violations);
        }
    }
    violations
}

/// I6: at no instant do more grants of a semaphore's permit slots hold their validity
/// windows than the semaphore has permits.
fn check_permits(
    by_key: &HashMap<&LockKey, Vec<&Event>>,
    semaphore: &SemaphoreSpec,
    out: &mut Vec<Violation>,
) {
    let slots = format!("{}:permit:", semaphore.name);
    let mut grants = Vec::new();
    for (key, events) in by_key {
        if key.as_str().starts_with(&slots) {
            grants.extend(grants_of(events).0);
        }
    }
    // Window ends sort before starts at the same instant: a permit handed on at one
    // instant is not two permits.
    let mut edges: Vec<(Instant, i32, &Event)> = Vec::new();
    for g in &grants {
        let (start, end) = (g.event.completed, g.window_end());
        if start < end {
            edges.push((start, 1, g.event));
            edges.push((end, -1, g.event));
        }
    }
    edges.sort_by_key(|(at, step, _)| (*at, *step));
    let mut held: Vec<&Event> = Vec::new();
    for (_, step, event) in edges {
        if step < 0 {
            held.retain(|e| e.seq != event.seq);
            continue;
        }
        held.push(event);
        if held.len() > semaphore.permits as usize {
            let listed: Vec<String> = held.iter().map(|e| e.to_string()).collect();
            violation(
                out,
                Invariant::I6,
                format!(
                    "{} permits of {:?} (which has {}) were held at once: {}",
                    held.len(),
                    semaphore.name.as_str(),
                    semaphore.permits,
                    listed.join(", ")
                ),
            );
            return;
        }
    }
}

fn violation(violations: &mut Vec<Violation>, invariant: Invariant, message: String) {
    violations.push(Violation { invariant, message });
}

/// The grants among one key's events, in completion order, with their renewals and
/// first release; and each grant's place by lease id.
fn grants_of<'a>(
    events: &[&'a Event],
) -> (Vec<Grant<'a>>, HashMap<(OwnerId, FencingToken), usize>) {
    let mut grants: Vec<Grant<'a>> = events
        .iter()
        .filter(|e| e.op == Op::Acquire && e.reply == Reply::Granted)
        .filter_map(|e| {
            Some(Grant {
                event: e,
                owner: e.owner?,
                token: e.token?,
                extensions: e
                    .valid_until
                    .map(|v| (e.invoked, e.completed, v))
                    .into_iter()
                    .collect(),
                released_at: None,
            })
        })
        .collect();
    grants.sort_by_key(|g| (g.event.completed, g.event.seq));
    let index: HashMap<(OwnerId, FencingToken), usize> = grants
        .iter()
        .enumerate()
        .map(|(i, g)| ((g.owner, g.token), i))
        .collect();
    for event in events {
        let Some(&i) = event.lease_id().and_then(|id| index.get(&id)) else {
            continue;
        };
        match (event.op, &event.reply) {
            (Op::Renew, Reply::Renewed) => {
                if let Some(v) = event.valid_until {
                    grants[i]
                        .extensions
                        .push((event.invoked, event.completed, v));
                }
            }
            (Op::Release, _) => {
                let r = &mut grants[i].released_at;
                *r = Some(r.map_or(event.invoked, |at| at.min(event.invoked)));
            }
            _ => {}
        }
    }
    for g in &mut grants {
        g.extensions.sort_by_key(|e| e.1);
    }
    (grants, index)
}

fn check_key(events: &[&Event], options: &CheckOptions, out: &mut Vec<Violation>) {
    let (grants, index) = grants_of(events);
    check_tokens(&grants, out);
    check_writes(events, out);
    check_validity_bounds(events, out);
    if !options.faults {
        check_windows(&grants, out);
    }
    check_lost_leases(events, &grants, &index, options, out);
}

/// I1: unique tokens, increasing in real-time order.
fn check_tokens(grants: &[Grant<'_>], out: &mut Vec<Violation>) {
    let mut seen: HashMap<FencingToken, &Event> = HashMap::new();
    for g in grants {
        if let Some(first) = seen.insert(g.token, g.event) {
            violation(
                out,
                Invariant::I1,
                format!(
                    "token {} was granted twice on {:?}: {first} and {}",
                    g.token,
                    g.event.key.as_str(),
                    g.event
                ),
            );
        }
    }
    for a in grants {
        for b in grants {
            if a.event.completed < b.event.invoked && a.token > b.token {
                violation(
                    out,
                    Invariant::I1,
                    format!(
                        "token went down: {} completed before {} was invoked",
                        a.event, b.event
                    ),
                );
            }
        }
    }
}

/// I2: admitted tokens never go down, and no admitted read-modify-write lost an update.
fn check_writes(events: &[&Event], out: &mut Vec<Violation>) {
    let mut writes: Vec<&&Event> = events.iter().filter(|e| e.op == Op::Write).collect();
    writes.sort_by_key(|e| e.seq);
    let mut highest: Option<FencingToken> = None;
    let mut last_written: Option<(u64, &Event)> = None;
    for w in writes {
        let Some(token) = w.token else { continue };
        match w.reply {
            Reply::Admitted { read, wrote } => {
                if let Some(h) = highest.filter(|h| token < *h) {
                    violation(
                        out,
                        Invariant::I2,
                        format!("the resource admitted token {token} after token {h}: {w}"),
                    );
                }
                if let Some((value, prev)) = last_written
                    && read != value
                {
                    violation(
                        out,
                        Invariant::I2,
                        format!(
                            "lost update: {w} read {read}, but the previous admitted write {prev} had written {value}"
                        ),
                    );
                }
                last_written = Some((wrote, w));
                highest = Some(highest.map_or(token, |h| h.max(token)));
            }
            Reply::Rejected { latest } if highest.is_none_or(|h| token >= h) => {
                violation(
                    out,
                    Invariant::I2,
                    format!(
                        "the resource rejected token {token} (said latest {latest}) although no higher token was admitted: {w}"
                    ),
                );
            }
            _ => {}
        }
    }
}

/// I3 (bound half): a grant or renewal never claims validity past its reply + TTL.
///
/// A backend counts validity from its own send instant, which the history cannot see: it
/// lies anywhere between the invocation and the reply (after a wait for a pooled
/// connection, behind a coalesced batch in flight, or after one request per key held in
/// `acquire_any`), so the reply is the only bound a correct backend never exceeds, on any
/// machine load. Counting from the reply instead of the send instant is a bug only a known
/// delay on the wire shows: `validity_counts_from_the_send_instant` catches it.
fn check_validity_bounds(events: &[&Event], out: &mut Vec<Violation>) {
    for e in events {
        if let (Some(valid), Some(ttl)) = (e.valid_until, e.ttl)
            && valid > e.completed + ttl
        {
            violation(
                out,
                Invariant::I3,
                format!(
                    "{e} claims validity {:?} past its reply plus the TTL {ttl:?}",
                    valid - (e.completed + ttl)
                ),
            );
        }
    }
}

/// I3: client validity windows of different grants never overlap.
fn check_windows(grants: &[Grant<'_>], out: &mut Vec<Violation>) {
    for (i, a) in grants.iter().enumerate() {
        for b in &grants[i + 1..] {
            let (a_start, a_end) = (a.event.completed, a.window_end());
            let (b_start, b_end) = (b.event.completed, b.window_end());
            if a_start < a_end && b_start < b_end && a_start < b_end && b_start < a_end {
                let overlap = a_end.min(b_end) - a_start.max(b_start);
                violation(
                    out,
                    Invariant::I3,
                    format!(
                        "validity windows overlap by {overlap:?}: {} and {}",
                        a.event, b.event
                    ),
                );
            }
        }
    }
}

/// I4 and I5 on renew, release and fence calls.
fn check_lost_leases(
    events: &[&Event],
    grants: &[Grant<'_>],
    index: &HashMap<(OwnerId, FencingToken), usize>,
    options: &CheckOptions,
    out: &mut Vec<Violation>,
) {
    for e in events {
        if !matches!(e.op, Op::Renew | Op::Release | Op::Fence) {
            continue;
        }
        let succeeded = matches!(e.reply, Reply::Renewed | Reply::Released | Reply::Current);
        let Some(id) = e.lease_id() else { continue };
        let Some(&i) = index.get(&id) else {
            if succeeded {
                violation(
                    out,
                    Invariant::I4,
                    format!("{e} succeeded for a lease nobody was granted (wrong owner or token)"),
                );
            }
            continue;
        };
        let g = &grants[i];
        // A later grant of the key, completed before this call was made: the lease was lost.
        if succeeded
            && let Some(newer) = grants
                .iter()
                .find(|n| n.token > g.token && n.event.completed < e.invoked)
        {
            violation(
                out,
                Invariant::I4,
                format!(
                    "{e} succeeded on a lost lease: {} had already been granted",
                    newer.event
                ),
            );
        }
        // A release that came first ended the lease for good.
        if succeeded
            && e.op != Op::Release
            && let Some(released) = events.iter().find(|r| {
                r.op == Op::Release
                    && r.reply == Reply::Released
                    && r.lease_id() == Some(id)
                    && r.completed < e.invoked
            })
        {
            violation(
                out,
                Invariant::I5,
                format!("{e} succeeded after the lease was released by {released}"),
            );
        }
        if options.faults {
            continue;
        }
        // I5: no renewal brings back a lease the store must have expired.
        if e.op == Op::Renew && e.reply == Reply::Renewed {
            let last = g
                .extensions
                .iter()
                .filter(|x| x.1 <= e.invoked)
                .map(|x| x.1)
                .max();
            let ttl = e.ttl.or(g.event.ttl).unwrap_or_default();
            let expired_by =
                last.map(|l| l + ttl.mul_f64(1.0 + DRIFT_FACTOR) + options.expiry_slack);
            if let Some(expired_by) = expired_by
                && e.invoked > expired_by
            {
                violation(
                    out,
                    Invariant::I5,
                    format!(
                        "{e} resurrected an expired lease: it was invoked {:?} after the lease's TTL ran out",
                        e.invoked - expired_by + options.expiry_slack
                    ),
                );
            }
            let granted_valid = g.event.valid_until;
            if let (Some(v), Some(gv)) = (e.valid_until, granted_valid)
                && e.invoked >= g.event.completed
                && v < gv
            {
                violation(
                    out,
                    Invariant::I5,
                    format!(
                        "{e} shortened the validity the grant had given instead of extending it"
                    ),
                );
            }
        }
        // I4/I5: while its window lasts, the holder's renewals and fence checks succeed.
        if matches!(e.op, Op::Renew | Op::Fence)
            && !succeeded
            && !matches!(e.reply, Reply::Error(_))
            && g.released_at.is_none_or(|r| e.completed < r)
            && let Some((valid, renewed)) = g.validity_known_at(e.invoked)
            && e.completed < valid
        {
            let (invariant, why) = if renewed {
                (
                    Invariant::I5,
                    "after a renewal extended it (the renewal did not keep the lease or its token)",
                )
            } else {
                (
                    Invariant::I4,
                    "while its holder was inside its validity window (the holder was disturbed)",
                )
            };
            violation(out, invariant, format!("{e} failed {why}"));
        }
    }
}

#[cfg(test)]
mod tests;
