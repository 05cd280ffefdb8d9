//! The ballast of a full semaphore: the permits (and the lock) that other processes hold
//! while the tasks wait or are refused, taken on a backend instance of their own with a
//! TTL longer than the run, so that nothing renews them during the rounds.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{Lease, LockBackend, LockKey};
use tokio::time::Instant;

use super::attempts::Attempted;
use crate::error::BenchError;
use crate::subject::SubjectId;

/// The ballast's TTL: longer than any run, so its leases need no renewal.
const BALLAST_TTL: Duration = Duration::from_secs(30 * 60);

/// How long the slot the waits have free may stay held after their round: a wait that
/// ran out gives back what its last attempt took in a task of its own, soon after, or
/// where the store's grant came after the deadline, by the lease's TTL.
const FREE_WITHIN: Duration = Duration::from_secs(crate::subject::TTL.as_secs() + 5);

/// Leases held by another instance of the backend, released at the end.
pub(super) struct Ballast {
    id: SubjectId,
    backend: Arc<dyn LockBackend>,
    held: Vec<Lease>,
}

impl Ballast {
    pub(super) fn new(id: SubjectId, backend: Arc<dyn LockBackend>) -> Self {
        Self {
            id,
            backend,
            held: Vec::new(),
        }
    }

    fn lock_err(&self, source: distlock_core::LockError) -> BenchError {
        BenchError::Lock {
            subject: self.id.slug(),
            source,
        }
    }

    /// Why the ballast cannot fill a semaphore of `n` permits, if it cannot: every
    /// ballast held at once must fit in what one instance may hold.
    pub(super) fn cannot_hold(&self, n: u32) -> Option<String> {
        let max = self.backend.capabilities().max_held?;
        let needed = usize::try_from(n).unwrap_or(usize::MAX);
        (needed > max).then(|| {
            format!(
                "a full semaphore of {n} permits is {n} leases held at once, and one instance \
                 of this backend holds at most {max} (each pins a server session)"
            )
        })
    }

    /// Takes what it holds for the whole run: the lock key the tasks are refused, and
    /// every slot of each semaphore but the first, the one the waits have free.
    pub(super) async fn hold_throughout(
        &mut self,
        cases: &[(Attempted, u32)],
    ) -> Result<(), BenchError> {
        for (attempted, _) in cases {
            match attempted {
                Attempted::Lock { held, .. } => self.hold(std::slice::from_ref(held)).await?,
                Attempted::Permits(semaphore) => self.hold(&semaphore.slots()[1..]).await?,
            }
        }
        Ok(())
    }

    /// Takes every key of `keys`, all free.
    async fn hold(&mut self, keys: &[LockKey]) -> Result<(), BenchError> {
        let granted = self
            .backend
            .acquire_many(keys, BALLAST_TTL)
            .await
            .map_err(|e| self.lock_err(e))?;
        let taken = granted.iter().flatten().count();
        self.held.extend(granted.into_iter().flatten());
        if taken < keys.len() {
            return Err(BenchError::Unexpected {
                subject: self.id.slug(),
                detail: format!("the ballast took {taken} of {} free keys", keys.len()),
            });
        }
        Ok(())
    }

    /// Takes `key`, waiting up to [`FREE_WITHIN`] for it to come free.
    pub(super) async fn hold_within(&mut self, key: &LockKey) -> Result<(), BenchError> {
        let deadline = Instant::now() + FREE_WITHIN;
        loop {
            let granted = self
                .backend
                .acquire(key, BALLAST_TTL)
                .await
                .map_err(|e| self.lock_err(e))?;
            if let Some(lease) = granted {
                self.held.push(lease);
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(BenchError::Unexpected {
                    subject: self.id.slug(),
                    detail: format!(
                        "{key} was still held {FREE_WITHIN:?} after the waits' round ended"
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Releases the ballast's lease on `key`.
    pub(super) async fn let_go(&mut self, key: &LockKey) -> Result<(), BenchError> {
        let Some(at) = self.held.iter().position(|l| l.key() == key) else {
            return Ok(());
        };
        let lease = self.held.swap_remove(at);
        self.backend
            .release(&lease)
            .await
            .map_err(|e| self.lock_err(e))?;
        Ok(())
    }

    /// Releases everything still held (their TTL frees them otherwise).
    pub(super) async fn release(&mut self) -> Result<(), BenchError> {
        let held = std::mem::take(&mut self.held);
        for chunk in held.chunks(1_000) {
            self.backend
                .release_many(chunk)
                .await
                .map_err(|e| self.lock_err(e))?;
        }
        Ok(())
    }
}
