//! A full semaphore across a restart of its store's server: what the store kept stays its
//! holders', what it lost its holders hear of at their next renewal, and a waiter gets a
//! permit only when one is free.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    BackendLayer, Layered, Lease, LockBackend, LockError, LockKey, Release, Renewal, RetryPolicy,
    Semaphore,
};
use parking_lot::Mutex;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout_at};

use super::locker::locker_on;
use super::server_faults::{RECOVERY_GRACE, until_answered};
use super::token_above;
use super::wake::WOKEN_WITHIN;
use crate::factory::Factory;
use crate::history::{Op, Reply};
use crate::support::{Ctx, Failure, Outcome, fit_ttl};

/// Permits of the semaphore: more than one, so a store that keeps some of them and loses
/// others shows.
const PERMITS: u32 = 3;
/// The TTL the holders and the waiter ask for: it outlives the restart and the reconnect
/// window, so a permit the store kept is still held when its holder renews again, and
/// only a restart that lost it or a release frees a slot.
const HOLD: Duration = Duration::from_secs(30);
/// How often each holder renews its permit.
const RENEW_EVERY: Duration = Duration::from_millis(250);
/// The waiter's backoff, its first and longest: with or without a wake (a restart ends
/// the subscriptions a wake comes by), it asks again at least this often.
const WAITER_BACKOFF: Duration = Duration::from_secs(1);

