//! The watchdog: ONE renewal task per [`crate::Locker`] that renews every due lease with
//! one `renew_many` call, and the shared per-lease state that guards read.
//!
//! Each lease has its own deadline, its local `valid_until`: a lease already past it is
//! given up without being sent, and a batch waits for its reply until the latest deadline
//! among its leases, so a neighbour about to run out never cuts short the renewal of the
//! others. Batches run side by side in the one task, so a slow batch does not hold up
//! leases that fall due meanwhile.
//!
//! A transient renewal error is retried until the lease's deadline; a `Lost` reply, or
//! the deadline passing, marks the lease lost at once and wakes every `lost()` future.
//! The task holds only a weak reference while it sleeps, so it ends when the `Locker` and
//! all its guards are gone. If the task's runtime shuts down while leases are still held,
//! the task starts again on another runtime that registered a lease and is still running,
//! so guards taken from other runtimes stay renewed without waiting for a new lock.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::{debug, warn};

use crate::backend::LockBackend;
use crate::backend::lease::{Lease, Renewal, trusted_for};
use crate::error::LockError;
use crate::telemetry::{HELD, HELD_SECONDS, Kind, LOST_TOTAL};

const HELD_STATE: u8 = 0;
const LOST_STATE: u8 = 1;
const RELEASED_STATE: u8 = 2;

/// What a guard and the watchdog share about one lease.
#[derive(Debug)]
pub(crate) struct LeaseState {
    valid_until: Mutex<Instant>,
    state: AtomicU8,
    changed: Notify,
    backend: &'static str,
    /// What the lease is for: the metrics' `kind` label.
    kind: &'static str,
    /// When the lease was granted, for the held-time histogram.
    granted: Instant,
}

impl LeaseState {
    pub(crate) fn new(valid_until: Instant, backend: &'static str, kind: Kind) -> Self {
        Self {
            valid_until: Mutex::new(valid_until),
            state: AtomicU8::new(HELD_STATE),
            changed: Notify::new(),
            backend,
            kind: kind.as_str(),
            granted: Instant::now(),
        }
    }

    pub(crate) fn valid_until(&self) -> Instant {
        *self.valid_until.lock()
    }

    /// True while the lease is neither lost nor released and its deadline has not passed.
    ///
    /// A lease found past its deadline is marked lost here, under the deadline's lock, so
    /// a renewal reply applied after this call cannot bring it back: once this says
    /// false it says false for good, and every `wait_ended` future is woken.
    pub(crate) fn is_held(&self) -> bool {
        if self.state.load(Ordering::Acquire) != HELD_STATE {
            return false;
        }
        let valid_until = self.valid_until.lock();
        if Instant::now() < *valid_until {
            return true;
        }
        self.mark_lost_by(*valid_until);
        drop(valid_until);
        false
    }

    /// Moves the deadline to `until` if the lease is still held by the local clock; a
    /// lease already past its deadline (or ended) stays as it is and `false` is returned,
    /// for the caller to give it up. Checked and applied under the deadline's lock, so it
    /// never races [`LeaseState::is_held`]'s verdict.
    fn extend(&self, until: Instant) -> bool {
        let mut valid_until = self.valid_until.lock();
        if self.state.load(Ordering::Acquire) != HELD_STATE || Instant::now() >= *valid_until {
            return false;
        }
        if until > *valid_until {
            *valid_until = until;
        }
        true
    }

    /// Marks the lease lost (once) and wakes every waiter.
    pub(crate) fn mark_lost(&self) {
        self.mark_lost_by(self.valid_until());
    }

    /// [`LeaseState::mark_lost`] for a caller that holds the deadline's lock and passes
    /// the deadline it read.
    fn mark_lost_by(&self, valid_until: Instant) {
        if self.end(LOST_STATE, valid_until) {
            metrics::counter!(LOST_TOTAL, "backend" => self.backend, "kind" => self.kind)
                .increment(1);
            debug!(backend = self.backend, "lease lost");
        }
    }

    /// Marks the lease released by its owner and wakes every waiter.
    pub(crate) fn mark_released(&self) {
        self.end(RELEASED_STATE, self.valid_until());
    }

