//! What a torture worker reports, one JSON object per line on its standard output, and
//! the clock every process of a run reads its times from.
//!
//! Times are nanoseconds of the host's monotonic clock (`CLOCK_MONOTONIC`), which every
//! process on one host shares and no wall-clock step moves, so the checker can order
//! events of different workers and the nemesis's pauses against each other.

use std::time::Instant;

use nix::time::{ClockId, clock_gettime};
use serde::{Deserialize, Serialize};

/// One thing a worker did, as it reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A lock was granted: `invoked` before the call, `granted` after its reply, `valid`
    /// the end of the validity the library reported.
    Grant {
        key: u32,
        token: u64,
        invoked: u64,
        granted: u64,
        valid: u64,
    },
    /// One step of the critical section: at `checked` the guard said held (valid until
    /// `valid`); the step then fenced its token, read the ledger (`read`) and wrote
    /// `read + 1`; `admitted` says whether the fenced write was let through. A step whose
    /// fence check already refused the token reads and writes nothing (`read` is `None`).
    Step {
        key: u32,
        token: u64,
        checked: u64,
        valid: u64,
        read: Option<u64>,
        admitted: bool,
    },
    /// At `at` the guard said the lease was no longer held; the job stopped.
    Lost { key: u32, token: u64, at: u64 },
    /// The holder is about to release the lease (`invoked`, before the call): reported
    /// before the request is sent, because a process killed once the store carried the
    /// release out but before it reported the outcome would otherwise leave the lease's
    /// window open to its death, and the next holder's grant, made after the release,
    /// would look like an overlap.
    Releasing { key: u32, token: u64, invoked: u64 },
    /// The lease's release was invoked at `invoked`: `Some(true)` released, `Some(false)`
    /// the store said it was no longer held by this owner, `None` the call failed (a store
    /// restarting) and the store may have carried it out all the same. From `invoked` on,
    /// the holder counts the lease as given up, whatever the outcome.
    Release {
        key: u32,
        token: u64,
        invoked: u64,
        released: Option<bool>,
    },
    /// A call failed (the store unreachable, a timeout); not a violation by itself.
    Error { at: u64, what: String },
}

impl Event {
    /// The lock (its index among the run's keys) the event is about, if any.
    pub fn key(&self) -> Option<u32> {
        match self {
            Event::Grant { key, .. }
            | Event::Step { key, .. }
            | Event::Lost { key, .. }
            | Event::Releasing { key, .. }
            | Event::Release { key, .. } => Some(*key),
            Event::Error { .. } => None,
        }
    }
}

/// Now, in nanoseconds of the host's monotonic clock.
pub fn now() -> u64 {
    // CLOCK_MONOTONIC cannot fail on Linux for a valid ClockId.
    clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        (t.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(t.tv_nsec() as u64)
    })
}

/// Converts a process-local [`Instant`] into [`now`]'s clock (Rust's `Instant` reads the
/// same monotonic clock, but does not show its value).
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    instant: Instant,
    mono: u64,
}

impl Clock {
    /// A converter anchored at this moment.
    pub fn new() -> Self {
        let instant = Instant::now();
        Self {
            instant,
            mono: now(),
        }
    }

    /// `at` in nanoseconds of the monotonic clock.
    pub fn of(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.mono.saturating_add(after.as_nanos() as u64),
            None => self
                .mono
                .saturating_sub((self.instant - at).as_nanos() as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn events_read_back_as_written() {
        let events = [
            Event::Grant {
                key: 1,
                token: 7,
                invoked: 1,
                granted: 2,
                valid: 3,
            },
            Event::Step {
                key: 1,
                token: 7,
                checked: 4,
                valid: 5,
                read: None,
                admitted: false,
            },
            Event::Error {
                at: 6,
                what: "down".into(),
            },
        ];
        for event in events {
            let line = serde_json::to_string(&event).unwrap();
            assert_eq!(
                serde_json::from_str::<Event>(&line).unwrap(),
                event,
                "{line}"
            );
        }
    }

    #[test]
    fn an_instant_converts_to_the_monotonic_clock_it_was_read_from() {
        let clock = Clock::new();
        let before = now();
        let instant = Instant::now();
        let after = now();
        let converted = clock.of(instant);
        // The anchor's two reads are a few hundred ns apart at most.
        let slack = Duration::from_millis(1).as_nanos() as u64;
        assert!(
            converted + slack >= before && converted <= after + slack,
            "{before} <= {converted} <= {after}"
        );
        assert_eq!(
            clock.of(instant + Duration::from_secs(1)) - converted,
            1_000_000_000
        );
    }
}
