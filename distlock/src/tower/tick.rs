//! [`TickLayer`]: each tick of a schedule runs once across instances, however their clocks
//! disagree and however leadership moves.
//!
//! [`LeaderLayer`] alone runs a tick once per *leadership*: each instance fires a tick when
//! its own clock reaches it, so when the role moves (a deploy, a crash, a pause) between
//! instances whose clocks disagree by more than the hand-over takes, the tick at the
//! hand-over runs twice (the new leader's clock is behind: it fires the tick the old
//! leader ran) or not at all (it is ahead: it fired the tick, as a standby, before the old
//! leader would have).
//!
//! A `TickLayer` keys each run by the tick's *nominal* fire time, which every instance
//! agrees on whatever its clock, and claims it in the lock store before running it: the
//! claim is a lease on `<election key>:tick:<schedule>:<fire time in ms>`, taken with the
//! retention TTL and never released, so for as long as it lasts no other instance can take
//! it and the tick never runs again. An instance that gains leadership runs at once the
//! latest tick its scheduler fired while it was a standby, if nobody claimed it and it is
//! at most the catch-up window old (Quartz's "fire once now" misfire policy): the tick
//! lost at a hand-over to a clock that is ahead runs, late by the hand-over.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use distlock_core::{FencingToken, Lease, LeaseStatus, LockBackend, LockError, LockKey, Locker};
use tower_layer::Layer;
use tower_service::Service;
use tracing::{debug, warn};

use super::job::JobError;
use super::leader::{LeaderLayer, Leading, poll_ready_while_leading, run_tick, skipped};
use super::locked_service::LockedService;

/// The counter of ticks a leader did not run because another instance had claimed them
/// (labelled `role`).
pub const TICKS_CLAIMED_ELSEWHERE_TOTAL: &str = "distlock_ticks_claimed_elsewhere_total";
/// The counter of ticks run late by an instance that gained leadership after its
/// scheduler fired them (labelled `role`).
pub const TICKS_CAUGHT_UP_TOTAL: &str = "distlock_ticks_caught_up_total";
/// The counter of ticks not run because they were older than the catch-up window when
/// their turn came (labelled `role`).
pub const TICKS_MISFIRED_TOTAL: &str = "distlock_ticks_misfired_total";

/// The default catch-up window: see [`TickLayerBuilder::catch_up`].
pub const DEFAULT_CATCH_UP: Duration = Duration::from_secs(60);
/// The default retention of a claim: see [`TickLayerBuilder::retention`].
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(600);

type FireTimeOf<R> = Arc<dyn Fn(&R) -> SystemTime + Send + Sync>;
type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A tick fired while this process did not lead: its fire time, and its run (the inner
/// service and the request, type-erased) for when it gains leadership.
struct Pending {
    fire: SystemTime,
    run: Box<dyn FnOnce(FencingToken, LeaseStatus) -> BoxFuture + Send>,
}

/// Builds a [`TickLayer`]; see [`TickLayer::builder`].
#[must_use]
pub struct TickLayerBuilder<R> {
    leader: LeaderLayer,
    claims: Locker,
    schedule: String,
    fire_time: FireTimeOf<R>,
    catch_up: Duration,
    retention: Duration,
}

impl<R> fmt::Debug for TickLayerBuilder<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TickLayerBuilder")
            .field("leader", &self.leader)
            .field("schedule", &self.schedule)
            .field("catch_up", &self.catch_up)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl<R> TickLayerBuilder<R> {
    /// How old a tick may be, by this process's clock, and still run: a tick a new leader
    /// catches up, or one its scheduler hands it late (after a pause). An older one is not
    /// run (counted in `distlock_ticks_misfired_total`). Default [`DEFAULT_CATCH_UP`].
    pub fn catch_up(mut self, window: Duration) -> Self {
        self.catch_up = window;
        self
    }

    /// How long a tick's claim stays in the store. It must outlast every attempt of
    /// another instance to run the tick: a tick runs at most `catch_up` after its fire
    /// time by the clock of the instance that runs it, so the claim holds as long as
    /// clocks disagree by less than `(retention - catch_up) / 2`. Default
    /// [`DEFAULT_RETENTION`].
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Checks the settings and starts the task that catches up a tick when this process
    /// gains leadership, on the current tokio runtime.
    ///
    /// Fails before anything is sent with [`LockError::Config`] for a `retention` not
    /// longer than `catch_up`, an empty schedule name, a store whose leases end with their
    /// owner's connection ([`Capabilities::session_bound`](distlock_core::Capabilities::session_bound):
    /// a claim must outlive the call) or that does not expire them on its own, or outside
    /// a tokio runtime; [`LockError::InvalidTtl`] for a retention the store cannot keep;
    /// [`LockError::InvalidKey`] when the claim keys would not be valid keys.
    pub fn build(self) -> Result<TickLayer<R>, LockError> {
        if self.schedule.is_empty() {
            return Err(LockError::Config(
                "a TickLayer's schedule name must not be empty".into(),
            ));
        }
        if self.retention <= self.catch_up {
            return Err(LockError::Config(format!(
                "a TickLayer's claim retention ({:?}) must be longer than its catch-up window ({:?})",
                self.retention, self.catch_up
            )));
        }
        let backend = self.claims.backend().clone();
        let capabilities = backend.capabilities();
        if capabilities.session_bound || !capabilities.server_side_ttl {
            return Err(LockError::Config(format!(
                "a TickLayer's claims must stay in the store after the call that took them and \
                 expire there: the {} store's leases do not",
                backend.name()
            )));
        }
        capabilities.check_ttl(self.retention)?;
        let prefix = format!("{}:tick:{}:", self.leader.leading.key, self.schedule);
        // The longest claim key there can be, checked once here.
        LockKey::new(format!("{prefix}{}", u128::MAX))?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config(
                "a TickLayer catches up in a task: build it inside a tokio runtime".into(),
            )
        })?;
        let ticks = Arc::new(Ticks {
            role: self.leader.leading.role.clone(),
            prefix,
            backend,
            catch_up: self.catch_up,
            retention: self.retention,
            pending: Mutex::new(None),
        });
        let catching_up = runtime.spawn(catch_up_on_election(
            ticks.clone(),
            self.leader.leading.current.subscribe(),
        ));
        Ok(TickLayer {
            leading: self.leader.leading.clone(),
            shared: Arc::new(Shared {
                ticks,
                fire_time: self.fire_time,
                catching_up: catching_up.abort_handle(),
            }),
        })
    }
}

