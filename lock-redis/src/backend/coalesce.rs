//! Coalescing of single calls on one node: the crate docs say what it does and why; here
//! is how. A caller that finds another call of its kind in flight *leads*: it yields once,
//! and the callers that [`Queue::join`] meanwhile go with it as one batch, sent from the
//! leader's task. While [`SENT_AT_ONCE`] calls of a kind are on their way, later callers
//! wait in the [`Queue`] and go together when one returns.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use distlock_core::Effect;
use distlock_core::{BoxError, Lease, LockBackend, LockError, LockKey, OwnerId, Release};
use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::batch::spread;
use super::reply::{parse_token, release};
use super::{Extra, NAME, RedisBackend, SENT_AT_ONCE};
use crate::error::{is_resendable, map_error};
use crate::keys::LockKeys;
use crate::scripts::RELEASE_MANY_SCRIPT;

/// Calls of one kind waiting for one of the [`SENT_AT_ONCE`] in flight to return.
pub(super) struct Queue<T> {
    state: Mutex<State<T>>,
}

struct State<T> {
    /// Calls (direct, or batches of queued ones) of this kind on their way: at most
    /// [`SENT_AT_ONCE`], and exactly that many while any call waits, unless a leader is
    /// gathering.
    busy: usize,
    /// A leader has yielded and will take the calls that join meanwhile.
    gathering: bool,
    waiting: Vec<T>,
}

/// How a caller joined a [`Queue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Joined {
    /// Nothing of its kind in flight: it sends at once, and is in flight now.
    Alone,
    /// Another call in flight: it is in flight now, yields once, and then asks
    /// [`Queue::gathered`] whether calls joined it meanwhile.
    Lead,
    /// Its item waits in the queue, to be sent in a batch.
    Queued,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                busy: 0,
                gathering: false,
                waiting: Vec::new(),
            }),
        }
    }
}

impl<T> Queue<T> {
    /// Joins the calls of this kind: see [`Joined`]. A caller that is in flight now
    /// (`Alone`, `Lead`) must end with [`Queue::next`] when done (through its
    /// [`InFlight`] mark); a queued one, `item()`, is answered by the batch it goes in.
    pub(super) fn join(&self, item: impl FnOnce() -> T) -> Joined {
        let mut state = self.state.lock();
        if state.gathering || state.busy >= SENT_AT_ONCE {
            state.waiting.push(item());
            Joined::Queued
        } else {
            state.busy += 1;
            if state.busy == 1 {
                Joined::Alone
            } else {
                state.gathering = true;
                Joined::Lead
            }
        }
    }

    /// For a leader that has yielded: `None` when no call joined meanwhile (it sends
    /// alone), or the calls that did with `item()`, its own, among them: its batch, which
    /// it sends itself ([`RunsToEnd`]) in its place in flight.
    pub(super) fn gathered(&self, item: impl FnOnce() -> T) -> Option<Vec<T>> {
        let mut state = self.state.lock();
        state.gathering = false;
        if state.waiting.is_empty() {
            None
        } else {
            let mut batch = std::mem::take(&mut state.waiting);
            batch.push(item());
            Some(batch)
        }
    }

    /// For a call in flight, once it is done: the calls queued meanwhile, to send next as
    /// one batch (which takes its place in flight), or `None` (nothing queued; its place
    /// is free). It ends a leader's gathering too, so a leader whose future is dropped
    /// while it yields leaves no gathering behind.
    pub(super) fn next(&self) -> Option<Vec<T>> {
        let mut state = self.state.lock();
        state.gathering = false;
        if state.waiting.is_empty() {
            state.busy -= 1;
            None
        } else {
            Some(std::mem::take(&mut state.waiting))
        }
    }
}

/// A leader's batch, polled by the leader (the replies reach their callers from its task,
/// one hop); if the leader's future is dropped first, the rest of the batch is spawned
/// on the runtime it is dropped on, so the other callers are still answered.
pub(super) struct RunsToEnd {
    batch: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl RunsToEnd {
    pub(super) fn new(batch: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            batch: Some(Box::pin(batch)),
        }
    }
}

impl Future for RunsToEnd {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(batch) = self.batch.as_mut() else {
            return Poll::Ready(());
        };
        ready!(batch.as_mut().poll(cx));
        self.batch = None;
        Poll::Ready(())
    }
}

impl Drop for RunsToEnd {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            // Without a runtime the batch is dropped: its callers learn from their closed
            // channels, and its in-flight mark hands the queue on.
            if let Ok(runtime) = Handle::try_current() {
                runtime.spawn(batch);
            }
        }
    }
}

