//! Cases on [`Election`] over the backend: one leader at a time, hand-over after a resign,
//! loss after a pause, tokens increasing across leaders, and observation by `inspect`.
//!
//! Every campaigner has its own client and [`Locker`], as separate processes would, and
//! its side effects go through a [`crate::history::FencedCounter`], so the history check sees both the
//! leases (I1, I3: tokens increase, no two terms overlap) and the fenced writes (I2).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::{
    BackendLayer, Election, Fence, FencingToken, Layered, Leader, Leadership, Lease, LockBackend,
    LockError, LockInfo, LockKey, Locker, Release, Renewal, RetryPolicy,
};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep, timeout, timeout_at};

use super::stale_value;
use crate::factory::Factory;
use crate::support::{Ctx, Failure, Outcome, fit_ttl};

/// The backoff of every campaigner: short, so hand-overs are quick.
const RETRY: RetryPolicy = RetryPolicy {
    initial: Duration::from_millis(1),
    max: Duration::from_millis(20),
};

/// How often observers poll.
const POLL: Duration = Duration::from_millis(20);

/// An election on `key` (under the run's prefix) on `client` with a lease of `ttl`.
fn election(
    ctx: &Ctx<'_>,
    client: Arc<dyn LockBackend>,
    ttl: Duration,
    key: &LockKey,
) -> Result<Election, Failure> {
    let locker = ctx.ok(
        "Locker::builder(..).build()",
        Locker::builder(client).ttl(ttl).build(),
    )?;
    ctx.ok(
        "Election::builder(..).build()",
        Election::builder(locker, "conformance")
            .key(key.clone())
            .retry(RETRY)
            .poll_interval(POLL)
            .build(),
    )
}

/// Resigns `leadership`, which must still lead.
async fn resign_leading(ctx: &Ctx<'_>, leadership: Leadership) -> Result<(), Failure> {
    let token = leadership.token();
    let released = ctx.ok("resign", leadership.resign().await)?;
    ctx.ensure(
        released == Release::Released,
        format!("the leader with token {token} to resign with Released"),
        || format!("{released:?}"),
    )
}

/// Three campaigners on their own clients take turns, two terms each: while one leads no
/// other does, each term's fenced read-modify-write is admitted and loses no update, and
/// the tokens increase in the order of the terms.
pub async fn election_one_leader_at_a_time(factory: &dyn Factory) -> Result<Outcome, Failure> {
    const CAMPAIGNERS: usize = 3;
    const TERMS: usize = 2;
    let ctx = Ctx::new("election_one_leader_at_a_time", factory);
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    let key = ctx.key("role")?;
    let mut elections = vec![election(&ctx, first, t.ttl, &key)?];
    for _ in 1..CAMPAIGNERS {
        elections.push(election(&ctx, ctx.client().await, t.ttl, &key)?);
    }
    let counter = Arc::new(ctx.counter());
    let acting = Arc::new(AtomicUsize::new(0));
    let most_acting = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = elections
        .into_iter()
        .map(|election| {
            let (key, counter) = (key.clone(), counter.clone());
            let (acting, most_acting) = (acting.clone(), most_acting.clone());
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..TERMS {
                    let leadership = election.campaign().await?;
                    let now = acting.fetch_add(1, Ordering::SeqCst) + 1;
                    most_acting.fetch_max(now, Ordering::SeqCst);
                    let read = counter.read(&key).await?;
                    // Act across a suspension, so overlapping leaders would interleave.
                    sleep(Duration::from_millis(5)).await;
                    let written = counter
                        .write(&key, leadership.token(), read, read + 1)
                        .await?;
                    if written.is_admitted() {
                        admitted += 1;
                    }
                    acting.fetch_sub(1, Ordering::SeqCst);
                    if leadership.resign().await? != Release::Released {
                        return Err(LockError::Lost);
                    }
                }
                Ok::<usize, LockError>(admitted)
            })
        })
        .collect();
    let mut admitted = 0;
    for task in futures::future::join_all(tasks).await {
        let result = task.map_err(|e| ctx.fail("every campaigner task to finish", e))?;
        admitted += ctx.ok("campaign, act and resign", result)?;
    }
    let total = CAMPAIGNERS * TERMS;
    ctx.ensure(
        most_acting.load(Ordering::SeqCst) == 1,
        "one leader at a time",
        || format!("{} acting at once", most_acting.load(Ordering::SeqCst)),
    )?;
    let value = ctx.ok("read the counter", counter.read(&key).await)?;
    ctx.ensure(
        admitted == total && value == total as u64,
        format!("{total} admitted writes and the counter at {total}"),
        || format!("{admitted} admitted, counter at {value}"),
    )?;
    let grants = ctx.history().grants(&key).len();
    ctx.ensure(grants == total, format!("{total} terms granted"), || grants)?;
    ctx.pass(&t)
}