/// Runs each tick of a schedule once across the instances of a scheduler, in the one that
/// leads, whatever their clocks and however leadership moves.
///
/// [`LeaderLayer`] alone runs a tick once per *leadership*: each instance fires a tick when
/// its own clock reaches it, so at a hand-over to an instance whose clock is behind the
/// tick runs twice, and to one whose clock is ahead it is lost. A `TickLayer` keys each run
/// by the tick's *nominal* fire time, which every instance agrees on, read from the request
/// by the `fire_time` it was given.
///
/// Every instance fires every tick into its `TickService`; where this process leads, the
/// service claims the tick and runs it only if the claim is taken, with the leadership's
/// token, under [`LeaseStatus::while_held`](distlock_core::LeaseStatus::while_held), as
/// [`LeaderLayer`] does. The claim is a lease on
/// `<election key>:tick:<schedule>:<fire time in ms>`, taken with the retention TTL and
/// never released: while it lasts no other instance takes it, and the tick never runs
/// again. A tick claimed by another instance, older than the catch-up window, or fired
/// where another instance leads answers `Ok(None)`. When this process gains leadership it
/// runs at once the latest tick it fired as a standby, if nobody claimed it and it is
/// within the catch-up window (Quartz's "fire once now" misfire policy): in the
/// background, its result logged.
///
/// A claim is taken before the tick runs and never released: a leader that crashes
/// while it runs a tick leaves it run at most once, not at least once. Ticks missed by
/// every instance (all down, or a leader crashed and replaced only after its TTL) are
/// caught up as one run of the latest, as Quartz's "fire once now" does.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::convert::Infallible;
/// use std::future::{Ready, ready};
/// use std::task::{Context, Poll};
/// use std::time::{Duration, SystemTime};
/// use distlock::tower::{LeaderLayer, Locked, TickLayer};
/// use distlock::{Election, Locker};
/// use tower_layer::Layer;
/// use tower_service::Service;
///
/// /// What the scheduler hands each instance: the tick's nominal fire time.
/// struct Tick(SystemTime);
///
/// #[derive(Clone)]
/// struct Report;
///
/// impl Service<Locked<Tick>> for Report {
///     type Response = ();
///     type Error = Infallible;
///     type Future = Ready<Result<(), Infallible>>;
///     fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
///         Poll::Ready(Ok(()))
///     }
///     fn call(&mut self, _tick: Locked<Tick>) -> Self::Future {
///         ready(Ok(())) // the report's writes carry _tick.token
///     }
/// }
///
/// let locker = Locker::builder(distlock::connect("memory://").await?)
///     .ttl(Duration::from_secs(10))
///     .build()?;
/// let leader = LeaderLayer::new(Election::new(locker.clone(), "reports")?)?;
/// let layer = TickLayer::builder(&leader, locker, "hourly", |tick: &Tick| tick.0)
///     .catch_up(Duration::from_secs(300))
///     .retention(Duration::from_secs(3600))
///     .build()?;
/// let mut service = layer.layer(Report);
/// while !leader.is_leading() {
///     tokio::time::sleep(Duration::from_millis(10)).await;
/// }
/// let fire = SystemTime::now();
/// assert_eq!(service.call(Tick(fire)).await?, Some(()), "claimed and run");
/// assert_eq!(service.call(Tick(fire)).await?, None, "the same tick again: claimed already");
/// leader.resign().await;
/// # Ok(()) }
/// ```
pub struct TickLayer<R> {
    leading: Arc<Leading>,
    shared: Arc<Shared<R>>,
}

