//! The record of a case run: one [`Event`] per call, kept in order in a [`History`].

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use distlock_core::{FencingToken, LockKey, OwnerId};
use parking_lot::Mutex;
use tokio::time::Instant;

/// The kind of call an [`Event`] records.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Op {
    /// `acquire` (or one key of `acquire_many`).
    Acquire,
    /// `renew` (or one lease of `renew_many`).
    Renew,
    /// `release` (or one lease of `release_many`).
    Release,
    /// `fence`.
    Fence,
    /// A read-modify-write through a [`FencedCounter`](super::FencedCounter).
    Write,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Acquire => "acquire",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Fence => "fence",
            Self::Write => "write",
        })
    }
}

/// What a recorded call returned.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Reply {
    /// `acquire` granted a lease (its token, owner and validity are in the event).
    Granted,
    /// `acquire` found the key held.
    Busy,
    /// `renew` extended the lease (the new validity is in the event).
    Renewed,
    /// `renew` said the lease is lost.
    Lost,
    /// `release` freed the key.
    Released,
    /// `release` said the lease was not held.
    NotHeld,
    /// `fence` said the lease is current.
    Current,
    /// `fence` said the lease is stale.
    Stale {
        /// The key's newest token, as the store reported it.
        current: FencingToken,
    },
    /// The fenced resource admitted a read-modify-write.
    Admitted {
        /// The value read before the write.
        read: u64,
        /// The value written.
        wrote: u64,
    },
    /// The fenced resource rejected a write as stale.
    Rejected {
        /// The highest token the resource had admitted.
        latest: FencingToken,
    },
    /// The call failed; the text is the error.
    Error(String),
    /// The call had not returned when the history was checked: a release spawned when a
    /// guard was dropped, say, which the store may already have carried out.
    Unfinished,
}

/// One recorded call.
#[derive(Clone, Debug)]
pub struct Event {
    /// Position in completion order (for writes: admission order), from 0.
    pub seq: u64,
    /// The call.
    pub op: Op,
    /// The key (for writes: the key that guards the resource).
    pub key: LockKey,
    /// The lease's owner (for acquire: the granted owner, if any).
    pub owner: Option<OwnerId>,
    /// The lease's token (for acquire: the granted token, if any).
    pub token: Option<FencingToken>,
    /// The TTL asked for or held.
    pub ttl: Option<Duration>,
    /// When the call was made.
    pub invoked: Instant,
    /// When the reply arrived.
    pub completed: Instant,
    /// The end of the client validity window a grant or renewal gave.
    pub valid_until: Option<Instant>,
    /// What the call returned.
    pub reply: Reply,
}

impl Event {
    /// The lease the event is about: its owner and token, when it names both.
    pub(super) fn lease_id(&self) -> Option<(OwnerId, FencingToken)> {
        Some((self.owner?, self.token?))
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {} {:?}", self.seq, self.op, self.key.as_str())?;
        if let Some(token) = self.token {
            write!(f, " token {token}")?;
        }
        if let Some(owner) = self.owner {
            write!(f, " owner {owner}")?;
        }
        write!(f, " -> {:?}", self.reply)
    }
}

/// A thread-safe recorder of [`Event`]s. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct History {
    events: Mutex<Vec<Event>>,
    /// Releases made and not yet returned, by call number: checked as [`Reply::Unfinished`].
    unfinished: Mutex<HashMap<u64, Draft>>,
    calls: AtomicU64,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

/// The fields of an event before it is numbered.
#[derive(Clone, Debug)]
pub(super) struct Draft {
    pub(super) op: Op,
    pub(super) key: LockKey,
    pub(super) owner: Option<OwnerId>,
    pub(super) token: Option<FencingToken>,
    pub(super) ttl: Option<Duration>,
    pub(super) invoked: Instant,
    pub(super) valid_until: Option<Instant>,
    pub(super) reply: Reply,
}

impl Draft {
    fn into_event(self, seq: u64, completed: Instant) -> Event {
        Event {
            seq,
            op: self.op,
            key: self.key,
            owner: self.owner,
            token: self.token,
            ttl: self.ttl,
            invoked: self.invoked,
            completed,
            valid_until: self.valid_until,
            reply: self.reply,
        }
    }
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self {
            events: Mutex::new(Vec::new()),
            unfinished: Mutex::new(HashMap::new()),
            calls: AtomicU64::new(0),
        }
    }

    /// Appends an event; `seq` is assigned here, in the order events are recorded.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        op: Op,
        key: &LockKey,
        owner: Option<OwnerId>,
        token: Option<FencingToken>,
        ttl: Option<Duration>,
        invoked: Instant,
        valid_until: Option<Instant>,
        reply: Reply,
    ) {
        self.push(Draft {
            op,
            key: key.clone(),
            owner,
            token,
            ttl,
            invoked,
            valid_until,
            reply,
        });
    }

    pub(super) fn push(&self, draft: Draft) {
        let completed = Instant::now();
        let mut events = self.events.lock();
        let seq = events.len() as u64;
        events.push(draft.into_event(seq, completed));
    }

    /// Notes a call made and not yet returned (its draft's reply is ignored); until
    /// [`Self::returned`] it is checked as [`Reply::Unfinished`], and for good when its
    /// future is dropped: the store may have carried it out all the same.
    pub(super) fn made(&self, draft: Draft) -> u64 {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        self.unfinished.lock().insert(call, draft);
        call
    }

    /// The call [`Self::made`] returned `call` for has returned `reply`: it is recorded
    /// and leaves the unfinished calls in one step, under their lock, so that
    /// [`Self::settled`] finds it exactly once, finished or not.
    pub(super) fn returned(&self, call: u64, reply: Reply) {
        let mut unfinished = self.unfinished.lock();
        if let Some(draft) = unfinished.remove(&call) {
            self.push(Draft { reply, ..draft });
        }
    }

    /// A copy of every event so far, in recording order.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().clone()
    }

    /// Every event, and every call made and not yet returned (a release spawned by a
    /// dropped guard) as [`Reply::Unfinished`] completed now: what [`Self::check`] checks.
    pub fn settled(&self) -> Vec<Event> {
        // The events are copied under the unfinished calls' lock: a call that returns
        // meanwhile is then in one copy, never in both and never in neither.
        let unfinished = self.unfinished.lock();
        let mut events = self.events();
        let now = Instant::now();
        let unfinished: Vec<Draft> = unfinished.values().cloned().collect();
        for draft in unfinished {
            let seq = events.len() as u64;
            events.push(
                Draft {
                    reply: Reply::Unfinished,
                    ..draft
                }
                .into_event(seq, now),
            );
        }
        events
    }

    /// How many events were recorded.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The events on `key` that granted a lease, in completion order.
    pub fn grants(&self, key: &LockKey) -> Vec<Event> {
        self.events
            .lock()
            .iter()
            .filter(|e| e.op == Op::Acquire && e.reply == Reply::Granted && &e.key == key)
            .cloned()
            .collect()
    }
}