/// A semaphore of 3 permits is full (3 holders on clients of their own, each renewing
/// every 250 ms) and a waiter waits in `Semaphore::acquire` when the store's server is
/// killed and started again.
///
/// - Before the restart, the waiter's attempt is refused and it holds nothing. From the
///   kill until every holder has had an answer from the restarted store, the waiter's
///   attempts are held at its client: a waiter that asked first could take a slot the
///   store kept (a bug) and leave its holder told `Lost`, which would look like a slot the
///   restart lost.
/// - After it, each holder's first renewal answered is `Renewed` (the store kept the
///   permit) or `Lost` (the restart lost it); a holder told `Lost` is never told `Renewed`
///   for it again.
/// - Where the store kept every permit: the waiter's attempts on the recovered store are
///   refused and it is not granted while all 3 are held and renewed; once one holder
///   releases, it holds that slot within its backoff (1 s) plus the suite's handoff
///   allowance (1.5 s) plus the longest refused attempt it was measured to
///   take after the restart, with a token above the released one's. The history is
///   checked without the fault allowance, so the checker counts the permits (I6: never
///   more than 3 at once) and each slot's windows (I3) across the restart.
/// - Where the store lost permits (a server without persistence, session-level locks):
///   the waiter is granted one of the lost slots only, never one a holder still renews,
///   with a token above that slot's old one, and that slot's old holder renewing after the
///   grant is told `Lost`. As in [`super::restart_leaves_old_holder_fenced`], the history
///   is then checked with the fault allowance: a holder of a lost permit believes it held
///   until its next renewal, so what keeps it from acting beside the waiter is that
///   renewal and the slot's fencing token, which are what this checks.
pub async fn a_full_semaphore_keeps_its_permits_across_a_restart(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let mut ctx = Ctx::new(
        "a_full_semaphore_keeps_its_permits_across_a_restart",
        factory,
    );
    let server = ctx.server()?;
    let (gate, open) = watch::channel(true);
    let waiter_client: Arc<dyn LockBackend> =
        Arc::new(Layered::new(ctx.client().await, Gate(open)));
    let t = ctx.timing(&waiter_client);
    let hold = fit_ttl(&waiter_client.capabilities(), HOLD);
    let waiter_retry = RetryPolicy {
        initial: WAITER_BACKOFF,
        max: WAITER_BACKOFF,
    };
    let waiter_locker = locker_on(&ctx, waiter_client, hold, waiter_retry, None)?;
    let semaphore = ctx.semaphore(&waiter_locker, "full", PERMITS)?;
    let slots: Vec<LockKey> = semaphore.slots().to_vec();

    let mut holders = Vec::new();
    for _ in 0..PERMITS {
        let client = ctx.client().await;
        let lease = ctx.ok("acquire_any", client.acquire_any(&slots, hold).await)?;
        let lease = lease.ok_or_else(|| {
            ctx.fail(
                format!(
                    "a free permit while {} of {PERMITS} are held",
                    holders.len()
                ),
                "Ok(None)",
            )
        })?;
        holders.push(Holder::renewing(client, lease));
    }

    let (waiter, mut granted) = Waiter::start(semaphore);
    let started = Instant::now();
    refused_since(
        &ctx,
        &slots,
        &granted,
        started,
        started + WAITER_BACKOFF + WOKEN_WITHIN,
        "before the restart",
    )
    .await?;

    gate.send_replace(false);
    server.kill().await;
    // A renewal sent from here on is answered by the server started again, which may
    // answer before `restart` returns (while it waits for the deployment to settle).
    let killed = Instant::now();
    server.restart().await;
    let restarted = Instant::now();

    let mut kept = Vec::new();
    let mut lost = Vec::new();
    for holder in holders {
        match holder.first_answer_since(&ctx, killed, restarted).await? {
            Renewal::Renewed { .. } => kept.push(holder),
            _ => lost.push(holder),
        }
    }
    gate.send_replace(true);
    let opened = Instant::now();
    if lost.is_empty() {
        let longest = refused_since(
            &ctx,
            &slots,
            &granted,
            opened,
            opened + WAITER_BACKOFF + RECOVERY_GRACE,
            "after the restart, every permit still held and renewed",
        )
        .await?;
        for holder in &kept {
            holder.never_lost(&ctx, "the store kept every permit")?;
        }
        let first = kept.remove(0);
        first.stop().await;
        let released_at = Instant::now();
        let released = until_answered(
            &ctx,
            "the release of a kept permit",
            released_at + RECOVERY_GRACE,
            || first.client.release(&first.lease),
        )
        .await?;
        ctx.ensure(
            released == Release::Released,
            "the release of a permit the store kept to be Released",
            || format!("{released:?}"),
        )?;
        let within = WAITER_BACKOFF + WOKEN_WITHIN + longest;
        let grant = granted_by(&ctx, &mut granted, released_at + within, || {
            format!(
                "the waiter to hold the released permit within {within:?} of the release \
                 (its backoff {WAITER_BACKOFF:?}, a handoff {WOKEN_WITHIN:?}, its longest \
                 refused attempt after the restart {longest:?})"
            )
        })
        .await?;
        ctx.ensure(
            &grant.key == first.lease.key(),
            format!("the waiter to get the released slot {}", first.lease.key()),
            || grant.key.clone(),
        )?;
        token_above(
            &ctx,
            &grant.lease,
            first.lease.token(),
            format!(
                "the waiter's token above the released permit's {}",
                first.lease.token()
            ),
        )?;
    } else {
        // A holder of a lost permit believed it held until its renewal said Lost: the
        // clients' windows overlap the waiter's, which the fault allowance admits.
        ctx.with_faults();
        let grant = granted_by(
            &ctx,
            &mut granted,
            opened + RECOVERY_GRACE + WAITER_BACKOFF,
            || "the waiter to hold one of the permits the restart lost".to_owned(),
        )
        .await?;
        let old = lost
            .iter()
            .find(|h| h.lease.key() == &grant.key)
            .ok_or_else(|| {
                let lost: Vec<&LockKey> = lost.iter().map(|h| h.lease.key()).collect();
                ctx.fail(
                    format!("the waiter's permit to be one the restart lost, on {lost:?}"),
                    &grant.key,
                )
            })?;
        token_above(
            &ctx,
            &grant.lease,
            old.lease.token(),
            format!(
                "the waiter's token above the lost permit's {}",
                old.lease.token()
            ),
        )?;
        for holder in &lost {
            let deadline = Instant::now() + RECOVERY_GRACE;
            let renewal = until_answered(&ctx, "a lost permit's renewal", deadline, || {
                holder.client.renew(&holder.lease)
            })
            .await?;
            ctx.ensure(
                renewal == Renewal::Lost,
                format!(
                    "the renewal of the permit on {} the restart lost to stay Lost",
                    holder.lease.key()
                ),
                || format!("{renewal:?}"),
            )?;
        }
        for holder in &kept {
            holder.never_lost(&ctx, "the store kept this permit")?;
        }
    }

    for holder in kept {
        holder.stop().await;
        let deadline = Instant::now() + RECOVERY_GRACE;
        let released = until_answered(&ctx, "the release of a kept permit", deadline, || {
            holder.client.release(&holder.lease)
        })
        .await?;
        ctx.ensure(
            released == Release::Released,
            "the release of a permit still held to be Released",
            || format!("{released:?}"),
        )?;
    }
    for holder in lost {
        holder.stop().await;
    }
    let released = waiter.release(&ctx).await?;
    super::guard_released(&ctx, released)?;
    ctx.pass(&t)
}

