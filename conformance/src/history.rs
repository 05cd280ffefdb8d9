//! The history of a case run, and the checker for the invariants I1–I5 of the design.
//!
//! Cases talk to the store through a [`RecordingBackend`], which appends one [`Event`]
//! per call (and one per element of a batch call) to a shared [`History`], with the
//! instants the call was invoked and completed on tokio's clock. Writes to the fenced
//! resource go through a [`FencedCounter`], which records them too. [`check`] then reads
//! the events after the fact and reports every [`Violation`] of:
//!
//! - **I1** tokens are unique and strictly increasing in real-time grant order, per key;
//! - **I2** the fenced resource admits tokens in non-decreasing order only, and the
//!   read-modify-write workload under the lock loses no update;
//! - **I3** the client validity windows of different grants never overlap (no-fault runs),
//!   and no grant or renewal claims validity beyond its send instant plus the TTL;
//! - **I4** release or renewal of a lost lease (or of a lease nobody was granted) returns
//!   `NotHeld`/`Lost`, and leaves the holder untouched: a holder's renewals and fence
//!   checks succeed while its validity window lasts;
//! - **I5** renewal extends and keeps the token, and never resurrects an expired lease.
//!
//! The checker only draws conclusions the instants prove: two calls are ordered only
//! when one completed before the other was invoked, and a store-side expiry is bounded
//! from the instants the client saw, never from a guess about the store's clock.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lock_api::{
    Admission, BackendLayer, DRIFT_FACTOR, Fence, FencedResource, FencingToken, Layered, Lease,
    LockBackend, LockError, LockKey, MemoryFencedResource, OwnerId, Release, Renewal,
};
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
    /// A read-modify-write through a [`FencedCounter`].
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
    fn lease_id(&self) -> Option<(OwnerId, FencingToken)> {
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
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

/// The fields of an event before it is numbered.
struct Draft {
    op: Op,
    key: LockKey,
    owner: Option<OwnerId>,
    token: Option<FencingToken>,
    ttl: Option<Duration>,
    invoked: Instant,
    valid_until: Option<Instant>,
    reply: Reply,
}

impl History {
    /// An empty history.
    pub fn new() -> Self {
        Self {
            events: Mutex::new(Vec::new()),
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

    fn push(&self, draft: Draft) {
        let completed = Instant::now();
        let mut events = self.events.lock();
        let seq = events.len() as u64;
        events.push(Event {
            seq,
            op: draft.op,
            key: draft.key,
            owner: draft.owner,
            token: draft.token,
            ttl: draft.ttl,
            invoked: draft.invoked,
            completed,
            valid_until: draft.valid_until,
            reply: draft.reply,
        });
    }

    /// A copy of every event so far, in recording order.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().clone()
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

    /// Checks every invariant; see [`check`].
    pub fn check(&self, options: &CheckOptions) -> Vec<Violation> {
        check(&self.events(), options)
    }
}

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
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            faults: false,
            expiry_slack: Duration::from_millis(100),
        }
    }
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

/// Checks a history against I1–I5 and returns every violation found (empty when clean).
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
    violations
}

fn violation(violations: &mut Vec<Violation>, invariant: Invariant, message: String) {
    violations.push(Violation { invariant, message });
}