/// `events`, one per line in their order, with their times in µs from the first
/// invocation: what a failed check prints, so that the order the client saw can be read
/// against what the store did. At most `limit` lines; the rest are counted.
pub fn timeline(events: &[Event], limit: usize) -> String {
    let Some(start) = events.iter().map(|e| e.invoked).min() else {
        return "    (no events)".to_owned();
    };
    let at = |t: Instant| t.saturating_duration_since(start).as_secs_f64() * 1e6;
    let mut out: Vec<String> = events
        .iter()
        .take(limit)
        .map(|e| {
            let valid = e
                .valid_until
                .map(|v| format!(" valid until {:.1}", at(v)))
                .unwrap_or_default();
            format!(
                "    [{:.1} .. {:.1} µs] {e}{valid}",
                at(e.invoked),
                at(e.completed)
            )
        })
        .collect();
    if events.len() > limit {
        out.push(format!("    ... and {} more", events.len() - limit));
    }
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_returning_while_the_history_settles_is_in_it_exactly_once() {
        // One thread makes releases and lets each return before the next; the other
        // settles the history meanwhile, over and over. A release made before a settle
        // began is in it once: as its reply if it returned, as Unfinished if not. Were it
        // in neither, the check would see its lease held to its end and the key's next
        // grant overlap it; were it in both, a release would count twice.
        const ROUNDS: u64 = 1_000;
        const RELEASES: u64 = 64;
        let key = LockKey::new("k").unwrap();
        let owner = OwnerId::random();
        let mut settles = 0_u64;
        for _ in 0..ROUNDS {
            let history = History::new();
            let made = AtomicU64::new(0);
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    for i in 0..RELEASES {
                        let call = history.made(Draft {
                            op: Op::Release,
                            key: key.clone(),
                            owner: Some(owner),
                            token: Some(FencingToken(i)),
                            ttl: None,
                            invoked: Instant::now(),
                            valid_until: None,
                            reply: Reply::Unfinished,
                        });
                        made.store(i + 1, Ordering::Release);
                        history.returned(call, Reply::Released);
                    }
                });
                loop {
                    let made_before = made.load(Ordering::Acquire);
                    let settled = history.settled();
                    settles += 1;
                    let mut times = [0_usize; RELEASES as usize];
                    for event in &settled {
                        times[event.token.unwrap().0 as usize] += 1;
                    }
                    for (i, &n) in times.iter().enumerate().take(made_before as usize) {
                        assert_eq!(
                            n,
                            1,
                            "release {i} of {made_before} made is in the settled history \
                             {n} times (settle {settles}):\n{}",
                            timeline(&settled, 100)
                        );
                    }
                    if made_before == RELEASES {
                        break;
                    }
                }
            });
        }
    }

    #[test]
    fn the_timeline_lists_every_event_with_its_times_unfinished_calls_too() {
        let history = History::new();
        let key = LockKey::new("k").unwrap();
        let owner = OwnerId::random();
        let start = Instant::now();
        history.record(
            Op::Acquire,
            &key,
            Some(owner),
            Some(FencingToken(7)),
            Some(Duration::from_secs(1)),
            start,
            Some(start + Duration::from_secs(1)),
            Reply::Granted,
        );
        history.made(Draft {
            op: Op::Release,
            key: key.clone(),
            owner: Some(owner),
            token: Some(FencingToken(7)),
            ttl: None,
            invoked: start + Duration::from_millis(2),
            valid_until: None,
            reply: Reply::Released,
        });
        let listed = timeline(&history.settled(), 10);
        let lines: Vec<&str> = listed.lines().collect();
        assert_eq!(lines.len(), 2, "{listed}");
        assert!(lines[0].contains("[0.0 .. ") && lines[0].contains("acquire \"k\" token 7"));
        assert!(lines[0].contains("valid until 1000000.0"), "{listed}");
        assert!(lines[1].contains("[2000.0 .. ") && lines[1].contains("Unfinished"));
        assert_eq!(
            timeline(&history.settled(), 1).lines().last(),
            Some("    ... and 1 more")
        );
    }
}