/// An acquire waiting in the coalescing queue, with the instant its caller called.
pub(super) struct PendingAcquire {
    pub(super) key: LockKey,
    pub(super) ttl: Duration,
    pub(super) called: Instant,
    /// The caller's runtime, where its batch runs (see [`RedisBackend::hand_off`]).
    pub(super) runtime: Option<Handle>,
    pub(super) reply: oneshot::Sender<Result<Option<Lease>, LockError>>,
}

/// A release waiting in the coalescing queue.
pub(super) struct PendingRelease {
    pub(super) lease: Lease,
    pub(super) runtime: Option<Handle>,
    pub(super) reply: oneshot::Sender<Result<Release, LockError>>,
}

/// A call waiting in a [`Queue`].
pub(super) trait Pending {
    /// Its caller's runtime, where its batch runs (see [`RedisBackend::hand_off`]).
    fn runtime(&self) -> Option<&Handle>;
}

impl Pending for PendingAcquire {
    fn runtime(&self) -> Option<&Handle> {
        self.runtime.as_ref()
    }
}

impl Pending for PendingRelease {
    fn runtime(&self) -> Option<&Handle> {
        self.runtime.as_ref()
    }
}

/// A call that waits in a [`Queue`]: its answer, its kind, and how a batch of such calls
/// is sent.
pub(super) trait Coalesced: Pending + Send + Sized + 'static {
    /// What its caller gets.
    type Output: Send + 'static;
    /// The operation, in errors.
    const OPERATION: &'static str;
    /// The queue of its kind.
    fn queue(backend: &RedisBackend) -> &Queue<Self>;
    /// Sends `batch` as one multi-key call and answers each of its callers.
    fn send(backend: RedisBackend, batch: Vec<Self>) -> impl Future<Output = ()> + Send;
}

impl Coalesced for PendingAcquire {
    type Output = Option<Lease>;
    const OPERATION: &'static str = "acquire";

    fn queue(backend: &RedisBackend) -> &Queue<Self> {
        &backend.inner.acquires
    }

    async fn send(backend: RedisBackend, batch: Vec<Self>) {
        backend.acquire_queued(batch).await;
    }
}

impl Coalesced for PendingRelease {
    type Output = Release;
    const OPERATION: &'static str = "release";

    fn queue(backend: &RedisBackend) -> &Queue<Self> {
        &backend.inner.releases
    }

    async fn send(backend: RedisBackend, batch: Vec<Self>) {
        backend.release_queued(batch).await;
    }
}

/// How a single call goes once it has joined the calls of its kind
/// ([`RedisBackend::take_turn`]).
pub(super) enum Turn<T: Coalesced> {
    /// Answered in a batch: queued, or as its leader.
    Answered(Result<T::Output, LockError>),
    /// To be sent alone; in flight until the mark is dropped.
    Alone(InFlight<T>),
}

/// Marks a call of `T`'s kind in flight; when it is done (or its future is dropped), the
/// calls queued meanwhile are sent as the next batch.
pub(super) struct InFlight<T: Coalesced> {
    backend: RedisBackend,
    kind: PhantomData<fn() -> T>,
}

impl<T: Coalesced> Drop for InFlight<T> {
    fn drop(&mut self) {
        self.backend.send_next::<T>();
    }
}

impl RedisBackend {
    /// Called when the call of `T`'s kind in flight is done: sends the calls queued
    /// meanwhile as one batch, in a task of its own (so it runs even when no caller waits
    /// any more), or marks the queue idle.
    ///
    /// The batch runs on the runtime of one of its callers, not on the one of the call
    /// just done: a backend may be shared by several runtimes, and the one that ends the
    /// call may be shutting down. Its [`InFlight`] mark is made before spawning and moves
    /// into the task: if that runtime drops the task unpolled after all, dropping the mark
    /// hands off again (the batch's callers learn from their closed channels) instead of
    /// leaving the queue busy forever.
    fn send_next<T: Coalesced>(&self) {
        while let Some(batch) = T::queue(self).next() {
            // Looked up only for a batch: most calls end with nothing queued behind them.
            let runtime = batch.iter().find_map(Pending::runtime).cloned();
            let Some(runtime) = runtime.or_else(|| Handle::try_current().ok()) else {
                // Nothing can be sent without a runtime: dropping the batch closes its
                // callers' channels, which tells them so.
                continue;
            };
            let in_flight = self.in_flight::<T>();
            let batch = T::send(self.clone(), batch);
            runtime.spawn(async move {
                batch.await;
                drop(in_flight);
            });
            return;
        }
    }

