//! [`Waiting`]: how a waiter for a key waits between its attempts, the same for
//! [`crate::Locker::lock`] and [`crate::Election::campaign`].
//!
//! Where the backend announces releases ([`crate::LockBackend::watch_releases`]), a key
//! held by another is waited for until its release is announced, and the policy's longest
//! backoff is only the fallback for a release that was not (a TTL that ran out, a lost
//! message). A failed attempt, and every attempt on a backend that announces nothing,
//! waits the growing jittered backoff instead.

use std::time::Duration;

use futures::future::select_all;
use tokio::time::sleep;

use crate::backend::LockBackend;
use crate::backend::wake::ReleaseWatch;
use crate::key::LockKey;
use crate::locker::RetryPolicy;

/// One waiter's state between attempts: its release watches and how many attempts it made.
pub(crate) struct Waiting {
    /// One watch per key waited for; `None` where the backend announces nothing.
    releases: Option<Vec<ReleaseWatch>>,
    retry: RetryPolicy,
    attempt: u32,
}

impl Waiting {
    /// Starts watching `key`'s releases. Call it before the first attempt, so that a
    /// release between a refused attempt and the wait after it still wakes this waiter.
    pub(crate) fn new(backend: &dyn LockBackend, key: &LockKey, retry: RetryPolicy) -> Self {
        Self {
            releases: backend.watch_releases(key).map(|watch| vec![watch]),
            retry,
            attempt: 0,
        }
    }

    /// Starts watching the releases of a semaphore's permit slots, for a waiter that takes
    /// whichever frees first: with one watch of them all where the backend offers it
    /// ([`LockBackend::watch_permit_releases`]), else one per slot. A backend that returns
    /// no watch for one of them is polled, as one that announces nothing.
    pub(crate) fn permits(
        backend: &dyn LockBackend,
        slots: &[LockKey],
        retry: RetryPolicy,
    ) -> Self {
        let releases = match backend.watch_permit_releases(slots) {
            Some(watch) => Some(vec![watch]),
            None => slots
                .iter()
                .map(|key| backend.watch_releases(key))
                .collect(),
        };
        Self {
            releases,
            retry,
            attempt: 0,
        }
    }

    /// How long to wait after an attempt that found the key held by another
    /// (`held_by_another`) or failed with a retryable error.
    pub(crate) fn after_attempt(&mut self, held_by_another: bool) -> Duration {
        let wait = if self.releases.is_some() && held_by_another {
            self.retry.backoff(u32::MAX)
        } else {
            self.retry.backoff(self.attempt)
        };
        self.attempt = self.attempt.saturating_add(1);
        wait
    }

    /// Waits `wait`, or less if a release of one of the keys is announced first.
    ///
    /// # Cancel safety
    /// Cancel safe: a wake received by a cancelled wait goes to another waiter of the key
    /// or stays for the next one, and so does a wake of a second key that arrived
    /// together with the one that ended the wait.
    pub(crate) async fn wait(&mut self, wait: Duration) {
        match self.releases.as_deref_mut() {
            Some([watch]) => {
                tokio::select! {
                    () = watch.released() => {}
                    () = sleep(wait) => {}
                }
            }
            Some(watches) if !watches.is_empty() => {
                let released = select_all(watches.iter_mut().map(|w| Box::pin(w.released())));
                tokio::select! {
                    _ = released => {}
                    () = sleep(wait) => {}
                }
            }
            _ => sleep(wait).await,
        }
    }
}
