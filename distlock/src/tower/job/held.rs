//! What a job holds while it runs ([`Held`]: its key's lock, claim or permit, and until
//! executed its run key), and what the layer does with the claim a job was enqueued
//! under: ended when the job starts, or read to see whether a newer job replaced it.

use distlock_core::{
    Claim, FencingToken, LeaseStatus, LockError, LockGuard, LockKey, Locker, Permit,
    QUEUE_KEY_PREFIX, Release,
};

use super::{JobError, LockLayer};

/// Until executing: ends the job's claim (resumed, then released), so that a duplicate
/// may be enqueued once the job has started; the job then takes its key as usual.
pub(super) async fn end_claim<E>(locker: &Locker, claim: &Claim) -> Result<(), JobError<E>> {
    if let Some(guard) = locker.resume(claim).await.map_err(JobError::Lock)? {
        // A release that fails leaves the claim to run out at its TTL.
        let _ = guard.release().await;
    }
    Ok(())
}

/// Until executing or replaced: the token of the newer claim that replaced the job's
/// `claim`, if one did (the newest token the store knows on the claim's key is above the
/// claim's); `None` while the claim is the newest, held or run out. The claim is left as
/// it is. A claim on another key than the queue key of the job's `key` is a
/// [`LockError::Config`].
///
/// The store's `inspect`, not `fence` on the claim's lease: for a free key Redis's fence
/// answers its high-water token, which every key of the server (or hash slot) shares and
/// which is above the claim's as soon as any other key was granted since, so a claim that
/// simply ran out would read as replaced. `inspect` gives a key's own tokens only.
pub(super) async fn replaced_by(
    locker: &Locker,
    key: &LockKey,
    claim: &Claim,
) -> Result<Option<FencingToken>, LockError> {
    let queued = queue_key(key)?;
    if claim.key() != &queued {
        return Err(LockError::Config(format!(
            "the job's claim is on {}, but a job that may be replaced is claimed on its \
             queue key, {queued}",
            claim.key()
        )));
    }
    let found = locker.backend().inspect(&queued).await?;
    Ok(found.token.filter(|&newest| newest > claim.token()))
}

/// The queue key of a job whose key is `key`: `queued:<key>` ([`QUEUE_KEY_PREFIX`] and
/// the key), which its producer claims under
/// [`LockLayer::claimed`]`(.., `[`Until::Executing`](super::Until::Executing)`)` and
/// [`Until::ExecutingOrReplaced`](super::Until::ExecutingOrReplaced) (there with
/// [`Locker::claim_replacing`], which takes only names with that prefix).
///
/// A [`LockError::InvalidKey`] when the prefixed name is too long for a key.
pub fn queue_key(key: &LockKey) -> Result<LockKey, LockError> {
    LockKey::new(format!("{QUEUE_KEY_PREFIX}{}", key.as_str()))
}

/// The run key of a job whose key is `key` under
/// [`LockLayer::claimed`]`(.., `[`Until::Executed`](super::Until::Executed)`)`: `running:<key>`, held by each run
/// of the job while it runs, and the key its token fences writes on (see
/// [`Locked::key`](crate::tower::Locked::key)). Inspect it to see whether a run is under way, and by which token.
///
/// A [`LockError::InvalidKey`] when the prefixed name is too long for a key.
pub fn run_key(key: &LockKey) -> Result<LockKey, LockError> {
    LockKey::new(format!("running:{}", key.as_str()))
}

/// Until executed, what each try of a job takes: its run key, `running:<key>`, and then
/// the job's key, by its claim while the claim lasts, as usual once it has ended.
///
/// Every delivery of the job carries the same claim, and resuming it renews the same
/// lease under the same token: a delivery made while an earlier one still runs (its
/// worker taken for dead by the queue, but only paused) would run beside it, and one
/// made after that run's run key lapsed but before its claim did would run under its
/// token. The run key is taken first, so a delivery that finds it held leaves the claim
/// untouched and is a miss; and its token, new for each run, is the one the job fences
/// with, on the run key, whether the claim was resumed or the job's key taken afresh.
pub(super) struct RunOf {
    key: LockKey,
    claim: Option<Claim>,
}

impl RunOf {
    /// A claim on another key than the job's is a [`LockError::Config`].
    pub(super) fn new(key: &LockKey, claim: Option<Claim>) -> Result<Self, LockError> {
        if let Some(claim) = &claim
            && claim.key() != key
        {
            return Err(LockError::Config(format!(
                "the job's claim is on {}, but the job runs under {key}: until executed, \
                 the producer claims the job's own key",
                claim.key()
            )));
        }
        Ok(Self {
            key: run_key(key)?,
            claim,
        })
    }

    /// The run key.
    pub(super) fn key(&self) -> &LockKey {
        &self.key
    }
}

/// What a job runs under: its key's lock (or claim) or a permit of its key's semaphore,
/// and until executed its run key, whose token fences the job.
pub(super) struct Held {
    taken: Taken,
    run: Option<Kept>,
}