    /// A single call joins the calls of its kind (`pending(reply)` makes its queue item,
    /// with `reply` where its answer comes): queued, it waits for its batch's answer; as a
    /// leader with others gathered, it sends their batch with its own call from its own
    /// task ([`RunsToEnd`]) and returns its answer; otherwise it is to be sent alone, in
    /// flight until the returned mark is dropped.
    pub(super) async fn take_turn<T: Coalesced>(
        &self,
        pending: impl Fn(&mut Option<Reply<T::Output>>) -> T,
    ) -> Turn<T> {
        let queue = T::queue(self);
        let mut reply = None;
        let joined = queue.join(|| pending(&mut reply));
        if let (Joined::Queued, Some(rx)) = (joined, reply.take()) {
            return Turn::Answered(self.queued_reply(T::OPERATION, rx).await);
        }
        let in_flight = self.in_flight::<T>();
        if joined == Joined::Lead {
            tokio::task::yield_now().await;
            if let Some(batch) = queue.gathered(|| pending(&mut reply)) {
                let batch = T::send(self.clone(), batch);
                RunsToEnd::new(async move {
                    batch.await;
                    drop(in_flight);
                })
                .await;
                // Answered by the batch, which has run to its end.
                let answer = reply.and_then(|mut rx| rx.try_recv().ok());
                return Turn::Answered(answer.unwrap_or_else(|| Err(dropped(T::OPERATION))));
            }
        }
        Turn::Alone(in_flight)
    }

    pub(super) fn in_flight<T: Coalesced>(&self) -> InFlight<T> {
        InFlight {
            backend: self.clone(),
            kind: PhantomData,
        }
    }

    /// A queued caller's wait for its reply. The call in flight ahead of it and then its
    /// own batch are each bounded by the response timeout; the third one is slack. A
    /// caller that stops waiting loses nothing: a lease granted to it later is released
    /// in the background.
    pub(super) async fn queued_reply<T>(
        &self,
        operation: &'static str,
        rx: oneshot::Receiver<Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let limit = self.inner.response_timeout * 3;
        match tokio::time::timeout(limit, rx).await {
            Ok(reply) => reply.unwrap_or_else(|_| Err(dropped(operation))),
            Err(_) => Err(LockError::outcome_unknown(
                NAME,
                operation,
                format!("no reply from the coalesced batch within {limit:?}"),
            )),
        }
    }

    /// Sends queued acquires as one batch and answers each caller. A lease whose caller
    /// has gone (dropped its future) is released in the background, not left to expire.
    async fn acquire_queued(&self, batch: Vec<PendingAcquire>) {
        let attempts: Vec<(LockKeys, OwnerId, Duration)> = batch
            .iter()
            .map(|p| (self.acquire_keys(&p.key), OwnerId::random(), p.ttl))
            .collect();
        let longest = batch.iter().map(|p| p.ttl).max().unwrap_or_default();
        let replies = match self.send_acquires("acquire", &attempts).await {
            Ok(replies) => replies,
            Err(e) => {
                if matches!(e, LockError::OutcomeUnknown { .. }) {
                    self.abandon(
                        attempts.into_iter().map(|(k, o, _)| (k, o)).collect(),
                        longest,
                    );
                }
                for p in batch {
                    let _ = p.reply.send(Err(duplicate(&e)));
                }
                return;
            }
        };
        let mut unknown = Vec::new();
        let mut orphans = Vec::new();
        for ((p, (keys, owner, _)), reply) in batch.into_iter().zip(attempts).zip(replies) {
            let outcome = match reply
                .map_err(|e| map_error("acquire", Effect::Write("acquire"), &e))
                .and_then(|v| parse_token(Some(v)))
            {
                Ok(token) => Ok(token.map(|t| self.lease(&p.key, owner, t, p.ttl, p.called))),
                Err(e) => {
                    if matches!(e, LockError::OutcomeUnknown { .. }) {
                        unknown.push((keys, owner));
                    }
                    Err(e)
                }
            };
            if let Err(Ok(Some(lease))) = p.reply.send(outcome) {
                orphans.push(lease);
            }
        }
        if !unknown.is_empty() {
            self.abandon(unknown, longest);
        }
        if !orphans.is_empty() {
            let backend = self.clone();
            tokio::spawn(async move {
                let released = backend.release_many(&orphans).await;
                tracing::debug!(
                    leases = orphans.len(),
                    done = released.is_ok(),
                    "released the leases of acquires whose callers had gone"
                );
            });
        }
    }

