//! The watchdog: ONE renewal task per [`crate::Locker`] that renews every due lease with
//! one `renew_many` call, and the shared per-lease state that guards read.
//!
//! A transient renewal error is retried until the lease's local `valid_until`; a `Lost`
//! reply, or `valid_until` passing, marks the lease lost at once and wakes every
//! `lost()` future. The task holds only a weak reference while it sleeps, so it ends
//! when the `Locker` and all its guards are gone.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::{debug, warn};

use crate::backend::LockBackend;
use crate::lease::{Lease, Renewal};
use crate::telemetry::{HELD, LOST_TOTAL};

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
}

impl LeaseState {
    pub(crate) fn new(valid_until: Instant, backend: &'static str) -> Self {
        Self {
            valid_until: Mutex::new(valid_until),
            state: AtomicU8::new(HELD_STATE),
            changed: Notify::new(),
            backend,
        }
    }

    pub(crate) fn valid_until(&self) -> Instant {
        *self.valid_until.lock()
    }

    /// True while the lease is neither lost nor released and its deadline has not passed.
    pub(crate) fn is_held(&self) -> bool {
        self.state.load(Ordering::Acquire) == HELD_STATE && Instant::now() < self.valid_until()
    }

    fn extend(&self, until: Instant) {
        let mut valid_until = self.valid_until.lock();
        if until > *valid_until {
            *valid_until = until;
        }
    }

    /// Marks the lease lost (once) and wakes every waiter.
    pub(crate) fn mark_lost(&self) {
        if self.end(LOST_STATE) {
            metrics::counter!(LOST_TOTAL, "backend" => self.backend).increment(1);
            debug!(backend = self.backend, "lease lost");
        }
    }

    /// Marks the lease released by its owner and wakes every waiter.
    pub(crate) fn mark_released(&self) {
        self.end(RELEASED_STATE);
    }

    fn end(&self, to: u8) -> bool {
        let ended = self
            .state
            .compare_exchange(HELD_STATE, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if ended {
            metrics::gauge!(HELD, "backend" => self.backend).decrement(1.0);
            self.changed.notify_waiters();
        }
        ended
    }

    /// Resolves once the lease is no longer held: lost, released, or past `valid_until`.
    pub(crate) async fn wait_ended(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.state.load(Ordering::Acquire) != HELD_STATE {
                return;
            }
            let deadline = self.valid_until();
            if Instant::now() >= deadline {
                self.mark_lost();
                return;
            }
            tokio::select! {
                () = changed => {}
                () = sleep_until(deadline) => {}
            }
        }
    }
}

struct Entry {
    lease: Lease,
    state: Arc<LeaseState>,
    due: Instant,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    due: BTreeSet<(Instant, u64)>,
}

