//! [`Faults`]: a layer that makes a backend's calls fail, slow down, hang, lose their
//! replies, or lose release notifications, to test how `Locker`, the watchdog and user
//! code react.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::backend::LockBackend;
use crate::backend::lease::{Fence, Lease, LockInfo, Release, Renewal, valid_until};
use crate::backend::wake::{AllKeys, ReleaseHub, ReleaseWatch};
use crate::error::LockError;
use crate::key::LockKey;
use crate::layer::BackendLayer;

/// Fault knobs around any backend, as a [`BackendLayer`]: wrap a backend with
/// [`Layered::new`](crate::Layered::new) and turn the knobs. Every knob applies to every
/// call until changed. Several clients layered with one `Arc<Faults>` are faulted
/// together, as clients behind one broken network are.
///
/// What a fault does to a call:
/// - **fails** (`fail_next`, `partition`): the call never reaches the backend and returns
///   [`LockError::Unavailable`], changing nothing;
/// - **loses its reply** (`lose_replies`): the call takes effect and returns
///   [`LockError::OutcomeUnknown`]; this applies to acquire, renew, release and fence
///   and their batch forms, the calls whose outcome a caller acts on;
/// - **is delayed** (`delay`) or **hangs** (`hang`) on its way to the backend: the
///   request has left, so a granted lease's or a renewal's validity still counts from
///   the instant the call entered the layer;
/// - **wakes no waiter** (`lose_notifications`): the release watches taken while it is
///   set never fire, as when a listener's connection silently stopped delivering.
///
/// A batch (`acquire_many`, `renew_many`, `release_many`, `acquire_any`) is one call, as
/// it is one request to a store: it fails, or loses its reply, as a whole.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use distlock::backend::Layered;
/// use distlock::memory::{Faults, MemoryBackend};
/// use distlock::{LockBackend, LockKey};
///
/// let faults = Arc::new(Faults::default());
/// let backend = Layered::new(Arc::new(MemoryBackend::new()), faults.clone());
/// let key = LockKey::new("job:1").unwrap();
/// faults.partition();
/// assert!(backend.acquire(&key, Duration::from_secs(5)).await.is_err());
/// faults.heal();
/// assert!(backend.acquire(&key, Duration::from_secs(5)).await.unwrap().is_some());
/// assert_eq!(faults.calls(), 2);
/// # }
/// ```
///
/// # Cancel safety
///
/// A call dropped while it hangs or is delayed never reached the backend and changed
/// nothing; dropped later, it is as cancel safe as the backend's call.
#[derive(Debug)]
pub struct Faults {
    fail_next: AtomicU64,
    lose_replies: AtomicU64,
    delay_micros: AtomicU64,
    partitioned: AtomicBool,
    hung: AtomicBool,
    lose_notifications: AtomicBool,
    calls: AtomicU64,
    heal: tokio::sync::Notify,
    /// Where the watches taken while notifications are lost live: nothing notifies it.
    silent: ReleaseHub,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            fail_next: AtomicU64::new(0),
            lose_replies: AtomicU64::new(0),
            delay_micros: AtomicU64::new(0),
            partitioned: AtomicBool::new(false),
            hung: AtomicBool::new(false),
            lose_notifications: AtomicBool::new(false),
            calls: AtomicU64::new(0),
            heal: tokio::sync::Notify::new(),
            silent: ReleaseHub::new(AllKeys),
        }
    }
}

impl Faults {
    /// The next `n` calls fail with `Unavailable` and change nothing.
    pub fn fail_next(&self, n: u64) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// The next `n` calls take effect but lose their reply (`OutcomeUnknown`).
    pub fn lose_replies(&self, n: u64) {
        self.lose_replies.store(n, Ordering::SeqCst);
    }

    /// Every call waits `delay` before it reaches the backend.
    pub fn delay(&self, delay: Duration) {
        let micros = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.delay_micros.store(micros, Ordering::SeqCst);
    }

    /// Every call fails with `Unavailable` until [`Faults::heal`].
    pub fn partition(&self) {
        self.partitioned.store(true, Ordering::SeqCst);
    }

    /// Every call hangs, never reaching the backend, until [`Faults::heal`].
    pub fn hang(&self) {
        self.hung.store(true, Ordering::SeqCst);
    }

    /// Waiters that start watching for releases from now on are never woken (`false`
    /// restores the wakes for later watches), as when the store's notification is lost on
    /// the way: they take a released key by their backoff.
    pub fn lose_notifications(&self, lose: bool) {
        self.lose_notifications.store(lose, Ordering::SeqCst);
    }

    /// Ends a partition, a hang and a delay; pending failure counts are kept.
    pub fn heal(&self) {
        self.partitioned.store(false, Ordering::SeqCst);
        self.hung.store(false, Ordering::SeqCst);
        self.delay_micros.store(0, Ordering::SeqCst);
        self.heal.notify_waiters();
    }

