//! [`LeaderLayer`]: a scheduled job runs only in the process that leads its role.
//!
//! Every instance of a cron worker fires every tick; wrapped in a [`LeaderLayer`], only the
//! instance whose [`Election`] leads runs it, with the leadership's fencing token in the
//! [`Locked`] request, under [`LeaseStatus::while_held`](distlock_core::LeaseStatus::while_held):
//! a leadership lost while the tick runs stops it before its next step
//! ([`JobError::Lost`]). The others answer `Ok(None)` at once and count the skip in
//! `distlock_ticks_skipped_total`. The layer campaigns in a task of its own for as long as
//! it or a service made from it lives, campaigns again after a loss, and gives the role
//! up when the last of them is dropped or [`LeaderLayer::resign`] is called, so that a
//! standby takes over at once. Where leadership moves between instances whose clocks
//! disagree, [`TickLayer`](super::TickLayer) runs each tick once rather than once per
//! leadership.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use distlock_core::{Election, FencingToken, LeaseStatus, LockError, LockKey};
use tokio::sync::watch;
use tower_layer::Layer;
use tower_service::Service;
use tracing::warn;

use super::job::{JOB_LOST_TOTAL, JobError};
use super::locked_service::Locked;
use super::locked_service::LockedService;

/// The counter of ticks an instance skipped because another one leads.
pub const TICKS_SKIPPED_TOTAL: &str = "distlock_ticks_skipped_total";

/// How long the campaign waits after an error its election could not retry.
const CAMPAIGN_PAUSE: Duration = Duration::from_secs(1);

/// The leadership this process holds now, if any: its token and status. The campaign
/// task sends each change; [`TickLayer`](super::TickLayer) watches for elections.
pub(super) type Current = watch::Sender<Option<(FencingToken, LeaseStatus)>>;

/// Runs the inner service only while this process leads the election's role.
///
/// Every instance of a cron worker fires every tick; wrapped in a `LeaderLayer`, only the
/// instance whose [`Election`] leads runs it, with the leadership's fencing token in the
/// [`Locked`] request, under
/// [`LeaseStatus::while_held`](distlock_core::LeaseStatus::while_held): a leadership lost
/// while the tick runs stops it before its next step ([`JobError::Lost`]). The others
/// answer `Ok(None)` at once and count the skip in `distlock_ticks_skipped_total`
/// ([`TICKS_SKIPPED_TOTAL`]). The layer campaigns in a task of its own for as long as it or
/// a service made from it lives, campaigns again after a loss, and gives the role up when
/// the last of them is dropped or [`LeaderLayer::resign`] is called, so that a standby,
/// woken by the release, takes over at once.
///
/// It runs a tick once per *leadership*: when the role moves between instances whose
/// clocks disagree, a tick can run in both (the new leader's clock is behind) or in
/// neither (it is ahead). [`TickLayer`](super::TickLayer), built on it, runs each tick
/// once.
#[derive(Clone)]
pub struct LeaderLayer {
    pub(super) leading: Arc<Leading>,
}

/// The campaign task and what it found; the task ends with the last layer or service.
pub(super) struct Leading {
    pub(super) role: String,
    pub(super) key: LockKey,
    pub(super) current: Arc<Current>,
    campaign: tokio::task::AbortHandle,
    /// Set by [`LeaderLayer::resign`]: the campaign gives the role up and ends.
    stop: watch::Sender<bool>,
    /// The campaign task, for [`LeaderLayer::resign`] to wait for.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Leading {
    fn drop(&mut self) {
        // Dropping the task's leadership releases it, which wakes a standby.
        self.campaign.abort();
    }
}

impl fmt::Debug for LeaderLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderLayer")
            .field("role", &self.leading.role)
            .field("leading", &self.is_leading())
            .finish()
    }
}

