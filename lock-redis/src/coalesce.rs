//! Coalescing of single calls on one node: the crate docs say what it does and why; here
//! is how. A [`Coalescer`] holds the calls of one kind (acquires, or releases) and decides
//! how each goes; the backend only sends, a call alone or a batch through [`SendBatch`].
//! A caller that finds no call of its kind in flight goes *alone*, at once. One that
//! finds another in flight *leads*: it yields once, and the callers that join meanwhile
//! go with it as one batch, sent from the leader's task. While the most calls it sends at
//! once are on their way, later callers wait in the [`Queue`] and go together, as one
//! batch, when one of those returns.
//!
//! Whatever happens to a caller's future, no batch is lost: each place in flight is held
//! by an [`InFlight`] mark that, dropped, sends the calls queued meanwhile, and a leader's
//! batch runs to its end ([`RunsToEnd`]) even when the leader's future is dropped. A batch
//! that runs in a task of its own runs on the runtime of a caller still waiting for it
//! ([`batch_runtime`]), never on that of a caller who gave up: a current-thread runtime
//! runs its tasks only while someone drives it, and the caller who gave up may have
//! been the one. And no answer is lost: one sent to a caller who is gone before reading
//! it is handed back to the backend ([`SendBatch::unread`]), which releases a granted
//! lease.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use distlock_core::LockError;
use parking_lot::Mutex;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::oneshot;

/// How a backend sends a batch of coalesced calls of type `C`, each answered with an `O`:
/// the one thing a [`Coalescer`] cannot do itself.
///
/// # Contract
///
/// * [`send`](Self::send) answers every call of its batch through
///   [`Waiting::answer`], or drops it: its caller is then told the batch was dropped
///   before its reply.
/// * The future it returns is complete in itself: it may run in a task of its own,
///   after every caller has gone, on the runtime of any of them.
pub(crate) trait SendBatch<C, O>: Clone + Send + Sync + 'static {
    /// The backend's name, in the errors of a caller its batch did not answer.
    const BACKEND: &'static str;
    /// The operation, in the same errors.
    const OPERATION: &'static str;
    /// Sends `batch` as one multi-key call and answers each of its callers.
    fn send(self, batch: Vec<Waiting<C, O>>) -> impl Future<Output = ()> + Send + 'static;

    /// An answer sent to a caller who then went without reading it (its future dropped
    /// between the two): whatever it grants must not stay held by nobody.
    fn unread(&self, answer: O);
}

/// A call that goes in a batch: what is sent, and where its caller's answer goes.
pub(crate) struct Waiting<C, O> {
    pub(crate) call: C,
    /// The caller's runtime, where its batch runs (see [`InFlight::hand_off`]).
    runtime: Option<Handle>,
    reply: oneshot::Sender<Result<O, LockError>>,
}

impl<C, O> Waiting<C, O> {
    /// Gives its caller `answer`; hands it back when the caller has gone.
    pub(crate) fn answer(self, answer: Result<O, LockError>) -> Result<(), Result<O, LockError>> {
        self.reply.send(answer)
    }
}

/// Where a caller's answer comes from a batch. Dropped with an answer in it (sent, never
/// read), it hands the answer to [`SendBatch::unread`].
struct Reply<S: SendBatch<C, O>, C, O> {
    rx: oneshot::Receiver<Result<O, LockError>>,
    sender: S,
    call: std::marker::PhantomData<fn() -> C>,
}

impl<S: SendBatch<C, O>, C, O> Reply<S, C, O> {
    /// The answer, when it has come.
    fn try_answer(&mut self) -> Option<Result<O, LockError>> {
        self.rx.try_recv().ok()
    }
}

impl<S: SendBatch<C, O>, C, O> Drop for Reply<S, C, O> {
    fn drop(&mut self) {
        // Closed first: from here on a send fails and hands the answer back to the batch
        // (see `Waiting::answer`), so an answer is either here or there, never lost.
        self.rx.close();
        if let Ok(Ok(answer)) = self.rx.try_recv() {
            self.sender.unread(answer);
        }
    }
}

/// The single calls of one kind on one node: each goes alone, leads a batch, or waits to
/// go in one.
pub(crate) struct Coalescer<C, O> {
    queue: Arc<Queue<Waiting<C, O>>>,
    /// How long a queued caller waits for its answer.
    patience: Duration,
}