impl<R> Clone for TickLayer<R> {
    fn clone(&self) -> Self {
        Self {
            leading: self.leading.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<R> fmt::Debug for TickLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TickLayer")
            .field("role", &self.leading.role)
            .field("claims", &self.shared.ticks.prefix)
            .field("catch_up", &self.shared.ticks.catch_up)
            .field("retention", &self.shared.ticks.retention)
            .finish_non_exhaustive()
    }
}

/// What the layer and its services share; the catch-up task ends with the last of them.
struct Shared<R> {
    ticks: Arc<Ticks>,
    fire_time: FireTimeOf<R>,
    catching_up: tokio::task::AbortHandle,
}

impl<R> Drop for Shared<R> {
    fn drop(&mut self) {
        self.catching_up.abort();
    }
}

/// The claims and the tick waiting for an election.
struct Ticks {
    role: String,
    /// `<election key>:tick:<schedule>:`; a claim key ends with the fire time in ms.
    prefix: String,
    backend: Arc<dyn LockBackend>,
    catch_up: Duration,
    retention: Duration,
    /// The latest tick fired while this process did not lead.
    pending: Mutex<Option<Pending>>,
}

/// Whether a tick may run now: within the catch-up window, and claimed by this call.
enum Claim {
    /// Claimed by this call: the claim's lease, to give back if the tick cannot run.
    Taken(Lease),
    Elsewhere,
    Misfired,
}

impl Ticks {
    /// Claims the tick of nominal time `fire` in the store, unless it is older than the
    /// catch-up window by this process's clock.
    async fn claim(&self, fire: SystemTime) -> Result<Claim, LockError> {
        let age = SystemTime::now()
            .duration_since(fire)
            .unwrap_or(Duration::ZERO);
        if age > self.catch_up {
            metrics::counter!(TICKS_MISFIRED_TOTAL, "role" => self.role.clone()).increment(1);
            return Ok(Claim::Misfired);
        }
        let millis = fire
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_err(|_| LockError::Config("a tick's fire time is before 1970".into()))?
            .as_millis();
        let key = LockKey::new(format!("{}{millis}", self.prefix))?;
        // The lease is dropped, never released: the claim stays until its TTL runs out.
        Ok(match self.backend.acquire(&key, self.retention).await? {
            Some(lease) => Claim::Taken(lease),
            None => {
                metrics::counter!(TICKS_CLAIMED_ELSEWHERE_TOTAL, "role" => self.role.clone())
                    .increment(1);
                Claim::Elsewhere
            }
        })
    }

    /// Whether a tick this call claimed may run under the leadership `status`: not when the
    /// leadership was lost while the claim was on its way, and its claim then goes back,
    /// so that the next leader catches the tick up instead of finding it claimed by a tick
    /// that never ran.
    async fn still_leading(&self, claim: &Lease, status: &LeaseStatus) -> bool {
        if status.is_held() {
            return true;
        }
        if let Err(error) = self.backend.release(claim).await {
            warn!(role = %self.role, %error, "giving back the claim of a tick not run failed");
        }
        false
    }

    /// Keeps `pending` as the tick to catch up, unless a later one is kept already.
    fn keep(&self, pending: Pending) {
        let mut slot = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_none_or(|kept| kept.fire <= pending.fire) {
            *slot = Some(pending);
        }
    }