/// The renewal task's shared side: the registry of held leases.
pub(crate) struct Watchdog {
    backend: Arc<dyn LockBackend>,
    renew_interval: Option<Duration>,
    registry: Mutex<Registry>,
    wake: Arc<Notify>,
    task: OnceLock<()>,
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
            task: OnceLock::new(),
        }
    }

    pub(crate) fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.backend
    }

    /// How long after a successful grant or renewal the lease is renewed again.
    pub(crate) fn interval(&self, ttl: Duration) -> Duration {
        self.renew_interval
            .unwrap_or(ttl / 3)
            .max(Duration::from_millis(1))
    }

    /// Starts renewing `lease`; returns its registry id. Starts the task on first use.
    pub(crate) fn register(
        self: &Arc<Self>,
        lease: Lease,
        state: Arc<LeaseState>,
        sent: Instant,
    ) -> u64 {
        self.task.get_or_init(|| {
            tokio::spawn(run(Arc::downgrade(self)));
        });
        metrics::gauge!(HELD, "backend" => state.backend).increment(1.0);
        let due = sent + self.interval(lease.ttl());
        let mut registry = self.registry.lock();
        let id = registry.next_id;
        registry.next_id += 1;
        let earliest = registry.due.first().map(|(at, _)| *at);
        registry.due.insert((due, id));
        registry.entries.insert(id, Entry { lease, state, due });
        drop(registry);
        if earliest.is_none_or(|at| due < at) {
            self.wake.notify_one();
        }
        id
    }

    /// Stops renewing the lease `id`.
    pub(crate) fn unregister(&self, id: u64) {
        let mut registry = self.registry.lock();
        if let Some(entry) = registry.entries.remove(&id) {
            registry.due.remove(&(entry.due, id));
        }
    }

    /// How many leases are being renewed.
    pub(crate) fn held(&self) -> usize {
        self.registry.lock().entries.len()
    }

    fn next_due(&self) -> Option<Instant> {
        self.registry.lock().due.first().map(|(at, _)| *at)
    }

    /// Takes every lease due now (or within a twelfth of its TTL, to batch neighbours)
    /// out of the schedule. Leases that have ended are dropped from the registry.
    fn take_due(&self, now: Instant) -> Vec<(u64, Lease, Arc<LeaseState>)> {
        let mut registry = self.registry.lock();
        let Registry { entries, due, .. } = &mut *registry;
        let mut batch = Vec::new();
        let mut ended = Vec::new();
        for &(at, id) in due.iter() {
            let Some(entry) = entries.get(&id) else {
                continue;
            };
            if at > now + entry.lease.ttl() / 12 {
                break;
            }
            if entry.state.state.load(Ordering::Acquire) == HELD_STATE {
                batch.push((at, id));
            } else {
                ended.push((at, id));
            }
        }
        for key in &ended {
            due.remove(key);
            entries.remove(&key.1);
        }
        batch
            .into_iter()
            .filter_map(|key| {
                due.remove(&key);
                let entry = entries.get(&key.1)?;
                Some((key.1, entry.lease.clone(), entry.state.clone()))
            })
            .collect()
    }

    fn reschedule(&self, id: u64, due: Instant) {
        let mut registry = self.registry.lock();
        if let Some(entry) = registry.entries.get_mut(&id) {
            entry.due = due;
            registry.due.insert((due, id));
        }
    }

    /// Renews every due lease with one `renew_many` call.
    async fn renew_due(&self) {
        let sent = Instant::now();
        let batch = self.take_due(sent);
        if batch.is_empty() {
            return;
        }
        let leases: Vec<Lease> = batch.iter().map(|(_, lease, _)| lease.clone()).collect();
        let deadline = batch
            .iter()
            .map(|(_, _, state)| state.valid_until())
            .min()
            .unwrap_or(sent);
        let result = timeout_at(deadline, self.backend.renew_many(&leases)).await;
        let now = Instant::now();
        match result {
            Ok(Ok(renewals)) if renewals.len() == batch.len() => {
                for ((id, lease, state), renewal) in batch.into_iter().zip(renewals) {
                    match renewal {
                        Renewal::Renewed { valid_until } => {
                            state.extend(valid_until);
                            self.reschedule(id, sent + self.interval(lease.ttl()));
                        }
                        Renewal::Lost => {
                            state.mark_lost();
                            self.unregister(id);
                        }
                        Renewal::Unreachable => self.retry_later(id, &lease, &state, now),
                    }
                }
            }
            other => {
                let why = match other {
                    Ok(Ok(r)) => format!("{} replies for {} leases", r.len(), leases.len()),
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "no reply before the earliest lease ran out".into(),
                };
                warn!(backend = self.backend.name(), leases = leases.len(), error = %why, "renewal failed; retrying until the leases run out");
                for (id, lease, state) in batch {
                    self.retry_later(id, &lease, &state, now);
                }
            }
        }
    }

    /// After a transient failure: try again soon, or give the lease up once its local
    /// deadline has passed.
    fn retry_later(&self, id: u64, lease: &Lease, state: &LeaseState, now: Instant) {
        let valid_until = state.valid_until();
        if now >= valid_until {
            state.mark_lost();
            self.unregister(id);
        } else {
            let retry = (self.interval(lease.ttl()) / 4).min(Duration::from_millis(500));
            self.reschedule(id, (now + retry).min(valid_until));
        }
    }
}

/// The renewal task: sleeps until the next lease is due (or a new one is registered),
/// renews, and ends once the watchdog is dropped.
async fn run(watchdog: Weak<Watchdog>) {
    loop {
        let (wake, next) = match watchdog.upgrade() {
            Some(w) => (w.wake.clone(), w.next_due()),
            None => return,
        };
        let sleep_for = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            () = wake.notified() => continue,
            () = sleep_until(sleep_for) => {}
        }
        match watchdog.upgrade() {
            Some(w) => w.renew_due().await,
            None => return,
        }
    }
}