impl<C, O> Coalescer<C, O>
where
    C: Send + 'static,
    O: Send + 'static,
{
    /// A coalescer with at most `sent_at_once` calls (or batches) on their way. A queued
    /// caller waits `patience` at most: enough for the call in flight ahead of it and then
    /// its own batch.
    pub(crate) fn new(sent_at_once: usize, patience: Duration) -> Self {
        Self {
            queue: Arc::new(Queue::new(sent_at_once)),
            patience,
        }
    }

    /// Runs one call: `batched()` is the call as it goes in a batch, which `sender` sends;
    /// `alone()` sends it by itself when nothing goes with it.
    ///
    /// A queued caller waits for its batch's answer. A leader with others gathered sends
    /// their batch with its own call from its own task ([`RunsToEnd`]) and returns its
    /// answer; otherwise it, like a caller that found nothing in flight, goes alone. A
    /// leader or a call sent alone holds a place in flight ([`InFlight`]) until it is
    /// done; then the calls queued meanwhile go, as one batch, in its place.
    ///
    /// # Cancel safety
    ///
    /// A caller that stops waiting leaves every other caller answered and the coalescer
    /// working: a queued call still goes in its batch (the backend is handed its unread
    /// answer, whether the caller went before it was sent, see [`Waiting::answer`], or
    /// after, see [`SendBatch::unread`]), a leader's batch runs to its end, and the place
    /// in flight of a dropped call is handed on. A call sent alone is as cancel safe as
    /// `alone()`'s future.
    pub(crate) async fn run<S, F>(
        &self,
        sender: &S,
        batched: impl Fn() -> C,
        alone: impl FnOnce() -> F,
    ) -> Result<O, LockError>
    where
        S: SendBatch<C, O>,
        F: Future<Output = Result<O, LockError>>,
    {
        let mut reply = None;
        let waiting = |reply: &mut Option<Reply<S, C, O>>| {
            let (tx, rx) = oneshot::channel();
            *reply = Some(Reply {
                rx,
                sender: sender.clone(),
                call: std::marker::PhantomData,
            });
            Waiting {
                call: batched(),
                runtime: Handle::try_current().ok(),
                reply: tx,
            }
        };
        let joined = self.queue.join(|| waiting(&mut reply));
        if let (Joined::Queued, Some(reply)) = (joined, reply.take()) {
            return self.queued_answer(reply).await;
        }
        let in_flight = InFlight {
            queue: self.queue.clone(),
            sender: sender.clone(),
        };
        if joined == Joined::Lead {
            tokio::task::yield_now().await;
            if let Some(batch) = self.queue.gathered(|| waiting(&mut reply)) {
                let runtimes = batch.iter().filter_map(|w| w.runtime.clone()).collect();
                RunsToEnd::new(in_flight.send(batch), runtimes).await;
                // Answered by the batch, which has run to its end.
                let answer = reply.as_mut().and_then(Reply::try_answer);
                return answer.unwrap_or_else(|| Err(dropped::<S, C, O>()));
            }
        }
        let answer = alone().await;
        drop(in_flight);
        answer
    }

    /// A queued caller's wait for its answer, [`Self::patience`] at most.
    async fn queued_answer<S: SendBatch<C, O>>(
        &self,
        mut reply: Reply<S, C, O>,
    ) -> Result<O, LockError> {
        match tokio::time::timeout(self.patience, &mut reply.rx).await {
            Ok(reply) => reply.unwrap_or_else(|_| Err(dropped::<S, C, O>())),
            Err(_) => Err(LockError::outcome_unknown(
                S::BACKEND,
                S::OPERATION,
                format!(
                    "no reply from the coalesced batch within {:?}",
                    self.patience
                ),
            )),
        }
    }
}

/// The error of a queued call whose batch was dropped unanswered (its runtime shut down).
fn dropped<S: SendBatch<C, O>, C, O>() -> LockError {
    LockError::outcome_unknown(
        S::BACKEND,
        S::OPERATION,
        "the batch was dropped before its reply",
    )
}

/// A place in flight: a call sent alone, or a batch. When it is done (or its future is
/// dropped), the calls queued meanwhile go as the next batch, in its place.
struct InFlight<C, O, S>
where
    C: Send + 'static,
    O: Send + 'static,
    S: SendBatch<C, O>,
{
    queue: Arc<Queue<Waiting<C, O>>>,
    sender: S,
}

impl<C, O, S> InFlight<C, O, S>
where
    C: Send + 'static,
    O: Send + 'static,
    S: SendBatch<C, O>,
{
    /// Sends `batch` in this place; the place is handed on once it is done.
    fn send(self, batch: Vec<Waiting<C, O>>) -> impl Future<Output = ()> + Send + 'static {
        let batch = self.sender.clone().send(batch);
        async move {
            batch.await;
            drop(self);
        }
    }

    /// Sends the calls queued meanwhile as one batch, in a task of its own (so it runs even
    /// when no caller waits any more), or frees the place.
    ///
    /// The batch runs on the runtime of a caller still waiting for it
    /// ([`batch_runtime`]), not on the one of the call just done: a backend may be shared
    /// by several runtimes, and the one that ends the call may be shutting down. The
    /// batch's mark is made before spawning and moves into the task: if that runtime
    /// drops the task unpolled after all, dropping the mark hands off again (the batch's
    /// callers learn from their closed channels) instead of leaving the queue busy
    /// forever.
    fn hand_off(&self) {
        while let Some(batch) = self.queue.next() {
            // Looked up only for a batch: most calls end with nothing queued behind them.
            let (waiting, gone): (Vec<_>, Vec<_>) = batch
                .iter()
                .filter_map(|w| Some((w.runtime.as_ref()?, w.reply.is_closed())))
                .partition(|(_, gone)| !gone);
            let runtime = batch_runtime(
                waiting.iter().map(|(h, _)| *h),
                gone.iter().map(|(h, _)| *h),
            );
            let Some(runtime) = runtime else {
                // Nothing can be sent without a runtime: dropping the batch closes its
                // callers' channels, which tells them so.
                continue;
            };
            let next = InFlight {
                queue: self.queue.clone(),
                sender: self.sender.clone(),
            };
            runtime.spawn(next.send(batch));
            return;
        }
    }
}