    fn take(&self) -> Option<Pending> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Runs the kept tick, if any, under the leadership `(token, status)`: claimed first.
    async fn catch_up(&self, token: FencingToken, status: LeaseStatus) {
        let Some(pending) = self.take() else {
            return;
        };
        match self.claim(pending.fire).await {
            Ok(Claim::Taken(claim)) => {
                if !self.still_leading(&claim, &status).await {
                    return;
                }
                metrics::counter!(TICKS_CAUGHT_UP_TOTAL, "role" => self.role.clone()).increment(1);
                (pending.run)(token, status).await;
            }
            Ok(Claim::Elsewhere | Claim::Misfired) => {}
            Err(error) => {
                warn!(role = %self.role, %error, "claiming a tick to catch up failed; not run");
            }
        }
    }
}

/// Waits for each election of this process and catches up the tick kept while it did not
/// lead.
async fn catch_up_on_election(
    ticks: Arc<Ticks>,
    mut current: tokio::sync::watch::Receiver<Option<(FencingToken, LeaseStatus)>>,
) {
    while current.changed().await.is_ok() {
        let elected = current.borrow_and_update().clone();
        if let Some((token, status)) = elected {
            ticks.catch_up(token, status).await;
        }
    }
}

impl<R> TickLayer<R> {
    /// A layer that runs each tick of the schedule named `schedule` once, in the process
    /// that leads `leader`'s role; `claims` takes the ticks' claims (the store the
    /// election runs on, or any other one every instance shares); `fire_time` reads a
    /// tick's nominal fire time from the request (apalis-cron:
    /// `UNIX_EPOCH + Duration::from_secs(task.args.get_timestamp())`).
    pub fn builder(
        leader: &LeaderLayer,
        claims: Locker,
        schedule: &str,
        fire_time: impl Fn(&R) -> SystemTime + Send + Sync + 'static,
    ) -> TickLayerBuilder<R> {
        TickLayerBuilder {
            leader: leader.clone(),
            claims,
            schedule: schedule.to_owned(),
            fire_time: Arc::new(fire_time),
            catch_up: DEFAULT_CATCH_UP,
            retention: DEFAULT_RETENTION,
        }
    }
}

impl<S, R> Layer<S> for TickLayer<R> {
    type Service = TickService<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        TickService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`TickLayer`] makes: `Ok(Some(response))` for a tick this process claimed
/// and ran, `Ok(None)` for one another process leads or claimed.
pub struct TickService<S, R> {
    inner: S,
    layer: TickLayer<R>,
}

impl<S: Clone, R> Clone for TickService<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, R> fmt::Debug for TickService<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TickService")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, R> Service<R> for TickService<S, R>
where
    S: LockedService<R>,
    R: Send + 'static,
{
    type Response = Option<S::Response>;
    type Error = JobError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    /// As [`LeaderService::poll_ready`](super::LeaderService): the inner service's
    /// readiness while this process leads, ready at once otherwise.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        poll_ready_while_leading(&self.layer.leading, &mut self.inner, cx)
    }

    /// Where this process leads: claims the tick, then runs it (a store error while
    /// claiming is [`JobError::Lock`], and the tick does not run here: the claim may have
    /// been taken). Elsewhere: keeps the tick to catch up on an election and answers
    /// `Ok(None)`.
    ///
    /// # Cancel safety
    /// Dropping the future stops the tick; the leadership stays. Dropped while it claims,
    /// the claim may have been taken, and the tick then runs nowhere (at most once).
    fn call(&mut self, request: R) -> Self::Future {
        let fire = (self.layer.shared.fire_time)(&request);
        let ticks = self.layer.shared.ticks.clone();
        let key = self.layer.leading.key.clone();
        let Some((token, status)) = self.layer.leading.now() else {
            // A fresh clone is kept, made ready when it runs, and the one `poll_ready` may
            // have made ready (while this process led) is dropped: a standby holds none of
            // the inner service's capacity.
            let inner = self.inner.clone();
            self.inner = inner.clone();
            ticks.keep(Pending {
                fire,
                run: Box::new(move |token, status| {
                    Box::pin(async move {
                        match run_tick(inner, request, token, status, key).await {
                            Ok(_) => debug!("a caught-up tick ran"),
                            Err(JobError::Lost { key }) => {
                                warn!(%key, "a caught-up tick was stopped: the leadership was lost");
                            }
                            Err(_) => warn!("a caught-up tick failed"),
                        }
                    })
                }),
            });
            // Elected between the check and the keep: the election's catch-up may have
            // looked before the tick was kept, so it is caught up here.
            if let Some((token, status)) = self.layer.leading.now() {
                // In a task of its own, as the election's: the tick does not depend on
                // the caller polling this call to its end.
                let ticks = ticks.clone();
                let catch_up = async move { ticks.catch_up(token, status).await };
                return match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => {
                        runtime.spawn(catch_up);
                        Box::pin(std::future::ready(Ok(None)))
                    }
                    Err(_) => Box::pin(async move {
                        catch_up.await;
                        Ok(None)
                    }),
                };
            }
            skipped(&self.layer.leading.role);
            return Box::pin(std::future::ready(Ok(None)));
        };
        // The clone that was made ready is the one called (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            match ticks.claim(fire).await.map_err(JobError::Lock)? {
                Claim::Taken(claim) => {
                    if !ticks.still_leading(&claim, &status).await {
                        return Err(JobError::Lost { key });
                    }
                    run_tick(inner, request, token, status, key).await.map(Some)
                }
                Claim::Elsewhere | Claim::Misfired => {
                    debug!(role = %ticks.role, "tick claimed elsewhere or too old; not run");
                    skipped(&ticks.role);
                    Ok(None)
                }
            }
        })
    }
}

// On a redis-server: built where the facade opens redis:// URLs.
#[cfg(all(test, feature = "redis"))]
mod tests;