/// A standby campaigning while the leader resigns takes over well within the TTL (the
/// resign released the lease; nothing waited for it to run out), with a higher token.
pub async fn election_hands_over_after_resign(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("election_hands_over_after_resign", factory);
    let (client, other) = (ctx.client().await, ctx.client().await);
    let t = ctx.timing(&client);
    // A long lease: taking over after it ran out would be far past the deadline below.
    let ttl = fit_ttl(&client.capabilities(), t.ttl * 10);
    let key = ctx.key("role")?;
    let (leader, standby) = (
        election(&ctx, client, ttl, &key)?,
        election(&ctx, other, ttl, &key)?,
    );
    let first = ctx.ok("campaign of the only campaigner", leader.campaign().await)?;
    let first_token = first.token();
    let waiting = tokio::spawn(async move {
        let leadership = standby.campaign().await;
        (Instant::now(), leadership)
    });
    // Long enough for the standby's backoff to reach its ceiling.
    sleep(t.ttl / 2).await;
    ctx.ensure(
        !waiting.is_finished(),
        "the standby to wait while the leader leads",
        || "it finished its campaign",
    )?;
    let resigned_at = Instant::now();
    resign_leading(&ctx, first).await?;
    let deadline = resigned_at + ttl / 2;
    let joined = timeout_at(deadline, waiting).await;
    let Ok(Ok((elected_at, second))) = joined else {
        return Err(ctx.fail(
            format!("the standby elected within {:?} of the resign", ttl / 2),
            format!("{joined:?}"),
        ));
    };
    let second = ctx.ok("the standby's campaign", second)?;
    ctx.ensure(
        second.token() > first_token,
        format!("the new leader's token above {first_token}"),
        || second.token(),
    )?;
    ctx.ensure(
        elected_at >= resigned_at,
        "the standby elected after the resign, not before",
        || format!("elected {:?} before it", resigned_at - elected_at),
    )?;
    resign_leading(&ctx, second).await?;
    ctx.pass(&t)
}

/// A layer that hangs every call to the store while frozen, as a process stopped by the
/// OS or a long pause would: nothing reaches the store until it thaws.
#[derive(Debug, Default)]
struct Freezable {
    frozen: AtomicBool,
    thawed: Notify,
}

impl Freezable {
    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
        self.thawed.notify_waiters();
    }

    async fn gate(&self) {
        loop {
            let thawed = self.thawed.notified();
            if !self.frozen.load(Ordering::SeqCst) {
                return;
            }
            thawed.await;
        }
    }
}

#[async_trait]
impl BackendLayer for Freezable {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        self.gate().await;
        next.acquire(key, ttl).await
    }
    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        self.gate().await;
        next.renew(lease).await
    }
    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        self.gate().await;
        next.release(lease).await
    }
    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        self.gate().await;
        next.fence(lease).await
    }
    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        self.gate().await;
        next.inspect(key).await
    }
    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        self.gate().await;
        next.purge(key).await
    }
    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        self.gate().await;
        next.acquire_many(keys, ttl).await
    }
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.gate().await;
        next.renew_many(leases).await
    }
    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        self.gate().await;
        next.release_many(leases).await
    }
}

/// A leader whose process freezes past its TTL loses leadership (`lost()` fires by its
/// validity deadline), a standby takes over with a higher token once the lease ran out in
/// the store, and the old leader's trigger after it thaws is refused by the fenced
/// resource while the new leader's is admitted.
pub async fn election_loss_after_pause(factory: &dyn Factory) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("election_loss_after_pause", factory);
    let client = ctx.client().await;
    let t = ctx.timing(&client);
    let key = ctx.key("role")?;
    let frozen = Arc::new(Freezable::default());
    let (leader, standby) = (
        election(
            &ctx,
            Arc::new(Layered::new(client, frozen.clone())),
            t.ttl,
            &key,
        )?,
        election(&ctx, ctx.client().await, t.ttl, &key)?,
    );
    let counter = ctx.counter();
    let old = ctx.ok("campaign of the only campaigner", leader.campaign().await)?;
    let read = ctx.ok("read the counter", counter.read(&key).await)?;
    let written = ctx.ok(
        "fenced write",
        counter.write(&key, old.token(), read, read + 1).await,
    )?;
    ctx.ensure(
        written.is_admitted(),
        "the first leader's trigger admitted",
        || format!("{written:?}"),
    )?;
    let waiting = tokio::spawn(async move { standby.campaign().await });

    frozen.freeze();
    let frozen_at = Instant::now();
    let lost = timeout(t.ttl * 2 + Duration::from_secs(1), old.lost()).await;
    ctx.ensure(
        lost.is_ok() && !old.is_leader(),
        "lost() to fire and is_leader() to turn false once the frozen leader's lease runs out",
        || format!("still leading {:?} after the freeze", frozen_at.elapsed()),
    )?;
    let joined = timeout_at(t.expired_by(frozen_at) + Duration::from_secs(1), waiting).await;
    let Ok(Ok(new)) = joined else {
        return Err(ctx.fail(
            "the standby elected once the frozen leader's lease ran out",
            format!("{joined:?}"),
        ));
    };
    let new = ctx.ok("the standby's campaign", new)?;
    ctx.ensure(
        new.token() > old.token(),
        format!("the new leader's token above {}", old.token()),
        || new.token(),
    )?;
    let read = ctx.ok("read the counter", counter.read(&key).await)?;
    let written = ctx.ok(
        "fenced write",
        counter.write(&key, new.token(), read, read + 1).await,
    )?;
    ctx.ensure(
        written.is_admitted(),
        "the new leader's trigger admitted",
        || format!("{written:?}"),
    )?;

    frozen.thaw();
    // The old leader resumes and fires once more with its old token.
    let read = ctx.ok("read the counter", counter.read(&key).await)?;
    let late = ctx.ok(
        "fenced write",
        counter
            .write(&key, old.token(), read, stale_value(read))
            .await,
    )?;
    ctx.ensure(
        !late.is_admitted(),
        "the old leader's late trigger refused by the fenced resource",
        || format!("{late:?}"),
    )?;
    let value = ctx.ok("read the counter", counter.read(&key).await)?;
    ctx.ensure(
        value == 2,
        "the counter to hold the new leader's value 2",
        || value,
    )?;
    let released = ctx.ok("resign of the lost leadership", old.resign().await)?;
    ctx.ensure(
        released == Release::NotHeld,
        "the old leader's resign to be NotHeld, leaving the new leader untouched",
        || format!("{released:?}"),
    )?;
    ctx.ensure(
        new.is_leader(),
        "the new leader still leading",
        || "is_leader() == false",
    )?;
    resign_leading(&ctx, new).await?;
    ctx.pass(&t)
}

