//! The queue behind coalesced single calls.
//!
//! Every Lua script call costs the server a few microseconds of fixed overhead, whatever
//! it does; under concurrency that overhead, not the network, caps the throughput. So
//! while one call of a kind (acquire, release) is on its way, the calls that arrive
//! meanwhile wait here and go together, as one multi-key script call, when it returns.
//! A caller that finds nothing in flight sends at once: batching never waits on a timer,
//! it only forms while the server is busy answering.

use parking_lot::Mutex;

/// Calls of one kind waiting for the one in flight to return.
pub(crate) struct Queue<T> {
    state: Mutex<State<T>>,
}

struct State<T> {
    /// A call (direct, or a batch of queued ones) of this kind is on its way.
    busy: bool,
    waiting: Vec<T>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                busy: false,
                waiting: Vec::new(),
            }),
        }
    }
}

impl<T> Queue<T> {
    /// True when nothing was in flight: the caller sends directly and is now the call in
    /// flight (it must call [`Queue::next`] when done). Otherwise `item()` joins the queue.
    pub(crate) fn join(&self, item: impl FnOnce() -> T) -> bool {
        let mut state = self.state.lock();
        if state.busy {
            state.waiting.push(item());
            false
        } else {
            state.busy = true;
            true
        }
    }

    /// For the call in flight, once it is done: the calls queued meanwhile, to send next
    /// as one batch (which stays in flight), or `None` (nothing queued; the queue is idle).
    pub(crate) fn next(&self) -> Option<Vec<T>> {
        let mut state = self.state.lock();
        if state.waiting.is_empty() {
            state.busy = false;
            None
        } else {
            Some(std::mem::take(&mut state.waiting))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_caller_goes_directly_and_later_ones_queue_until_it_is_done() {
        let q = Queue::default();
        assert!(q.join(|| 0), "nothing in flight: direct");
        assert!(!q.join(|| 1), "one in flight: queued");
        assert!(!q.join(|| 2));
        assert_eq!(
            q.next(),
            Some(vec![1, 2]),
            "the queued ones form the next batch"
        );
        assert!(!q.join(|| 3), "the batch is in flight now");
        assert_eq!(q.next(), Some(vec![3]));
        assert_eq!(q.next(), None, "nothing left: idle");
        assert!(q.join(|| 4), "idle again: direct");
        assert_eq!(q.next(), None);
    }
}
