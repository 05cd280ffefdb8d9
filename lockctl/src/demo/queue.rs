//! An in-memory job queue with at-least-once delivery, as managed queues behave.
//!
//! A delivered message stays invisible for the visibility timeout, then is delivered
//! again unless it was acked, even if its first worker is still running it. The queue
//! also delivers some messages a second time on its own (a duplicate delivery). An ack
//! deletes the message whichever delivery it came from; a nack makes it visible again
//! after a delay.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

use super::workload::Workload;

/// One delivery of a message to a worker.
#[derive(Clone, Copy, Debug)]
pub struct Delivery {
    /// The message delivered; ack or nack it with this.
    pub message: usize,
    /// The index of the job in the workload.
    pub job: usize,
}

/// The queue of one strategy's run.
#[derive(Debug)]
pub struct Queue {
    state: Mutex<State>,
    changed: Notify,
    visibility_timeout: Duration,
}

#[derive(Debug)]
struct State {
    messages: Vec<Message>,
    due: BinaryHeap<Reverse<Ticket>>,
    /// Messages not yet deleted: the queue is drained when this reaches zero.
    remaining: usize,
    next_seq: u64,
    deliveries: u64,
}

#[derive(Debug)]
struct Message {
    job: usize,
    deleted: bool,
    /// Bumped on every delivery and nack, so only the latest visibility timer counts.
    epoch: u64,
    delivered: bool,
    duplicate_after: Option<Duration>,
}

/// A pending delivery: the message becomes deliverable at `at`.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Ticket {
    at: Instant,
    seq: u64,
    message: usize,
    kind: TicketKind,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TicketKind {
    /// The message becomes visible; stale once the message was delivered or nacked again.
    Visible { epoch: u64 },
    /// The queue's own duplicate delivery, independent of visibility.
    Duplicate,
}

impl State {
    fn push(&mut self, at: Instant, message: usize, kind: TicketKind) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.due.push(Reverse(Ticket {
            at,
            seq,
            message,
            kind,
        }));
    }

    fn is_live(&self, ticket: &Ticket) -> bool {
        let message = &self.messages[ticket.message];
        !message.deleted
            && match ticket.kind {
                TicketKind::Visible { epoch } => epoch == message.epoch,
                TicketKind::Duplicate => true,
            }
    }
}

/// What the next receive attempt found.
enum Next {
    Deliver(Delivery),
    WaitUntil(Instant),
    Drained,
}

impl Queue {
    /// A queue holding one message per job of `workload`, each visible from its arrival
    /// (counted from `start`).
    pub fn new(workload: &Workload, start: Instant) -> Self {
        let mut state = State {
            messages: Vec::with_capacity(workload.jobs.len()),
            due: BinaryHeap::with_capacity(workload.jobs.len() * 2),
            remaining: workload.jobs.len(),
            next_seq: 0,
            deliveries: 0,
        };
        for (index, job) in workload.jobs.iter().enumerate() {
            state.messages.push(Message {
                job: index,
                deleted: false,
                epoch: 0,
                delivered: false,
                duplicate_after: job.duplicate_after,
            });
            state.push(start + job.arrival, index, TicketKind::Visible { epoch: 0 });
        }
        Self {
            state: Mutex::new(state),
            changed: Notify::new(),
            visibility_timeout: workload.timing.visibility_timeout,
        }
    }