/// What a job takes of its key: the lock, the claim its producer took (resumed), or a
/// permit.
enum Taken {
    Lock(LockGuard),
    Claim(Kept),
    Permit(Permit),
}

/// A lease of a run until executed (see [`RunOf`]) that, dropped unreleased (the job's
/// future dropped, the run stopped on a lost lease, or the release of the job's key
/// failed), is left to run out at its TTL instead of released in the background. The run
/// key, freed before the job's key, would let the job's next delivery run while this
/// one's key or claim still holds. The claim is one lease for every delivery of the job:
/// a run stopped once its run key lapsed may find the claim resumed by the next delivery
/// since, and releasing it would end that run's claim and let a duplicate be enqueued.
struct Kept(Option<LockGuard>);

impl Kept {
    fn guard(&self) -> &LockGuard {
        self.0
            .as_ref()
            .expect("a kept lease is there until it is released or dropped")
    }

    async fn release(mut self) -> Result<Release, LockError> {
        match self.0.take() {
            Some(guard) => guard.release().await,
            None => Ok(Release::NotHeld),
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            guard.leave_to_expire();
        }
    }
}

impl Taken {
    /// One try at what the layer takes for `key`; `None` when it is all taken.
    async fn try_take<R>(layer: &LockLayer<R>, key: &LockKey) -> Result<Option<Taken>, LockError> {
        Ok(match layer.permits {
            None => layer.locker.try_lock(key).await?.map(Taken::Lock),
            Some(permits) => layer
                .locker
                .semaphore(key, permits)?
                .try_acquire()
                .await?
                .map(Taken::Permit),
        })
    }

    fn guard(&self) -> &LockGuard {
        match self {
            Taken::Lock(guard) => guard,
            Taken::Claim(claim) => claim.guard(),
            Taken::Permit(permit) => permit.guard(),
        }
    }

    async fn release(self) -> Result<Release, LockError> {
        match self {
            Taken::Lock(guard) => guard.release().await,
            Taken::Claim(claim) => claim.release().await,
            Taken::Permit(permit) => permit.release().await,
        }
    }
}

impl Held {
    /// One try: what the layer takes for `key`, after the run key until executed; `None`
    /// when the run key or the job's key is held (the run key then given back at once:
    /// nothing ran under it).
    pub(super) async fn try_take<R>(
        layer: &LockLayer<R>,
        key: &LockKey,
        run_of: Option<&RunOf>,
    ) -> Result<Option<Held>, LockError> {
        let Some(run_of) = run_of else {
            let taken = Taken::try_take(layer, key).await?;
            return Ok(taken.map(|taken| Held { taken, run: None }));
        };
        let Some(run) = layer.locker.try_lock(&run_of.key).await? else {
            return Ok(None);
        };
        let run = Kept(Some(run));
        let taken = match &run_of.claim {
            Some(claim) => {
                let resumed = layer.locker.resume(claim).await;
                resumed.map(|guard| guard.map(|guard| Taken::Claim(Kept(Some(guard)))))
            }
            None => Ok(None),
        };
        let taken = match taken {
            // The claim has ended, or there was none: the job takes its key as usual.
            Ok(None) => Taken::try_take(layer, key).await,
            resumed => resumed,
        };
        match taken {
            Ok(Some(taken)) => Ok(Some(Held {
                taken,
                run: Some(run),
            })),
            missed => {
                // A release that fails leaves the key to run out at its TTL.
                let _ = run.release().await;
                missed.map(|_| None)
            }
        }
    }

    /// Until executed, the status of the job's key (its claim or lock), which ends the run
    /// beside the run key's; `None` otherwise, where the fence is that lease.
    pub(super) fn job_status(&self) -> Option<LeaseStatus> {
        self.run.as_ref().map(|_| self.taken.guard().status())
    }

    /// The lease whose token fences the job: the run key's until executed, else the
    /// job's own.
    pub(super) fn fence(&self) -> &LockGuard {
        match &self.run {
            Some(run) => run.guard(),
            None => self.taken.guard(),
        }
    }

    /// Until expired, a job that succeeded: its key is left to run out at its TTL (a
    /// permit, which that option does not take, is given back); its run key, if any, is
    /// released, as the run is over.
    pub(super) async fn leave_to_expire(self) {
        match self.taken {
            Taken::Lock(guard) => guard.leave_to_expire(),
            Taken::Claim(claim) => drop(claim),
            Taken::Permit(permit) => {
                let _ = permit.release().await;
            }
        }
        if let Some(run) = self.run {
            // A release that fails leaves the key to run out at its TTL.
            let _ = run.release().await;
        }
    }

    pub(super) async fn release(self) -> Result<Release, LockError> {
        // The job's key first: a duplicate may be enqueued from then on, and the job's
        // next delivery finds its claim ended once the run key is free.
        let released = self.taken.release().await;
        if let Some(run) = self.run
            && released.is_ok()
        {
            // A release that fails leaves the key to run out at its TTL.
            let _ = run.release().await;
        }
        released
    }
}