impl LeaderLayer {
    /// Starts campaigning for `election`'s role in a task on the current tokio runtime;
    /// [`LockError::Config`] outside one.
    pub fn new(election: Election) -> Result<Self, LockError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::Config(
                "a LeaderLayer campaigns in a task: build it inside a tokio runtime".into(),
            )
        })?;
        let current = Arc::new(Current::new(None));
        let role = election.role().to_owned();
        let key = election.key().clone();
        let (stop, stopped) = watch::channel(false);
        let campaign = runtime.spawn(campaign(election, current.clone(), stopped));
        Ok(Self {
            leading: Arc::new(Leading {
                role,
                key,
                current,
                campaign: campaign.abort_handle(),
                stop,
                task: Mutex::new(Some(campaign)),
            }),
        })
    }

    /// Gives the role up now and stops campaigning, for a graceful shutdown (one instance
    /// of a rolling deploy): the lease is released in the store, so a standby, woken by the
    /// release, leads at once instead of a TTL later. From then on the services made from
    /// this layer answer `Ok(None)`. A second call returns at once.
    ///
    /// # Cancel safety
    /// Cancel safe: the campaign task resigns whether or not this future is polled to the
    /// end; dropping it only stops waiting for the release. Dropping the layer (its last
    /// service too) before the release is done stops the campaign task with it, and the
    /// role then runs out at its TTL: await this call before dropping the layer.
    pub async fn resign(&self) {
        self.leading.stop.send_replace(true);
        let task = self
            .leading
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Whether this process leads the role now (as far as its lease's local deadline
    /// tells).
    pub fn is_leading(&self) -> bool {
        self.leading.now().is_some()
    }
}

impl Leading {
    /// The leadership held now, if its lease still holds.
    pub(super) fn now(&self) -> Option<(FencingToken, LeaseStatus)> {
        self.current
            .borrow()
            .clone()
            .filter(|(_, status)| status.is_held())
    }
}

/// Campaigns, holds the role until the lease is lost, and campaigns again; gives the role
/// up and ends once `stop` is set.
async fn campaign(election: Election, current: Arc<Current>, mut stop: watch::Receiver<bool>) {
    loop {
        let elected = tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return,
            elected = election.campaign() => elected,
        };
        match elected {
            Ok(leadership) => {
                current.send_replace(Some((leadership.token(), leadership.status())));
                let resign = tokio::select! {
                    () = leadership.lost() => false,
                    _ = stop.wait_for(|stop| *stop) => true,
                };
                current.send_replace(None);
                if resign {
                    if let Err(error) = leadership.resign().await {
                        warn!(role = election.role(), %error, "resigning failed; the lease runs out on its own");
                    }
                    return;
                }
            }
            Err(error) => {
                warn!(role = election.role(), %error, "campaign failed; campaigning again");
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return,
                    () = tokio::time::sleep(CAMPAIGN_PAUSE) => {}
                }
            }
        }
    }
}

impl<S> Layer<S> for LeaderLayer {
    type Service = LeaderService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LeaderService {
            inner,
            leading: self.leading.clone(),
        }
    }
}

/// The service [`LeaderLayer`] makes: `Ok(Some(response))` where this process leads,
/// `Ok(None)` where another does.
#[derive(Clone)]
pub struct LeaderService<S> {
    inner: S,
    leading: Arc<Leading>,
}

impl<S: fmt::Debug> fmt::Debug for LeaderService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderService")
            .field("inner", &self.inner)
            .field("role", &self.leading.role)
            .finish()
    }
}

impl<S, R> Service<R> for LeaderService<S>
where
    S: LockedService<R>,
    R: Send + 'static,
{
    type Response = Option<S::Response>;
    type Error = JobError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    /// While this process leads, the inner service's readiness (its error is
    /// [`JobError::Job`]): a leader whose inner service is at capacity (a concurrency or
    /// rate limit, a `Buffer`) is not ready, so the scheduler in front of it waits instead
    /// of handing it a tick that would wait inside. Where another process leads, ready at
    /// once: the call answers `Ok(None)` without the inner service.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        poll_ready_while_leading(&self.leading, &mut self.inner, cx)
    }

    /// # Cancel safety
    /// Dropping the future stops the tick; the leadership stays.
    fn call(&mut self, request: R) -> Self::Future {
        let Some((token, status)) = self.leading.now() else {
            // The clone `poll_ready` may have made ready (while this process led) is
            // dropped: a standby holds none of the inner service's capacity.
            self.inner = self.inner.clone();
            skipped(&self.leading.role);
            return Box::pin(std::future::ready(Ok(None)));
        };
        // The clone that was made ready is the one called (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let key = self.leading.key.clone();
        Box::pin(async move { run_tick(inner, request, token, status, key).await.map(Some) })
    }
}

/// [`LeaderService::poll_ready`]: the inner service's readiness while leading, ready
/// otherwise.
pub(super) fn poll_ready_while_leading<S, Q>(
    leading: &Leading,
    inner: &mut S,
    cx: &mut Context<'_>,
) -> Poll<Result<(), JobError<S::Error>>>
where
    S: Service<Q>,
{
    if leading.now().is_some() {
        inner.poll_ready(cx).map_err(JobError::Job)
    } else {
        Poll::Ready(Ok(()))
    }
}

/// Counts a tick this process did not run.
pub(super) fn skipped(role: &str) {
    metrics::counter!(TICKS_SKIPPED_TOTAL, "role" => role.to_owned()).increment(1);
}

/// Runs one tick in `inner` under the leadership (`token`, `status`): made ready first
/// (at once where `poll_ready` already made it so), stopped before its next step once the
/// leadership is lost.
pub(super) async fn run_tick<S, R>(
    mut inner: S,
    request: R,
    token: FencingToken,
    status: LeaseStatus,
    key: LockKey,
) -> Result<S::Response, JobError<S::Error>>
where
    S: Service<Locked<R>>,
{
    let locked = Locked::tick(request, key.clone(), token, status.clone());
    let tick = async move {
        std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
        inner.call(locked).await
    };
    match status.while_held(tick).await {
        Ok(done) => done.map_err(JobError::Job),
        Err(_) => {
            metrics::counter!(JOB_LOST_TOTAL).increment(1);
            Err(JobError::Lost { key })
        }
    }
}

// On a redis-server: built where the facade opens redis:// URLs.
#[cfg(all(test, feature = "redis"))]
mod tests;