/// Leaders in turn, each campaigning on its own client after the last resigned or
/// dropped its leadership: every term's token is above the one before.
pub async fn election_tokens_increase_across_leaders(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("election_tokens_increase_across_leaders", factory);
    let first = ctx.client().await;
    let t = ctx.timing(&first);
    let key = ctx.key("role")?;
    let mut elections = vec![election(&ctx, first, t.ttl, &key)?];
    for _ in 1..3 {
        elections.push(election(&ctx, ctx.client().await, t.ttl, &key)?);
    }
    let mut last = FencingToken(0);
    for term in 0..6 {
        let election = &elections[term % elections.len()];
        let leadership = ctx.ok(
            "campaign",
            timeout(t.ttl * 4 + Duration::from_secs(2), election.campaign())
                .await
                .map_err(|_| LockError::Lost),
        )?;
        let leadership = ctx.ok("campaign", leadership)?;
        ctx.ensure(
            leadership.token() > last,
            format!("term {term}'s token above {last}"),
            || leadership.token(),
        )?;
        last = leadership.token();
        resign_leading(&ctx, leadership).await?;
    }
    ctx.pass(&t)
}

/// An observer sees nobody, then the leader (its owner id and token), then nobody again
/// after it resigned, then the next leader with a higher token.
pub async fn election_observe_follows_the_leader(
    factory: &dyn Factory,
) -> Result<Outcome, Failure> {
    let ctx = Ctx::new("election_observe_follows_the_leader", factory);
    let client = ctx.client().await;
    let t = ctx.timing(&client);
    let key = ctx.key("role")?;
    let watcher = election(&ctx, client, t.ttl, &key)?;
    let (a, b) = (
        election(&ctx, ctx.client().await, t.ttl, &key)?,
        election(&ctx, ctx.client().await, t.ttl, &key)?,
    );
    let mut leaders = Box::pin(watcher.observe());
    let wait = POLL * 10 + Duration::from_secs(2);
    let mut next = async |what: &str| -> Result<Option<Leader>, Failure> {
        let item = timeout(wait, leaders.next()).await;
        let Ok(Some(item)) = item else {
            return Err(ctx.fail(format!("observe() to report {what}"), format!("{item:?}")));
        };
        ctx.ok("observe", item)
    };
    let seen = next("nobody before the first campaign").await?;
    ctx.ensure(seen.is_none(), "nobody leading at first", || {
        format!("{seen:?}")
    })?;
    let first = ctx.ok("campaign", a.campaign().await)?;
    let seen = next("the first leader").await?;
    ctx.ensure(
        seen.as_ref().map(|l| (l.owner, l.token)) == Some((first.owner(), first.token())),
        format!(
            "the first leader, owner {} with token {}",
            first.owner(),
            first.token()
        ),
        || format!("{seen:?}"),
    )?;
    let first_token = first.token();
    resign_leading(&ctx, first).await?;
    let seen = next("nobody after the resign").await?;
    ctx.ensure(seen.is_none(), "nobody leading after the resign", || {
        format!("{seen:?}")
    })?;
    let second = ctx.ok("campaign", b.campaign().await)?;
    let seen = next("the second leader").await?;
    ctx.ensure(
        seen.as_ref()
            .is_some_and(|l| l.owner == second.owner() && l.token == second.token())
            && second.token() > first_token,
        format!(
            "the second leader, owner {} with token {} above {first_token}",
            second.owner(),
            second.token()
        ),
        || format!("{seen:?}"),
    )?;
    resign_leading(&ctx, second).await?;
    ctx.pass(&t)
}