    /// Moves the lease from held to `to`, once; the lease's held time ends now or at its
    /// deadline `valid_until`, whichever is earlier: past its deadline it was not held,
    /// however late the end was noticed.
    fn end(&self, to: u8, valid_until: Instant) -> bool {
        let ended = self
            .state
            .compare_exchange(HELD_STATE, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if ended {
            metrics::gauge!(HELD, "backend" => self.backend, "kind" => self.kind).decrement(1.0);
            let held = Instant::now()
                .min(valid_until)
                .saturating_duration_since(self.granted);
            metrics::histogram!(HELD_SECONDS, "backend" => self.backend, "kind" => self.kind)
                .record(held.as_secs_f64());
            self.changed.notify_waiters();
        }
        ended
    }

    /// Resolves once the lease is no longer held: lost, released, or past `valid_until`.
    ///
    /// Every poll asks [`LeaseState::is_held`] first, so the future is ready at the first
    /// poll after the deadline passes, whether or not its timer or the watchdog has run:
    /// after a pause (a stopped process, a blocked runtime) the timer that would wake it
    /// may not have fired yet when the task is polled again.
    pub(crate) async fn wait_ended(&self) {
        let woken = self.wait_woken();
        tokio::pin!(woken);
        std::future::poll_fn(|cx| {
            if !self.is_held() {
                return Poll::Ready(());
            }
            woken.as_mut().poll(cx)
        })
        .await;
    }

    /// Ends when a change is announced or the deadline's timer fires after the lease has
    /// ended; `wait_ended` checks the clock around it.
    async fn wait_woken(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !self.is_held() {
                return;
            }
            let deadline = self.valid_until();
            tokio::select! {
                () = changed => {}
                () = sleep_until(deadline) => {}
            }
        }
    }
}

/// How long after a failed renewal attempt the watchdog tries again.
fn retry_delay(interval: Duration) -> Duration {
    (interval / 4).min(Duration::from_millis(500))
}

/// Checks that a lease of `ttl` is renewed, and a failed renewal retried once, while the
/// lease is still valid: a lease that dies before its first renewal is useless.
///
/// A TTL too short for the default schedule is [`LockError::InvalidTtl`]; a chosen
/// `renew_interval` too late for the TTL is [`LockError::Config`].
pub(crate) fn check_schedule(
    ttl: Duration,
    renew_interval: Option<Duration>,
) -> Result<(), LockError> {
    let trusted = trusted_for(ttl);
    let in_time = |interval: Duration| interval.saturating_add(retry_delay(interval)) < trusted;
    if !in_time(interval_for(None, ttl)) {
        return Err(LockError::invalid_ttl(
            ttl,
            format!("a lease of {ttl:?} is trusted for only {trusted:?}, too short to renew"),
        ));
    }
    match renew_interval {
        Some(every) if !in_time(interval_for(Some(every), ttl)) => Err(LockError::Config(format!(
            "the renew interval {every:?} leaves no time to retry a renewal before a lease of \
             {ttl:?} runs out (it is trusted for {trusted:?}); renew more often"
        ))),
        _ => Ok(()),
    }
}

/// The renew interval the watchdog uses: the chosen one or TTL / 3, at least 1 ms.
fn interval_for(renew_interval: Option<Duration>, ttl: Duration) -> Duration {
    renew_interval
        .unwrap_or(ttl / 3)
        .max(Duration::from_millis(1))
}

struct Entry {
    lease: Lease,
    state: Arc<LeaseState>,
    /// When the next renewal is due; `None` while a renewal of it is in flight.
    due: Option<Instant>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    due: BTreeSet<(Instant, u64)>,
}

impl Registry {
    fn schedule(&mut self, id: u64, at: Instant) {
        if let Some(entry) = self.entries.get_mut(&id) {
            if let Some(old) = entry.due.replace(at) {
                self.due.remove(&(old, id));
            }
            self.due.insert((at, id));
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(Entry { due: Some(at), .. }) = self.entries.remove(&id) {
            self.due.remove(&(at, id));
        }
    }
}

/// One lease of a batch in flight.
struct Member {
    id: u64,
    lease: Lease,
    state: Arc<LeaseState>,
}

/// A batch whose `renew_many` call has ended, with its reply or why there is none.
struct Finished {
    members: Vec<Member>,
    sent: Instant,
    result: Result<Result<Vec<Renewal>, LockError>, tokio::time::error::Elapsed>,
}

/// The renewal task's shared side: the registry of held leases.
pub(crate) struct Watchdog {
    backend: Arc<dyn LockBackend>,
    renew_interval: Option<Duration>,
    registry: Mutex<Registry>,
    wake: Arc<Notify>,
    /// True while a renewal task exists; cleared when the task ends or is dropped with
    /// its runtime.
    running: Arc<AtomicBool>,
    /// The runtimes that registered leases (one handle each), where the task may start
    /// again when its own runtime shuts down. A runtime found shut down is dropped.
    runtimes: Mutex<Vec<Handle>>,
    /// Set while the task is being started elsewhere, so a start that fails at once (on a
    /// runtime that shut down) does not start another search from inside the first.
    respawning: AtomicBool,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("backend", &self.backend.name())
            .field("held", &self.registry.lock().entries.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Wake the sleeping task so it sees the registry is gone and ends.
        self.wake.notify_one();
    }
}

impl Watchdog {
    pub(crate) fn new(backend: Arc<dyn LockBackend>, renew_interval: Option<Duration>) -> Self {
        Self {
            backend,
            renew_interval,
            registry: Mutex::new(Registry::default()),
            wake: Arc::new(Notify::new()),
            running: Arc::new(AtomicBool::new(false)),
            runtimes: Mutex::new(Vec::new()),
            respawning: AtomicBool::new(false),
        }
    }