fn check_key(events: &[&Event], options: &CheckOptions, out: &mut Vec<Violation>) {
    let mut grants: Vec<Grant<'_>> = events
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

/// How much later than the recorded invocation a backend may take its own send instant:
/// on a loaded machine the calling thread can be descheduled between the two clock reads.
/// The `validity_counts_from_the_send_instant` case, over a link delayed by a fifth of the
/// TTL, still catches a backend that counts from the reply instead.
pub const SEND_INSTANT_SLACK: Duration = Duration::from_millis(25);

/// I3 (bound half): a grant or renewal never claims validity past its send instant + TTL.
fn check_validity_bounds(events: &[&Event], out: &mut Vec<Violation>) {
    for e in events {
        if let (Some(valid), Some(ttl)) = (e.valid_until, e.ttl)
            && valid > e.invoked + ttl + SEND_INSTANT_SLACK
        {
            violation(
                out,
                Invariant::I3,
                format!(
                    "{e} claims validity {:?} past its send instant plus the TTL {ttl:?}",
                    valid - (e.invoked + ttl)
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

/// A backend wrapper that records every call into a [`History`]; behaves exactly like
/// the backend it wraps (batch calls stay batch calls).
///
/// `RecordingBackend::new(inner, history)` records the calls made to `inner` into
/// `history`; `layer()` is that history.
pub type RecordingBackend = Layered<Arc<History>>;

/// The history is the layer that records calls into itself: one event per call, one per
/// input of a batch call. `inspect`, `adopt`, `purge` and release watches pass through
/// unrecorded.
///
/// # Cancel safety
/// As cancel safe as the wrapped backend; a cancelled call records nothing.
#[async_trait]
impl BackendLayer for History {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let invoked = Instant::now();
        let result = next.acquire(key, ttl).await;
        self.record_acquire(key, ttl, invoked, result.as_ref());
        result
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        let invoked = Instant::now();
        let result = next.renew(lease).await;
        self.record_renewal(lease, invoked, result.as_ref());
        result
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        let invoked = Instant::now();
        let result = next.release(lease).await;
        self.record_release(lease, invoked, result.as_ref());
        result
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        let invoked = Instant::now();
        let result = next.fence(lease).await;
        let reply = match &result {
            Ok(Fence::Current) => Reply::Current,
            Ok(Fence::Stale { current }) => Reply::Stale { current: *current },
            Err(e) => Reply::Error(e.to_string()),
        };
        self.record_lease(Op::Fence, lease, invoked, None, reply);
        result
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let invoked = Instant::now();
        let result = next.acquire_many(keys, ttl).await;
        each_outcome(keys, &result, |key, outcome| {
            self.record_acquire(key, ttl, invoked, outcome);
        });
        result
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let invoked = Instant::now();
        let result = next.renew_many(leases).await;
        each_outcome(leases, &result, |lease, outcome| {
            self.record_renewal(lease, invoked, outcome);
        });
        result
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        let invoked = Instant::now();
        let result = next.release_many(leases).await;
        each_outcome(leases, &result, |lease, outcome| {
            self.record_release(lease, invoked, outcome);
        });
        result
    }
}

/// What [`RecordingBackend`] records for each kind of call.
impl History {
    fn record_lease(
        &self,
        op: Op,
        lease: &Lease,
        invoked: Instant,
        valid_until: Option<Instant>,
        reply: Reply,
    ) {
        self.record(
            op,
            lease.key(),
            Some(lease.owner()),
            Some(lease.token()),
            Some(lease.ttl()),
            invoked,
            valid_until,
            reply,
        );
    }

    fn record_acquire(
        &self,
        key: &LockKey,
        ttl: Duration,
        invoked: Instant,
        result: Result<&Option<Lease>, &LockError>,
    ) {
        let (owner, token, valid, reply) = match result {
            Ok(Some(l)) => (
                Some(l.owner()),
                Some(l.token()),
                Some(l.valid_until()),
                Reply::Granted,
            ),
            Ok(None) => (None, None, None, Reply::Busy),
            Err(e) => (None, None, None, Reply::Error(e.to_string())),
        };
        self.record(
            Op::Acquire,
            key,
            owner,
            token,
            Some(ttl),
            invoked,
            valid,
            reply,
        );
    }

    fn record_renewal(
        &self,
        lease: &Lease,
        invoked: Instant,
        result: Result<&Renewal, &LockError>,
    ) {
        let (valid, reply) = match result {
            Ok(Renewal::Renewed { valid_until }) => (Some(*valid_until), Reply::Renewed),
            Ok(Renewal::Lost) => (None, Reply::Lost),
            Ok(Renewal::Unreachable) => (None, Reply::Error("unreachable".into())),
            Err(e) => (None, Reply::Error(e.to_string())),
        };
        self.record_lease(Op::Renew, lease, invoked, valid, reply);
    }

    fn record_release(
        &self,
        lease: &Lease,
        invoked: Instant,
        result: Result<&Release, &LockError>,
    ) {
        let reply = match result {
            Ok(Release::Released) => Reply::Released,
            Ok(Release::NotHeld) => Reply::NotHeld,
            Ok(Release::Unreachable) => Reply::Error("unreachable".into()),
            Err(e) => Reply::Error(e.to_string()),
        };
        self.record_lease(Op::Release, lease, invoked, None, reply);
    }
}

/// Calls `record` once per input of a batch call with that input's own outcome: its
/// item of the reply, or the error that failed the whole batch.
fn each_outcome<I, T>(
    inputs: &[I],
    result: &Result<Vec<T>, LockError>,
    mut record: impl FnMut(&I, Result<&T, &LockError>),
) {
    match result {
        Ok(items) => inputs.iter().zip(items).for_each(|(i, t)| record(i, Ok(t))),
        Err(e) => inputs.iter().for_each(|i| record(i, Err(e))),
    }
}

/// A counter guarded by a fenced resource: the downstream store of the read-modify-write
/// workload. A write is admitted (and applied) atomically with the fencing check, and
/// recorded in the history in admission order.
///
/// The resource is in memory ([`FencedCounter::new`]) or a backend's own
/// ([`FencedCounter::on`]: a Redis script, a PostgreSQL guarded row, an etcd transaction);
/// either way the store decides the admission, and the counter's lock, held across it,
/// makes the check and the write one step for this workload.
pub struct FencedCounter {
    resource: Gate,
    value: tokio::sync::Mutex<u64>,
    history: Arc<History>,
}

/// Where a [`FencedCounter`]'s admissions are decided.
enum Gate {
    Memory(MemoryFencedResource),
    Store(Arc<dyn FencedResource>),
}

impl fmt::Debug for FencedCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gate = match self.resource {
            Gate::Memory(_) => "memory",
            Gate::Store(_) => "store",
        };
        f.debug_struct("FencedCounter")
            .field("resource", &gate)
            .finish_non_exhaustive()
    }
}

impl FencedCounter {
    /// A counter at zero on an in-memory resource in enforce mode, recording into
    /// `history`.
    pub fn new(history: Arc<History>) -> Self {
        Self::with_gate(
            Gate::Memory(MemoryFencedResource::new(
                lock_api::EnforcementMode::Enforce,
            )),
            history,
        )
    }

    /// A counter at zero whose writes `resource` admits (it must be in enforce mode),
    /// recording into `history`.
    pub fn on(resource: Arc<dyn FencedResource>, history: Arc<History>) -> Self {
        Self::with_gate(Gate::Store(resource), history)
    }

    fn with_gate(resource: Gate, history: Arc<History>) -> Self {
        Self {
            resource,
            value: tokio::sync::Mutex::new(0),
            history,
        }
    }

    /// The current value.
    pub async fn read(&self) -> u64 {
        *self.value.lock().await
    }

    /// Writes `value` (computed from `read`) with `token`, if the resource admits the
    /// token. Returns the admission, or the store's error (recorded, nothing written).
    pub async fn write(
        &self,
        key: &LockKey,
        token: FencingToken,
        read: u64,
        value: u64,
    ) -> Result<Admission, LockError> {
        let invoked = Instant::now();
        let mut current = self.value.lock().await;
        let admission = match &self.resource {
            Gate::Memory(resource) => Ok(resource.admit_now(key.as_str(), token)),
            Gate::Store(resource) => resource.admit(key.as_str(), token).await,
        };
        let reply = match &admission {
            Ok(Admission::Stale { latest } | Admission::ShadowStale { latest }) => {
                Reply::Rejected { latest: *latest }
            }
            Ok(Admission::Admitted) => {
                *current = value;
                Reply::Admitted { read, wrote: value }
            }
            Err(e) => Reply::Error(e.to_string()),
        };
        // Recorded under the value lock, so the history's order is the admission order.
        self.history.record(
            Op::Write,
            key,
            None,
            Some(token),
            None,
            invoked,
            None,
            reply,
        );
        admission
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const TTL: Duration = Duration::from_millis(100);

    /// Builds events at chosen instants (milliseconds after a fixed origin).
    struct Builder {
        origin: Instant,
        key: LockKey,
        events: Vec<Event>,
    }

    impl Builder {
        fn new() -> Self {
            Self {
                origin: Instant::now(),
                key: LockKey::new("k").unwrap(),
                events: Vec::new(),
            }
        }

        fn at(&self, ms: u64) -> Instant {
            self.origin + MS * ms as u32
        }

        #[allow(clippy::too_many_arguments)]
        fn push(
            &mut self,
            op: Op,
            lease: Option<(OwnerId, u64)>,
            invoked: u64,
            completed: u64,
            valid_until: Option<u64>,
            reply: Reply,
        ) -> &mut Self {
            let event = Event {
                seq: self.events.len() as u64,
                op,
                key: self.key.clone(),
                owner: lease.map(|l| l.0),
                token: lease.map(|l| FencingToken(l.1)),
                ttl: Some(TTL),
                invoked: self.at(invoked),
                completed: self.at(completed),
                valid_until: valid_until.map(|v| self.at(v)),
                reply,
            };
            self.events.push(event);
            self
        }

        /// A grant invoked at `at`, completed 1 ms later, valid for 90 ms from `at`.
        fn grant(&mut self, lease: (OwnerId, u64), at: u64) -> &mut Self {
            self.push(
                Op::Acquire,
                Some(lease),
                at,
                at + 1,
                Some(at + 90),
                Reply::Granted,
            )
        }

        fn op(&mut self, op: Op, lease: (OwnerId, u64), at: u64, reply: Reply) -> &mut Self {
            self.push(op, Some(lease), at, at + 1, None, reply)
        }

        fn write(&mut self, token: u64, at: u64, reply: Reply) -> &mut Self {
            self.push(Op::Write, None, at, at, None, reply)
                .events
                .last_mut()
                .unwrap()
                .token = Some(FencingToken(token));
            self
        }

        fn check(&self) -> Vec<Violation> {
            check(&self.events, &CheckOptions::default())
        }
    }

    fn only(violations: &[Violation], invariant: Invariant) {
        assert!(
            !violations.is_empty() && violations.iter().all(|v| v.invariant == invariant),
            "expected only {invariant} violations, got {violations:#?}"
        );
    }

    #[test]
    fn a_clean_history_passes() {
        let (a, b) = (OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .write(1, 5, Reply::Admitted { read: 0, wrote: 1 })
            .op(Op::Fence, (a, 1), 10, Reply::Current)
            .push(Op::Renew, Some((a, 1)), 30, 31, Some(120), Reply::Renewed)
            .op(Op::Fence, (a, 1), 100, Reply::Current)
            .op(Op::Release, (a, 1), 110, Reply::Released)
            .push(Op::Acquire, None, 111, 112, None, Reply::Busy)
            .grant((b, 2), 115)
            .write(2, 120, Reply::Admitted { read: 1, wrote: 2 })
            .write(
                1,
                121,
                Reply::Rejected {
                    latest: FencingToken(2),
                },
            )
            .op(Op::Release, (a, 1), 122, Reply::NotHeld)
            .op(Op::Renew, (a, 1), 123, Reply::Lost)
            .op(
                Op::Fence,
                (a, 1),
                124,
                Reply::Stale {
                    current: FencingToken(2),
                },
            )
            .op(Op::Release, (b, 2), 150, Reply::Released);
        assert_eq!(h.check(), vec![]);
    }

    #[test]
    fn i1_duplicate_and_decreasing_tokens_are_reported() {
        let (a, b, c) = (OwnerId::random(), OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.grant((a, 5), 0)
            .op(Op::Release, (a, 5), 10, Reply::Released)
            .grant((b, 5), 20)
            .op(Op::Release, (b, 5), 30, Reply::Released)
            .grant((c, 4), 40);
        let v = h.check();
        only(&v, Invariant::I1);
        assert!(
            v.iter().any(|v| v.message.contains("granted twice")),
            "{v:#?}"
        );
        assert!(v.iter().any(|v| v.message.contains("went down")), "{v:#?}");
    }

    #[test]
    fn concurrent_grants_are_not_ordered_by_i1() {
        // Overlapping calls may complete in either order; only their windows matter.
        let (a, b) = (OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.push(Op::Acquire, Some((a, 2)), 0, 10, Some(5), Reply::Granted)
            .push(Op::Acquire, Some((b, 1)), 1, 2, Some(1), Reply::Granted);
        assert!(h.check().iter().all(|v| v.invariant != Invariant::I1));
    }

    #[test]
    fn i2_stale_admission_and_lost_update_are_reported() {
        let mut h = Builder::new();
        h.write(3, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
            2,
            1,
            Reply::Admitted { read: 1, wrote: 2 },
        );
        only(&h.check(), Invariant::I2);

        let mut h = Builder::new();
        h.write(1, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
            2,
            1,
            Reply::Admitted { read: 0, wrote: 1 },
        );
        let v = h.check();
        only(&v, Invariant::I2);
        assert!(v[0].message.contains("lost update"), "{v:#?}");

        let mut h = Builder::new();
        h.write(1, 0, Reply::Admitted { read: 0, wrote: 1 }).write(
            1,
            1,
            Reply::Rejected {
                latest: FencingToken(1),
            },
        );
        only(&h.check(), Invariant::I2);
    }

    #[test]
    fn i3_overlapping_windows_are_reported() {
        let (a, b) = (OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.grant((a, 1), 0).grant((b, 2), 50);
        let v = h.check();
        only(&v, Invariant::I3);
        assert!(v[0].message.contains("overlap"), "{v:#?}");
        // The same history is acceptable when faults were injected.
        let faults = CheckOptions {
            faults: true,
            ..CheckOptions::default()
        };
        assert_eq!(check(&h.events, &faults), vec![]);
    }

    #[test]
    fn i3_validity_beyond_send_plus_ttl_is_reported() {
        let a = OwnerId::random();
        let mut h = Builder::new();
        h.push(Op::Acquire, Some((a, 1)), 0, 1, Some(150), Reply::Granted);
        let v = h.check();
        only(&v, Invariant::I3);
        assert!(v[0].message.contains("past its send instant"), "{v:#?}");
    }

    #[test]
    fn i4_a_lost_lease_released_or_renewed_is_reported() {
        let (a, b) = (OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .grant((b, 2), 200)
            .op(Op::Release, (a, 1), 210, Reply::Released);
        only(&h.check(), Invariant::I4);

        let mut h = Builder::new();
        h.grant((a, 1), 0).grant((b, 2), 200).push(
            Op::Renew,
            Some((a, 1)),
            210,
            211,
            Some(300),
            Reply::Renewed,
        );
        assert!(h.check().iter().any(|v| v.invariant == Invariant::I4));
    }

    #[test]
    fn i4_a_release_by_a_non_owner_is_reported() {
        let (a, forged) = (OwnerId::random(), OwnerId::random());
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .op(Op::Release, (forged, 1), 10, Reply::Released);
        let v = h.check();
        only(&v, Invariant::I4);
        assert!(v[0].message.contains("nobody was granted"), "{v:#?}");
    }

    #[test]
    fn i4_a_disturbed_holder_is_reported() {
        // The holder's fence check fails while its window lasts: someone freed its key.
        let a = OwnerId::random();
        let mut h = Builder::new();
        h.grant((a, 1), 0).op(
            Op::Fence,
            (a, 1),
            40,
            Reply::Stale {
                current: FencingToken(1),
            },
        );
        only(&h.check(), Invariant::I4);
    }

    #[test]
    fn i5_resurrection_and_lost_token_after_renewal_are_reported() {
        let a = OwnerId::random();
        // Renewed 300 ms after a 100 ms lease was granted: resurrected.
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .push(Op::Renew, Some((a, 1)), 300, 301, Some(390), Reply::Renewed);
        let v = h.check();
        only(&v, Invariant::I5);
        assert!(v[0].message.contains("resurrected"), "{v:#?}");

        // A renewal succeeded, then the fence inside the renewed window says stale.
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .push(Op::Renew, Some((a, 1)), 50, 51, Some(140), Reply::Renewed)
            .op(
                Op::Fence,
                (a, 1),
                120,
                Reply::Stale {
                    current: FencingToken(1),
                },
            );
        only(&h.check(), Invariant::I5);

        // A renewal after a successful release brings the lease back.
        let mut h = Builder::new();
        h.grant((a, 1), 0)
            .op(Op::Release, (a, 1), 10, Reply::Released)
            .push(Op::Renew, Some((a, 1)), 20, 21, Some(110), Reply::Renewed);
        assert!(h.check().iter().any(|v| v.invariant == Invariant::I5));
    }

    #[test]
    fn i5_a_renewal_that_shortens_validity_is_reported() {
        let a = OwnerId::random();
        let mut h = Builder::new();
        h.grant((a, 1), 10)
            .push(Op::Renew, Some((a, 1)), 20, 21, Some(50), Reply::Renewed);
        let v = h.check();
        only(&v, Invariant::I5);
        assert!(v[0].message.contains("shortened"), "{v:#?}");
    }

    #[tokio::test]
    async fn the_recorder_numbers_events_and_the_counter_orders_writes() {
        let history = Arc::new(History::new());
        let counter = FencedCounter::new(history.clone());
        let key = LockKey::new("k").unwrap();
        let write = |token, read, value| counter.write(&key, FencingToken(token), read, value);
        assert!(write(2, 0, 1).await.unwrap().is_admitted());
        assert!(!write(1, 1, 2).await.unwrap().is_admitted());
        assert_eq!(counter.read().await, 1);
        let events = history.events();
        assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(
            events[1].reply,
            Reply::Rejected {
                latest: FencingToken(2)
            }
        );
        assert_eq!(history.check(&CheckOptions::default()), vec![]);
    }
}
