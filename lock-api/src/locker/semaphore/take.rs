//! One attempt at `k` permits ([`Taking`]): slots taken one by one with
//! [`LockBackend::acquire_any`], all kept or all given back, in a future that, if dropped
//! before it hands them over, finishes in a task of its own and gives back whatever it
//! took.
//!
//! Why: a backend call dropped at an await point may already have taken a slot in the
//! store (the request went out, the reply had not come back). Redis gives such a slot back
//! itself; the other stores leave it held until its TTL runs out. Finishing the call
//! instead of dropping it knows what it took, so every backend gives it back at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tracing::debug;

use crate::backend::LockBackend;
use crate::backend::lease::Lease;
use crate::error::LockError;
use crate::key::LockKey;

/// What an attempt got.
pub(super) enum Taken {
    /// `k` leases on distinct slots.
    All(Vec<Lease>),
    /// Fewer than `k` were free; the attempt gave back the `given_back` it had taken.
    TooFew {
        /// How many slots it took and gave back (each a release other waiters hear).
        given_back: usize,
    },
}

/// The call inside a [`Taking`]: owns everything it uses, so it can finish elsewhere.
type Call = Pin<Box<dyn Future<Output = Result<Taken, LockError>> + Send>>;

/// An attempt at `k` of `slots`: [`Taken::All`], [`Taken::TooFew`] holding nothing, or the
/// error of a call (holding nothing). Dropped before it completes, it
/// finishes in a spawned task and releases what it took (where no runtime is left to run
/// it, the leases free themselves when their TTL runs out).
pub(super) struct Taking {
    call: Option<Call>,
    backend: Arc<dyn LockBackend>,
    /// Polled at least once: before that, nothing was sent, and a drop sends nothing.
    started: bool,
}

impl Taking {
    /// Starts taking `k` (1 to N) of a semaphore's N slots for `ttl` on `backend`, trying
    /// them from slot 0 where the store finds the first free slot from an index
    /// ([`Capabilities::permit_index`](crate::Capabilities::permit_index)), else from a
    /// random one onwards, so that processes do not all contend for slot 0. `ring` is the
    /// slots twice over (see `Semaphore`).
    pub(super) fn new(
        backend: Arc<dyn LockBackend>,
        ring: Arc<[LockKey]>,
        k: usize,
        ttl: Duration,
    ) -> Self {
        let call = Box::pin(take(backend.clone(), ring, k, ttl));
        Self {
            call: Some(call),
            backend,
            started: false,
        }
    }
}

impl Future for Taking {
    type Output = Result<Taken, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(call) = this.call.as_mut() else {
            return Poll::Ready(Err(LockError::Config(
                "a permit attempt was polled after it completed".into(),
            )));
        };
        this.started = true;
        let taken = ready!(call.as_mut().poll(cx));
        // Handed over: from here the caller owns the leases.
        this.call = None;
        Poll::Ready(taken)
    }
}

impl Drop for Taking {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        if !self.started {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.backend.clone();
        runtime.spawn(async move {
            if let Ok(Taken::All(leases)) = call.await {
                give_back(
                    backend.as_ref(),
                    &leases,
                    "a permit attempt whose caller had gone",
                )
                .await;
            }
        });
    }
}

/// [`Taking`]'s call: `acquire_any` over the slots not yet tried, until `k` are taken or
/// one finds none free; then all of them are kept, or all given back. The slots asked for
/// are always one slice of `ring` (the N slots twice over): from the first slot (see
/// [`first_asked`]), N of them, and after a grant, those after the granted one; no key is
/// copied.
async fn take(
    backend: Arc<dyn LockBackend>,
    ring: Arc<[LockKey]>,
    k: usize,
    ttl: Duration,
) -> Result<Taken, LockError> {
    let n = ring.len() / 2;
    let (mut from, to) = {
        let start = first_asked(backend.as_ref(), n);
        (start, start + n)
    };
    let mut taken: Vec<Lease> = Vec::with_capacity(k);
    while taken.len() < k {
        let order = &ring[from..to];
        let granted = match backend.acquire_any(order, ttl).await {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                give_back(backend.as_ref(), &taken, "too few free permits").await;
                return Ok(Taken::TooFew {
                    given_back: taken.len(),
                });
            }
            Err(error) => {
                give_back(backend.as_ref(), &taken, "a failed permit attempt").await;
                return Err(error);
            }
        };
        // The slots before the granted one were held when asked: the next call starts
        // after it.
        let Some(at) = position(order, from % n, n, granted.key()) else {
            // Not one of ours: give it back rather than count it as a permit.
            let stray = granted.key().clone();
            taken.push(granted);
            give_back(backend.as_ref(), &taken, "a key granted outside the slots").await;
            return Err(LockError::Backend {
                backend: backend.name(),
                source: format!(
                    "acquire_any granted {stray}, which is not one of the keys asked for"
                )
                .into(),
            });
        };
        from += at + 1;
        taken.push(granted);
    }
    Ok(Taken::All(taken))
}

/// The slot an attempt on a semaphore of `n` slots asks for first: slot 0 where the store
/// finds the first free slot from an index, in one look whatever is held before it (on
/// Redis one `BITPOS`, where a later start also needs the slots from there); else a random
/// one, so that stores that look slot by slot are not all asked slot 0 first.
pub fn first_asked(backend: &dyn LockBackend, n: usize) -> usize {
    if backend.capabilities().permit_index {
        0
    } else {
        rand::random_range(0..n)
    }
}

/// Where `key` is in `order`, the slots of a semaphore of `n` from slot `first` onwards:
/// read from the slot number its name ends with, and checked against the key there.
fn position(order: &[LockKey], first: usize, n: usize, key: &LockKey) -> Option<usize> {
    let slot: usize = key.permit_slot()?.1.parse().ok()?;
    let at = (slot + n - first) % n;
    (order.get(at) == Some(key)).then_some(at)
}

/// Releases `leases` (best effort: what fails frees itself when its TTL runs out); `why`
/// is for the log.
async fn give_back(backend: &dyn LockBackend, leases: &[Lease], why: &str) {
    if leases.is_empty() {
        return;
    }
    if let Err(error) = backend.release_many(leases).await {
        debug!(leases = leases.len(), %error, why, "giving back permit slots failed; they run out on their own");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granted_slot_is_found_where_it_is_in_the_slice_asked_for() {
        let ring: Vec<LockKey> = (0..8)
            .chain(0..8)
            .map(|i| LockKey::new(format!("s:permit:{i}")).unwrap())
            .collect();
        let key = |name: &str| LockKey::new(name).unwrap();
        // From slot 5: 5 6 7 0 1 2 3 4.
        let order = &ring[5..13];
        assert_eq!(position(order, 5, 8, &key("s:permit:5")), Some(0));
        assert_eq!(position(order, 5, 8, &key("s:permit:6")), Some(1));
        assert_eq!(position(order, 5, 8, &key("s:permit:0")), Some(3));
        assert_eq!(position(order, 5, 8, &key("s:permit:4")), Some(7));
        // After a grant at slot 7: 0 1 2 3 4 left; slot 5 is no longer asked for.
        let order = &ring[8..13];
        assert_eq!(position(order, 0, 8, &key("s:permit:2")), Some(2));
        assert_eq!(position(order, 0, 8, &key("s:permit:5")), None);
        // Not one of the slots: another semaphore's, beyond N, not canonical, not a slot.
        for stray in ["t:permit:2", "s:permit:9", "s:permit:02", "s"] {
            assert_eq!(position(&ring[0..8], 0, 8, &key(stray)), None, "{stray}");
        }
    }
}