    pub(crate) fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.backend
    }

    /// How long after a successful grant or renewal the lease is renewed again.
    pub(crate) fn interval(&self, ttl: Duration) -> Duration {
        interval_for(self.renew_interval, ttl)
    }

    /// Starts renewing `lease`; returns its registry id. Starts the renewal task on the
    /// caller's runtime if none is running.
    pub(crate) fn register(
        self: &Arc<Self>,
        lease: Lease,
        state: Arc<LeaseState>,
        sent: Instant,
    ) -> u64 {
        self.ensure_task();
        metrics::gauge!(HELD, "backend" => state.backend, "kind" => state.kind).increment(1.0);
        let due = sent + self.interval(lease.ttl());
        let mut registry = self.registry.lock();
        let id = registry.next_id;
        registry.next_id += 1;
        let earliest = registry.due.first().map(|(at, _)| *at);
        registry.entries.insert(
            id,
            Entry {
                lease,
                state,
                due: None,
            },
        );
        registry.schedule(id, due);
        drop(registry);
        if earliest.is_none_or(|at| due < at) {
            self.wake.notify_one();
        }
        id
    }

    /// Spawns the renewal task unless one is running. A task spawned onto a runtime that
    /// is shutting down is dropped unpolled; its `TaskAlive` then clears `running`, so
    /// the next registration tries again.
    fn ensure_task(self: &Arc<Self>) {
        let current = Handle::current();
        {
            let mut runtimes = self.runtimes.lock();
            if !runtimes.iter().any(|h| h.id() == current.id()) {
                runtimes.push(current.clone());
            }
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        self.spawn_on(&current);
    }

    fn spawn_on(self: &Arc<Self>, runtime: &Handle) {
        let alive = TaskAlive {
            watchdog: Arc::downgrade(self),
            running: self.running.clone(),
        };
        runtime.spawn(run(Arc::downgrade(self), alive));
    }

    /// Called when the task was dropped with its runtime: starts it on the first other
    /// registering runtime that still runs, while leases are held. A runtime that shut
    /// down drops the new task at once (its `TaskAlive` clears `running` again), and is
    /// forgotten.
    fn respawn_elsewhere(self: &Arc<Self>) {
        if self.registry.lock().entries.is_empty() || self.respawning.swap(true, Ordering::AcqRel) {
            return;
        }
        let candidates = self.runtimes.lock().clone();
        for runtime in candidates {
            if self.running.swap(true, Ordering::AcqRel) {
                break;
            }
            self.spawn_on(&runtime);
            if self.running.load(Ordering::Acquire) {
                debug!("renewal task started again on another runtime");
                break;
            }
            self.runtimes.lock().retain(|h| h.id() != runtime.id());
        }
        self.respawning.store(false, Ordering::Release);
    }

    /// Stops renewing the lease `id`.
    pub(crate) fn unregister(&self, id: u64) {
        self.registry.lock().remove(id);
    }

    /// How many leases are being renewed.
    pub(crate) fn held(&self) -> usize {
        self.registry.lock().entries.len()
    }

    fn next_due(&self) -> Option<Instant> {
        self.registry.lock().due.first().map(|(at, _)| *at)
    }

    /// Takes every lease due now (or within a twelfth of its TTL, to batch neighbours)
    /// out of the schedule. Leases that have ended are dropped from the registry, and
    /// leases already past their deadline are marked lost instead of being sent.
    fn take_due(&self, now: Instant) -> Vec<Member> {
        let mut registry = self.registry.lock();
        let mut taken = Vec::new();
        for &(at, id) in registry.due.iter() {
            let ttl = registry.entries.get(&id).map(|e| e.lease.ttl());
            if ttl.is_some_and(|ttl| at > now + ttl / 12) {
                break;
            }
            taken.push((at, id));
        }
        let mut batch = Vec::new();
        for (at, id) in taken {
            registry.due.remove(&(at, id));
            let Some(entry) = registry.entries.get_mut(&id) else {
                continue;
            };
            entry.due = None;
            let state = entry.state.clone();
            if state.state.load(Ordering::Acquire) != HELD_STATE {
                registry.entries.remove(&id);
            } else if now >= state.valid_until() {
                state.mark_lost();
                registry.entries.remove(&id);
            } else {
                let lease = entry.lease.clone();
                batch.push(Member { id, lease, state });
            }
        }
        batch
    }

    /// Takes the due leases and returns their renewal call, which waits for its reply at
    /// most until the latest deadline among them.
    fn start_due(&self) -> Option<BoxFuture<'static, Finished>> {
        let sent = Instant::now();
        let members = self.take_due(sent);
        let deadline = members.iter().map(|m| m.state.valid_until()).max()?;
        let leases: Vec<Lease> = members.iter().map(|m| m.lease.clone()).collect();
        let backend = self.backend.clone();
        Some(Box::pin(async move {
            let result = timeout_at(deadline, backend.renew_many(&leases)).await;
            Finished {
                members,
                sent,
                result,
            }
        }))
    }