    /// Waits for the next deliverable message; `None` once every message was acked.
    ///
    /// # Cancel safety
    /// Cancel safe: a message is taken from the queue only when this returns it.
    pub async fn receive(&self) -> Option<Delivery> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.next(Instant::now()) {
                Next::Deliver(delivery) => return Some(delivery),
                Next::Drained => return None,
                Next::WaitUntil(at) => {
                    tokio::select! {
                        () = changed => {}
                        () = sleep_until(at) => {}
                    }
                }
            }
        }
    }

    fn next(&self, now: Instant) -> Next {
        let mut state = self.state.lock();
        loop {
            if state.remaining == 0 {
                return Next::Drained;
            }
            let Some(Reverse(ticket)) = state.due.peek() else {
                // Every live message is in flight with a visibility timer, so this
                // cannot happen while messages remain; wait for an ack or nack.
                return Next::WaitUntil(now + self.visibility_timeout);
            };
            if !state.is_live(ticket) {
                state.due.pop();
                continue;
            }
            if ticket.at > now {
                return Next::WaitUntil(ticket.at);
            }
            let Some(Reverse(ticket)) = state.due.pop() else {
                continue;
            };
            let index = ticket.message;
            state.deliveries += 1;
            let message = &mut state.messages[index];
            message.epoch += 1;
            let epoch = message.epoch;
            let job = message.job;
            let duplicate = if message.delivered {
                None
            } else {
                message.delivered = true;
                message.duplicate_after
            };
            state.push(
                now + self.visibility_timeout,
                index,
                TicketKind::Visible { epoch },
            );
            if let Some(after) = duplicate {
                state.push(now + after, index, TicketKind::Duplicate);
            }
            drop(state);
            // Another receiver may be sleeping until a later ticket than the new ones.
            self.changed.notify_waiters();
            return Next::Deliver(Delivery {
                message: index,
                job,
            });
        }
    }

    /// Deletes the message: it is never delivered again. Acking twice is harmless.
    pub fn ack(&self, message: usize) {
        let mut state = self.state.lock();
        let entry = &mut state.messages[message];
        if !entry.deleted {
            entry.deleted = true;
            state.remaining -= 1;
            let drained = state.remaining == 0;
            drop(state);
            if drained {
                self.changed.notify_waiters();
            }
        }
    }

    /// Puts the message back: it is visible again after `delay` (unless acked first).
    pub fn nack(&self, message: usize, delay: Duration) {
        let mut state = self.state.lock();
        let entry = &mut state.messages[message];
        if entry.deleted {
            return;
        }
        entry.epoch += 1;
        let epoch = entry.epoch;
        state.push(
            Instant::now() + delay,
            message,
            TicketKind::Visible { epoch },
        );
        drop(state);
        self.changed.notify_waiters();
    }

    /// How many messages were acked so far.
    pub fn acked(&self) -> usize {
        let state = self.state.lock();
        state.messages.len() - state.remaining
    }

    /// How many deliveries the queue made, duplicates and redeliveries included.
    pub fn deliveries(&self) -> u64 {
        self.state.lock().deliveries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::workload::{Fault, Job, Timing};

    fn workload(duplicate_after: Option<Duration>) -> Workload {
        Workload {
            jobs: vec![Job {
                id: 0,
                amount_cents: 100,
                arrival: Duration::ZERO,
                work: Duration::from_millis(10),
                fault: Fault::None,
                duplicate_after,
            }],
            timing: Timing::for_ttl(Duration::from_secs(1)),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unacked_message_is_delivered_again_after_the_visibility_timeout() {
        let queue = Queue::new(&workload(None), Instant::now());
        let first = queue.receive().await.unwrap();
        let started = Instant::now();
        let second = queue.receive().await.unwrap();
        assert_eq!(first.message, second.message);
        assert_eq!(started.elapsed(), Duration::from_millis(800));
        queue.ack(second.message);
        assert!(queue.receive().await.is_none());
        assert_eq!(queue.deliveries(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_duplicate_delivery_arrives_while_the_first_is_in_flight() {
        let queue = Queue::new(&workload(Some(Duration::from_millis(100))), Instant::now());
        let first = queue.receive().await.unwrap();
        let started = Instant::now();
        let duplicate = queue.receive().await.unwrap();
        assert_eq!(first.message, duplicate.message);
        assert_eq!(started.elapsed(), Duration::from_millis(100));
        queue.ack(first.message);
        assert!(queue.receive().await.is_none(), "an ack deletes every copy");
    }

    #[tokio::test(start_paused = true)]
    async fn a_nack_makes_the_message_visible_after_the_delay() {
        let queue = Queue::new(&workload(None), Instant::now());
        let first = queue.receive().await.unwrap();
        queue.nack(first.message, Duration::from_millis(50));
        let started = Instant::now();
        let again = queue.receive().await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_millis(50));
        queue.ack(again.message);
        queue.ack(again.message);
        assert_eq!(queue.acked(), 1);
    }
}