    /// How many calls reached the layer (including failed ones).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// The faults on a call's way to `next`: a hang, a delay, a failure (named as
    /// `next`'s, as the store's own would be).
    async fn on_the_way(&self, next: &dyn LockBackend) -> Result<(), LockError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        loop {
            let healed = self.heal.notified();
            if !self.hung.load(Ordering::SeqCst) {
                break;
            }
            healed.await;
        }
        let delay = self.delay_micros.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        if self.partitioned.load(Ordering::SeqCst) {
            return Err(LockError::unavailable(
                next.name(),
                "partitioned (injected fault)",
            ));
        }
        if take_one(&self.fail_next) {
            return Err(LockError::unavailable(next.name(), "injected failure"));
        }
        Ok(())
    }

    /// The fault on a call's way back: its reply lost, after it took effect.
    fn on_the_way_back<T>(
        &self,
        next: &dyn LockBackend,
        operation: &'static str,
        reply: Result<T, LockError>,
    ) -> Result<T, LockError> {
        let reply = reply?;
        if take_one(&self.lose_replies) {
            return Err(LockError::outcome_unknown(
                next.name(),
                operation,
                "reply lost (injected fault)",
            ));
        }
        Ok(reply)
    }
}

/// A grant's validity counted from `sent`, the instant the call entered the layer,
/// where the backend behind a delay counted it later.
fn from_sent(lease: Lease, sent: Instant) -> Lease {
    let until = valid_until(sent, lease.ttl()).min(lease.valid_until());
    lease.with_valid_until(until)
}

/// A renewal's validity counted from `sent` (see [`from_sent`]).
fn renewal_from_sent(renewal: Renewal, lease: &Lease, sent: Instant) -> Renewal {
    match renewal {
        Renewal::Renewed { valid_until: until } => Renewal::Renewed {
            valid_until: valid_until(sent, lease.ttl()).min(until),
        },
        other => other,
    }
}

#[async_trait]
impl BackendLayer for Faults {
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let sent = Instant::now();
        self.on_the_way(next).await?;
        let lease = self.on_the_way_back(next, "acquire", next.acquire(key, ttl).await)?;
        Ok(lease.map(|l| from_sent(l, sent)))
    }

    async fn renew(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Renewal, LockError> {
        let sent = Instant::now();
        self.on_the_way(next).await?;
        let renewal = self.on_the_way_back(next, "renew", next.renew(lease).await)?;
        Ok(renewal_from_sent(renewal, lease, sent))
    }

    async fn release(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Release, LockError> {
        self.on_the_way(next).await?;
        self.on_the_way_back(next, "release", next.release(lease).await)
    }

    async fn fence(&self, next: &dyn LockBackend, lease: &Lease) -> Result<Fence, LockError> {
        self.on_the_way(next).await?;
        self.on_the_way_back(next, "fence", next.fence(lease).await)
    }

    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        self.on_the_way(next).await?;
        next.inspect(key).await
    }

    async fn purge(&self, next: &dyn LockBackend, key: &LockKey) -> Result<(), LockError> {
        self.on_the_way(next).await?;
        next.purge(key).await
    }

    fn watch_releases(&self, next: &dyn LockBackend, key: &LockKey) -> Option<ReleaseWatch> {
        // Asked before the backend is: a store's watch may subscribe on the wire.
        if self.lose_notifications.load(Ordering::SeqCst) {
            return next
                .capabilities()
                .wakes_waiters
                .then(|| self.silent.watch(key));
        }
        next.watch_releases(key)
    }

    fn watch_permit_releases(
        &self,
        next: &dyn LockBackend,
        slots: &[LockKey],
    ) -> Option<ReleaseWatch> {
        // As `watch_releases`: a lost announcement is lost for a semaphore's waiters too.
        if self.lose_notifications.load(Ordering::SeqCst) {
            return next
                .capabilities()
                .wakes_waiters
                .then(|| self.silent.watch_permits(slots))
                .flatten();
        }
        next.watch_permit_releases(slots)
    }

    fn watched_keys(&self, next: &dyn LockBackend) -> Vec<LockKey> {
        let mut keys = next.watched_keys();
        keys.extend(self.silent.watched_keys());
        keys
    }

    async fn acquire_any(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let sent = Instant::now();
        self.on_the_way(next).await?;
        let lease = self.on_the_way_back(next, "acquire_any", next.acquire_any(keys, ttl).await)?;
        Ok(lease.map(|l| from_sent(l, sent)))
    }

    async fn acquire_many(
        &self,
        next: &dyn LockBackend,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let sent = Instant::now();
        self.on_the_way(next).await?;
        let leases =
            self.on_the_way_back(next, "acquire_many", next.acquire_many(keys, ttl).await)?;
        Ok(leases
            .into_iter()
            .map(|l| l.map(|l| from_sent(l, sent)))
            .collect())
    }

    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        let sent = Instant::now();
        self.on_the_way(next).await?;
        let renewals = self.on_the_way_back(next, "renew_many", next.renew_many(leases).await)?;
        Ok(renewals
            .into_iter()
            .zip(leases)
            .map(|(r, lease)| renewal_from_sent(r, lease, sent))
            .collect())
    }

    async fn release_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Release>, LockError> {
        self.on_the_way(next).await?;
        self.on_the_way_back(next, "release_many", next.release_many(leases).await)
    }
}