    /// Sends queued releases as one batch and answers each caller. When the batch's
    /// connection drops, each release is settled as a direct one is
    /// ([`RedisBackend::release_until_settled`]): asked on the new connection and sent
    /// again if it did not run, all within the response timeout.
    async fn release_queued(&self, batch: Vec<PendingRelease>) {
        let leases: Vec<&Lease> = batch.iter().map(|p| &p.lease).collect();
        let (groups, calls) = self.lease_calls(&RELEASE_MANY_SCRIPT, &leases, Extra::Release);
        let request = async {
            let mut replies = match self
                .inner
                .conn
                .batch(&calls, self.inner.response_timeout)
                .await
            {
                Ok(replies) => spread(&groups, replies, leases.len()),
                Err(e) if is_resendable(&e) => leases.iter().map(|_| Err(e.clone())).collect(),
                Err(e) => return Err(e),
            };
            self.settle_releases(&mut replies, &leases).await;
            Ok(replies)
        };
        let replies = self
            .timed("release", Effect::Write("release"), request)
            .await;
        let replies = match replies {
            Ok(replies) => replies,
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Err(duplicate(&e)));
                }
                return;
            }
        };
        for (p, reply) in batch.into_iter().zip(replies) {
            let outcome = reply
                .and_then(|v| Ok(redis::from_redis_value::<i64>(v)?))
                .map(release)
                .map_err(|e| map_error("release", Effect::Write("release"), &e));
            let _ = p.reply.send(outcome);
        }
    }
}

/// The error of a coalesced batch, once for each of its callers (`LockError` is not `Clone`,
/// nor is its source: each copy keeps the source's text).
fn duplicate(e: &LockError) -> LockError {
    let source = |s: &Option<BoxError>| s.as_ref().map(|s| BoxError::from(s.to_string()));
    match e {
        LockError::OutcomeUnknown {
            backend,
            operation,
            message,
            source: s,
        } => LockError::OutcomeUnknown {
            backend,
            operation,
            message: message.clone(),
            source: source(s),
        },
        LockError::Unavailable {
            backend,
            message,
            source: s,
        } => LockError::Unavailable {
            backend,
            message: message.clone(),
            source: source(s),
        },
        LockError::Config(message) => LockError::Config(message.clone()),
        other => LockError::backend(NAME, other.to_string()),
    }
}

/// Where a queued call's reply comes.
pub(super) type Reply<T> = oneshot::Receiver<Result<T, LockError>>;

/// The error of a queued call whose batch was dropped unanswered (its runtime shut down).
fn dropped(operation: &'static str) -> LockError {
    LockError::outcome_unknown(NAME, operation, "the batch was dropped before its reply")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_go_directly_until_the_limit_and_later_ones_queue_until_one_is_done() {
        let q = Queue::default();
        assert_eq!(
            q.join(|| 0),
            Joined::Alone,
            "nothing in flight: sent at once"
        );
        for i in 1..SENT_AT_ONCE {
            assert_eq!(q.join(|| i), Joined::Lead, "{i} in flight: leads");
            assert_eq!(q.gathered(|| 90), None, "nothing joined: sent alone");
        }
        assert_eq!(
            q.join(|| 100),
            Joined::Queued,
            "the limit in flight: queued"
        );
        assert_eq!(q.join(|| 101), Joined::Queued);
        assert_eq!(
            q.next(),
            Some(vec![100, 101]),
            "the queued ones form the next batch, in the place of the call done"
        );
        assert_eq!(
            q.join(|| 102),
            Joined::Queued,
            "the batch is in flight now: still the limit"
        );
        assert_eq!(q.next(), Some(vec![102]));
        assert_eq!(q.next(), None, "nothing queued: a place is free");
        assert_eq!(q.join(|| 103), Joined::Lead, "below the limit again: leads");
        assert_eq!(q.gathered(|| 91), None);
        assert_eq!(q.join(|| 104), Joined::Queued, "at the limit again: queued");
        assert_eq!(q.next(), Some(vec![104]));
        for _ in 0..SENT_AT_ONCE {
            assert_eq!(q.next(), None);
        }
        assert_eq!(q.join(|| 105), Joined::Alone, "idle: sent at once");
    }

    #[test]
    fn calls_that_arrive_while_a_leader_yields_go_with_it_as_one_batch() {
        let q = Queue::default();
        assert_eq!(q.join(|| 0), Joined::Alone);
        assert_eq!(q.join(|| 1), Joined::Lead);
        assert_eq!(q.join(|| 2), Joined::Queued, "a leader gathers: joins it");
        assert_eq!(q.join(|| 3), Joined::Queued);
        assert_eq!(
            q.gathered(|| 1),
            Some(vec![2, 3, 1]),
            "two joined: the leader sends them with its own as one batch"
        );
        assert_eq!(q.next(), None, "the batch is done, in the leader's place");
        assert_eq!(q.join(|| 4), Joined::Lead, "gathering is over: leads again");
        // A leader dropped while it yields: its mark's `next` ends the gathering.
        assert_eq!(q.join(|| 5), Joined::Queued);
        assert_eq!(q.next(), Some(vec![5]));
        assert_eq!(q.join(|| 6), Joined::Lead, "no gathering left behind");
    }
}