/// A layer that holds a client's attempts at permits (`acquire_any`) while its gate is
/// closed (`false`), as a slow link would; the rest passes through.
#[derive(Debug)]
struct Gate(watch::Receiver<bool>);

#[async_trait]
impl BackendLayer for Gate {
    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        // A gate whose case ended (its sender dropped) is open.
        let _ = self.0.clone().wait_for(|open| *open).await;
        next.acquire_any(keys, ttl).await
    }
}

/// One renewal a holder sent, and its answer (an error as its text).
#[derive(Clone, Debug)]
struct Answer {
    sent: Instant,
    renewal: Result<Renewal, String>,
}

/// A holder's renewals: those answered, and when the one in flight was sent.
#[derive(Default)]
struct Renewals {
    answered: Vec<Answer>,
    in_flight: Option<Instant>,
}

/// A holder of one permit, renewing it every [`RENEW_EVERY`] in a task of its own until
/// stopped or told `Lost`.
struct Holder {
    client: Arc<dyn LockBackend>,
    lease: Lease,
    renewals: Arc<Mutex<Renewals>>,
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Holder {
    fn renewing(client: Arc<dyn LockBackend>, lease: Lease) -> Self {
        let renewals = Arc::new(Mutex::new(Renewals::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (client, lease) = (client.clone(), lease.clone());
            let (renewals, stop) = (renewals.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let sent = Instant::now();
                    renewals.lock().in_flight = Some(sent);
                    let renewal = client.renew(&lease).await.map_err(|e| e.to_string());
                    let lost = renewal == Ok(Renewal::Lost);
                    {
                        let mut renewals = renewals.lock();
                        renewals.in_flight = None;
                        renewals.answered.push(Answer { sent, renewal });
                    }
                    if lost {
                        return;
                    }
                    sleep(RENEW_EVERY).await;
                }
            })
        };
        Self {
            client,
            lease,
            renewals,
            stop,
            task,
        }
    }