/// Decrements `counter` if it is above zero; true if it did.
fn take_one(counter: &AtomicU64) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::key::FencingToken;
    use crate::layer::Layered;
    use crate::memory::MemoryBackend;

    fn key(s: &str) -> LockKey {
        LockKey::new(s).unwrap()
    }

    fn faulty() -> (Layered<Arc<Faults>>, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        (
            Layered::new(Arc::new(MemoryBackend::new()), faults.clone()),
            faults,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn failed_calls_change_nothing() {
        let (b, faults) = faulty();
        faults.fail_next(1);
        let err = b
            .acquire(&key("k"), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.is_retryable());
        let lease = b
            .acquire(&key("k"), Duration::from_secs(1))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            lease.token(),
            FencingToken(1),
            "the failed call issued no token"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_reply_still_takes_effect() {
        let (b, faults) = faulty();
        faults.lose_replies(1);
        let err = b
            .acquire(&key("k"), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::OutcomeUnknown { .. }));
        assert!(
            b.acquire(&key("k"), Duration::from_secs(1))
                .await
                .unwrap()
                .is_none()
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            b.acquire(&key("k"), Duration::from_secs(1))
                .await
                .unwrap()
                .is_some()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_call_resumes_on_heal() {
        let (b, faults) = faulty();
        let b = Arc::new(b);
        faults.hang();
        let call = tokio::spawn({
            let b = b.clone();
            async move { b.acquire(&key("k"), Duration::from_secs(1)).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!call.is_finished());
        faults.heal();
        assert!(call.await.unwrap().unwrap().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_partition_fails_every_call_until_healed() {
        let (b, faults) = faulty();
        faults.partition();
        for _ in 0..3 {
            assert!(b.acquire(&key("k"), Duration::from_secs(1)).await.is_err());
        }
        faults.heal();
        assert!(
            b.acquire(&key("k"), Duration::from_secs(1))
                .await
                .unwrap()
                .is_some()
        );
        assert_eq!(faults.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_delayed_grant_counts_its_validity_from_the_call() {
        let (b, faults) = faulty();
        faults.delay(Duration::from_millis(200));
        let called = Instant::now();
        let ttl = Duration::from_secs(1);
        let lease = b.acquire(&key("k"), ttl).await.unwrap().unwrap();
        assert_eq!(Instant::now() - called, Duration::from_millis(200));
        assert_eq!(lease.valid_until(), valid_until(called, ttl));
        let renewed = b.renew(&lease).await.unwrap();
        assert_eq!(
            renewed,
            Renewal::Renewed {
                valid_until: valid_until(called + Duration::from_millis(200), ttl)
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_is_one_call_and_fails_as_a_whole() {
        let (b, faults) = faulty();
        faults.fail_next(1);
        let keys = [key("a"), key("b")];
        let ttl = Duration::from_secs(1);
        assert!(b.acquire_many(&keys, ttl).await.is_err());
        let leases = b.acquire_many(&keys, ttl).await.unwrap();
        assert!(
            leases
                .iter()
                .all(|l| l.as_ref().is_some_and(|l| l.token() == FencingToken(1)))
        );
        assert_eq!(faults.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn watches_taken_while_notifications_are_lost_never_fire() {
        let (b, faults) = faulty();
        let ttl = Duration::from_secs(1);
        let lease = b.acquire(&key("k"), ttl).await.unwrap().unwrap();
        faults.lose_notifications(true);
        let mut deaf = b
            .watch_releases(&key("k"))
            .expect("the store wakes waiters");
        faults.lose_notifications(false);
        let mut heard = b
            .watch_releases(&key("k"))
            .expect("the store wakes waiters");
        assert_eq!(b.watched_keys().len(), 2);
        b.release(&lease).await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), heard.released())
            .await
            .expect("a watch taken after the knob was reset is woken");
        assert!(
            tokio::time::timeout(Duration::from_secs(5), deaf.released())
                .await
                .is_err(),
            "a watch taken while notifications were lost was woken"
        );
    }
}
