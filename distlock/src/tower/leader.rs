//! [`LeaderLayer`]: a scheduled job runs only in the process that leads its role.
//!
//! Every instance of a cron worker fires every tick; wrapped in a [`LeaderLayer`], only the
//! instance whose [`Election`] leads runs it, with the leadership's fencing token in the
//! [`Locked`] request, under [`LeaseStatus::while_held`](distlock_core::LeaseStatus::while_held):
//! a leadership lost while the tick runs stops it before its next step
//! ([`JobError::Lost`]). The others answer `Ok(None)` at once and count the skip in
//! `distlock_ticks_skipped_total`. The layer campaigns in a task of its own for as long as
//! it or a service made from it lives, campaigns again after a loss, and gives the role
//! up when the last of them is dropped, so that a standby takes over at once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use distlock_core::{Election, FencingToken, LeaseStatus, LockError, LockKey};
use tower_layer::Layer;
use tower_service::Service;
use tracing::warn;

use super::job::{JOB_LOST_TOTAL, JobError, Locked};

/// The counter of ticks an instance skipped because another one leads.
pub const TICKS_SKIPPED_TOTAL: &str = "distlock_ticks_skipped_total";

/// How long the campaign waits after an error its election could not retry.
const CAMPAIGN_PAUSE: Duration = Duration::from_secs(1);

/// The leadership this process holds now, if any: its token and status.
type Current = Arc<Mutex<Option<(FencingToken, LeaseStatus)>>>;

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
/// the last of them is dropped, so that a standby, woken by the release, takes over at
/// once.
#[derive(Clone)]
pub struct LeaderLayer {
    leading: Arc<Leading>,
}

/// The campaign task and what it found; the task ends with the last layer or service.
struct Leading {
    role: String,
    key: LockKey,
    current: Current,
    campaign: tokio::task::AbortHandle,
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
        let current = Current::default();
        let role = election.role().to_owned();
        let key = election.key().clone();
        let campaign = runtime.spawn(campaign(election, current.clone()));
        Ok(Self {
            leading: Arc::new(Leading {
                role,
                key,
                current,
                campaign: campaign.abort_handle(),
            }),
        })
    }

    /// Whether this process leads the role now (as far as its lease's local deadline
    /// tells).
    pub fn is_leading(&self) -> bool {
        self.leading.now().is_some()
    }
}

impl Leading {
    /// The leadership held now, if its lease still holds.
    fn now(&self) -> Option<(FencingToken, LeaseStatus)> {
        let current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        current.filter(|(_, status)| status.is_held())
    }
}

/// Campaigns, holds the role until the lease is lost, and campaigns again.
async fn campaign(election: Election, current: Current) {
    let set = |value| {
        *current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = value;
    };
    loop {
        match election.campaign().await {
            Ok(leadership) => {
                set(Some((leadership.token(), leadership.status())));
                leadership.lost().await;
                set(None);
            }
            Err(error) => {
                warn!(role = election.role(), %error, "campaign failed; campaigning again");
                tokio::time::sleep(CAMPAIGN_PAUSE).await;
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
    S: Service<Locked<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Send,
    S::Error: Send,
    R: Send + 'static,
{
    type Response = Option<S::Response>;
    type Error = JobError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    /// Always ready: the inner service is made ready only in the process that leads.
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    /// # Cancel safety
    /// Dropping the future stops the tick; the leadership stays.
    fn call(&mut self, request: R) -> Self::Future {
        let Some((token, status)) = self.leading.now() else {
            metrics::counter!(TICKS_SKIPPED_TOTAL, "role" => self.leading.role.clone())
                .increment(1);
            return Box::pin(std::future::ready(Ok(None)));
        };
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let key = self.leading.key.clone();
        let locked = Locked {
            request,
            token,
            status: status.clone(),
        };
        Box::pin(async move {
            let tick = async move {
                std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                inner.call(locked).await
            };
            match status.while_held(tick).await {
                Ok(done) => done.map(Some).map_err(JobError::Job),
                Err(_) => {
                    metrics::counter!(JOB_LOST_TOTAL).increment(1);
                    Err(JobError::Lost { key })
                }
            }
        })
    }
}