    /// The first `Renewed` or `Lost` answer to a renewal sent at or after `since` (the
    /// kill), waited for until [`RECOVERY_GRACE`] after `restarted` (errors and
    /// `Unreachable` are the reconnect window).
    async fn first_answer_since(
        &self,
        ctx: &Ctx<'_>,
        since: Instant,
        restarted: Instant,
    ) -> Result<Renewal, Failure> {
        let deadline = restarted + RECOVERY_GRACE;
        loop {
            let answered = self
                .renewals
                .lock()
                .answered
                .iter()
                .filter(|a| a.sent >= since)
                .find_map(|a| match a.renewal {
                    Ok(r @ (Renewal::Renewed { .. } | Renewal::Lost)) => Some(r),
                    _ => None,
                });
            if let Some(renewal) = answered {
                return Ok(renewal);
            }
            if Instant::now() >= deadline {
                return Err(ctx.fail(
                    format!(
                        "the renewal of the permit on {} to be answered Renewed or Lost \
                         within {RECOVERY_GRACE:?} of the restart",
                        self.lease.key()
                    ),
                    self.since(since),
                ));
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// The renewals sent at or after `since` (answered, or one in flight since before it),
    /// for a failure.
    fn since(&self, since: Instant) -> String {
        let renewals = self.renewals.lock();
        let at = |sent: Instant| sent.saturating_duration_since(since);
        let mut listed: Vec<String> = renewals
            .answered
            .iter()
            .filter(|a| a.sent >= since)
            .map(|a| format!("sent +{:?}: {:?}", at(a.sent), a.renewal))
            .collect();
        match renewals.in_flight {
            Some(sent) if sent >= since => {
                listed.push(format!("sent +{:?}: unanswered", at(sent)));
            }
            Some(sent) => listed.push(format!(
                "one sent {:?} before the kill unanswered",
                since - sent
            )),
            None => {}
        }
        if listed.is_empty() {
            "no renewal sent".to_owned()
        } else {
            listed.join("; ")
        }
    }

    /// Fails if any renewal of this holder was answered `Lost` (`why` it must not be).
    fn never_lost(&self, ctx: &Ctx<'_>, why: &str) -> Result<(), Failure> {
        let renewals = self.renewals.lock();
        let lost = renewals
            .answered
            .iter()
            .find(|a| a.renewal == Ok(Renewal::Lost));
        ctx.ensure(
            lost.is_none(),
            format!(
                "every renewal of the permit on {} to be Renewed ({why})",
                self.lease.key()
            ),
            || format!("Lost, sent at {:?}", lost.map(|a| a.sent)),
        )
    }

    /// Stops the renewals and waits for the last one (a task left running by a failed
    /// case is aborted when its holder is dropped).
    async fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        while !self.task.is_finished() {
            sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the waiter was granted: its permit's lease and slot key.
#[derive(Clone, Debug)]
struct Grant {
    lease: Lease,
    key: LockKey,
}

/// A waiter in `Semaphore::acquire` in a task of its own, which holds the permit it gets
/// until told to release it.
struct Waiter {
    release: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<Release, LockError>>,
}

impl Waiter {
    /// Starts waiting; the receiver shows the grant once there is one.
    fn start(semaphore: Semaphore) -> (Self, watch::Receiver<Option<Grant>>) {
        let (grant_tx, grant_rx) = watch::channel(None);
        let (release, release_rx) = oneshot::channel();
        let task = tokio::spawn(async move {
            // An error the locker does not retry (a connection the restart ended) is the
            // reconnect window: the case's deadlines bound the wait.
            let permit = loop {
                match semaphore.acquire().await {
                    Ok(permit) => break permit,
                    Err(_) => sleep(WAITER_BACKOFF).await,
                }
            };
            let grant = Grant {
                lease: permit.guard().lease().clone(),
                key: permit.key().clone(),
            };
            grant_tx.send_replace(Some(grant));
            let _ = release_rx.await;
            permit.release().await
        });
        (
            Self {
                release: Some(release),
                task,
            },
            grant_rx,
        )
    }

    /// Releases the permit it holds and returns the release's answer.
    async fn release(mut self, ctx: &Ctx<'_>) -> Result<Result<Release, LockError>, Failure> {
        if let Some(release) = self.release.take() {
            let _ = release.send(());
        }
        (&mut self.task)
            .await
            .map_err(|e| ctx.fail("the waiting task to finish", e))
    }
}

/// A waiter left waiting by a failed case stops with it.
impl Drop for Waiter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits until the history shows an attempt of the waiter on `slots` sent at or after
/// `since` and refused (every slot held), failing if the waiter is granted first or none
/// is refused by `deadline`; returns the longest such refused attempt's round trip.
async fn refused_since(
    ctx: &Ctx<'_>,
    slots: &[LockKey],
    granted: &watch::Receiver<Option<Grant>>,
    since: Instant,
    deadline: Instant,
    when: &str,
) -> Result<Duration, Failure> {
    loop {
        if let Some(grant) = granted.borrow().clone() {
            return Err(ctx.fail(
                format!(
                    "the waiter not to be granted a permit while all {PERMITS} are held ({when})"
                ),
                format!(
                    "a permit on {} with token {}",
                    grant.key,
                    grant.lease.token()
                ),
            ));
        }
        let longest = ctx
            .history()
            .events()
            .iter()
            .filter(|e| {
                e.op == Op::Acquire
                    && e.reply == Reply::Busy
                    && e.invoked >= since
                    && slots.contains(&e.key)
            })
            .map(|e| e.completed - e.invoked)
            .max();
        if let Some(longest) = longest {
            return Ok(longest);
        }
        if Instant::now() >= deadline {
            return Err(ctx.fail(
                format!("an attempt of the waiter refused ({when})"),
                "no refused attempt recorded",
            ));
        }
        sleep(Duration::from_millis(20)).await;
    }
}

/// The waiter's grant, waited for until `deadline`; `expected` says what failed.
async fn granted_by(
    ctx: &Ctx<'_>,
    granted: &mut watch::Receiver<Option<Grant>>,
    deadline: Instant,
    expected: impl FnOnce() -> String,
) -> Result<Grant, Failure> {
    match timeout_at(deadline, granted.wait_for(Option::is_some)).await {
        Ok(Ok(grant)) => Ok(grant.clone().expect("waited for a grant")),
        Ok(Err(_)) => Err(ctx.fail(expected(), "the waiting task ended without a permit")),
        Err(_) => Err(ctx.fail(expected(), "no permit by then")),
    }
}