impl<C, O, S> Drop for InFlight<C, O, S>
where
    C: Send + 'static,
    O: Send + 'static,
    S: SendBatch<C, O>,
{
    fn drop(&mut self) {
        self.hand_off();
    }
}

/// Calls of one kind: how many are on their way, and those waiting for one of them.
struct Queue<T> {
    /// The most calls on their way at once.
    sent_at_once: usize,
    state: Mutex<State<T>>,
}

struct State<T> {
    /// Calls (direct, or batches of queued ones) of this kind on their way: at most
    /// `sent_at_once`, and exactly that many while any call waits, unless a leader is
    /// gathering.
    busy: usize,
    /// A leader has yielded and will take the calls that join meanwhile.
    gathering: bool,
    waiting: Vec<T>,
}

/// How a caller joined a [`Queue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Joined {
    /// Nothing of its kind in flight: it sends at once, and is in flight now.
    Alone,
    /// Another call in flight: it is in flight now, yields once, and then asks
    /// [`Queue::gathered`] whether calls joined it meanwhile.
    Lead,
    /// Its item waits in the queue, to be sent in a batch.
    Queued,
}

impl<T> Queue<T> {
    fn new(sent_at_once: usize) -> Self {
        Self {
            sent_at_once,
            state: Mutex::new(State {
                busy: 0,
                gathering: false,
                waiting: Vec::new(),
            }),
        }
    }

    /// Joins the calls of this kind: see [`Joined`]. A caller that is in flight now
    /// (`Alone`, `Lead`) must end with [`Queue::next`] when done (through its
    /// [`InFlight`] mark); a queued one, `item()`, is answered by the batch it goes in.
    fn join(&self, item: impl FnOnce() -> T) -> Joined {
        let mut state = self.state.lock();
        if state.gathering || state.busy >= self.sent_at_once {
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
    fn gathered(&self, item: impl FnOnce() -> T) -> Option<Vec<T>> {
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
    fn next(&self) -> Option<Vec<T>> {
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

/// Where a batch runs in a task of its own: the runtime of a caller still `waiting` for
/// it, a multi-thread one first (its workers run its tasks whoever waits), else a
/// current-thread one (it runs its tasks only while driven, and a caller that waits is
/// being driven); else the current runtime; else that of a caller who is `gone`. Never
/// a gone caller's first: it may be a current-thread runtime that nobody drives any more,
/// where the batch would never run. `None` outside any runtime.
fn batch_runtime<'a>(
    waiting: impl Iterator<Item = &'a Handle> + Clone,
    mut gone: impl Iterator<Item = &'a Handle>,
) -> Option<Handle> {
    let driven = |h: &&Handle| h.runtime_flavor() != RuntimeFlavor::CurrentThread;
    waiting
        .clone()
        .find(driven)
        .or_else(|| waiting.clone().next())
        .cloned()
        .or_else(|| Handle::try_current().ok())
        .or_else(|| gone.next().cloned())
}

/// A leader's batch, polled by the leader (the replies reach their callers from its task,
/// one hop); if the leader's future is dropped first, the rest of the batch is spawned,
/// on another caller's runtime rather than the gone leader's (see [`batch_runtime`]), so
/// the other callers are still answered.
struct RunsToEnd {
    batch: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The runtimes of the batch's callers, the leader's last.
    runtimes: Vec<Handle>,
}

impl RunsToEnd {
    fn new(batch: impl Future<Output = ()> + Send + 'static, runtimes: Vec<Handle>) -> Self {
        Self {
            batch: Some(Box::pin(batch)),
            runtimes,
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
            // The leader is gone; the others waited when the batch was gathered. Without a
            // runtime the batch is dropped: its callers learn from their closed channels,
            // and its in-flight mark hands the queue on.
            let (leader, others) = self.runtimes.split_last().unzip();
            let others = others.unwrap_or_default();
            if let Some(runtime) = batch_runtime(others.iter(), leader.into_iter()) {
                runtime.spawn(batch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SENT_AT_ONCE;

    #[test]
    fn callers_go_directly_until_the_limit_and_later_ones_queue_until_one_is_done() {
        let q = Queue::new(SENT_AT_ONCE);
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
        let q = Queue::new(SENT_AT_ONCE);
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