    /// Applies a batch's outcome to each of its leases. A lease whose deadline passed
    /// before the reply came is lost whatever the reply says: its guard has already
    /// reported it not held, and must not see it come back.
    fn finish(&self, batch: Finished) {
        let Finished {
            members,
            sent,
            result,
        } = batch;
        let now = Instant::now();
        match result {
            Ok(Ok(renewals)) if renewals.len() == members.len() => {
                for (member, renewal) in members.into_iter().zip(renewals) {
                    match renewal {
                        // A reply read after the lease's own deadline (the watchdog was
                        // slow, the process paused) loses it whatever it says: its guard
                        // may already have reported it not held. `extend` decides that
                        // under the deadline's lock, so no `is_held` falls between.
                        Renewal::Renewed { valid_until } => {
                            if member.state.extend(valid_until) {
                                let due = sent + self.interval(member.lease.ttl());
                                self.registry.lock().schedule(member.id, due);
                            } else {
                                self.lose(&member);
                            }
                        }
                        Renewal::Lost => self.lose(&member),
                        Renewal::Unreachable => self.retry_later(&member, now),
                    }
                }
            }
            other => {
                let why = match other {
                    Ok(Ok(r)) => format!("{} replies for {} leases", r.len(), members.len()),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no reply before the last lease ran out".into(),
                };
                warn!(backend = self.backend.name(), leases = members.len(), error = %why, "renewal failed; retrying until the leases run out");
                for member in &members {
                    self.retry_later(member, now);
                }
            }
        }
    }

    fn lose(&self, member: &Member) {
        member.state.mark_lost();
        self.unregister(member.id);
    }

    /// After a transient failure: try again soon, or give the lease up once its deadline
    /// has passed. A retry never falls after the deadline; one due at the deadline is
    /// dropped by `take_due` instead of being sent.
    fn retry_later(&self, member: &Member, now: Instant) {
        let valid_until = member.state.valid_until();
        if now >= valid_until {
            self.lose(member);
        } else {
            let retry = retry_delay(self.interval(member.lease.ttl()));
            self.registry
                .lock()
                .schedule(member.id, (now + retry).min(valid_until));
        }
    }

    /// Puts leases whose renewal was in flight when the task went away back on the
    /// schedule, for the next task to renew.
    fn requeue_in_flight(&self) {
        let now = Instant::now();
        let mut registry = self.registry.lock();
        let in_flight: Vec<u64> = registry
            .entries
            .iter()
            .filter(|(_, e)| e.due.is_none())
            .map(|(id, _)| *id)
            .collect();
        for id in in_flight {
            registry.schedule(id, now);
        }
    }
}

/// Owned by the renewal task: when the task ends, or is dropped with its runtime, it
/// returns in-flight leases to the schedule and lets the next registration start a task.
struct TaskAlive {
    watchdog: Weak<Watchdog>,
    running: Arc<AtomicBool>,
}

impl Drop for TaskAlive {
    fn drop(&mut self) {
        let watchdog = self.watchdog.upgrade();
        if let Some(watchdog) = &watchdog {
            watchdog.requeue_in_flight();
        }
        self.running.store(false, Ordering::Release);
        // The task ends normally only once the watchdog is gone; alive, it was dropped
        // with its runtime.
        if let Some(watchdog) = watchdog {
            watchdog.respawn_elsewhere();
        }
    }
}

/// The renewal task: sleeps until the next lease is due (or a new one is registered),
/// starts its batch, applies the outcomes of batches as they end, and ends once the
/// watchdog is dropped.
async fn run(watchdog: Weak<Watchdog>, _alive: TaskAlive) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        let (wake, next) = match watchdog.upgrade() {
            Some(w) => (w.wake.clone(), w.next_due()),
            None => return,
        };
        let sleep_for = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            () = wake.notified() => {}
            () = sleep_until(sleep_for) => {
                if let Some(batch) = watchdog.upgrade().and_then(|w| w.start_due()) {
                    in_flight.push(batch);
                }
            }
            Some(finished) = in_flight.next(), if !in_flight.is_empty() => {
                if let Some(w) = watchdog.upgrade() {
                    w.finish(finished);
                }
            }
        }
    }
}
