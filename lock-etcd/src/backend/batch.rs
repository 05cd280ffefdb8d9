//! Batches: one call per item, all in flight at once, and the items' results folded into
//! the batch's answer as the batch contract says.

use distlock_core::{Lease, LockBackend, LockError, LockKey};
use tracing::debug;

use super::EtcdBackend;

impl EtcdBackend {
    /// Releases the leases this backend took, on the error path of a batch.
    pub(super) async fn give_back(&self, leases: Vec<Lease>) {
        let releases = leases.iter().map(|lease| self.release(lease));
        let _ = futures::future::join_all(releases).await;
    }
}

/// Folds a batch's results, one per item, as the batch contract says: an item whose call
/// failed with a retryable error (no member answered it, or its reply was lost) becomes
/// `unreachable`, provided another item's call answered. Second comes the error to fail the
/// whole batch with, if any: the first error retrying cannot fix or, when no call answered,
/// the first error.
pub(super) fn per_item<T: Clone>(
    results: Vec<Result<T, LockError>>,
    unreachable: T,
) -> (Vec<T>, Option<LockError>) {
    let answered = results.iter().any(Result::is_ok);
    let mut failure: Option<LockError> = None;
    let items = results
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|e| {
                // Said here, or nobody learns why an item came back not done.
                debug!(error = %e, "a call of a batch failed");
                let fatal = !e.is_retryable();
                let first_fatal = fatal && failure.as_ref().is_none_or(LockError::is_retryable);
                if first_fatal || (!answered && failure.is_none()) {
                    failure = Some(e);
                }
                unreachable.clone()
            })
        })
        .collect();
    (items, failure)
}

/// Splits a batch into waves of indices in which every key appears at most once: the
/// `n`-th lease of a key goes in wave `n`, so calls on one key keep their order.
pub(super) fn waves(leases: &[Lease]) -> Vec<Vec<usize>> {
    let mut seen: std::collections::HashMap<&LockKey, usize> = std::collections::HashMap::new();
    let mut waves: Vec<Vec<usize>> = Vec::new();
    for (i, lease) in leases.iter().enumerate() {
        let n = seen.entry(lease.key()).or_insert(0);
        if waves.len() <= *n {
            waves.push(Vec::new());
        }
        waves[*n].push(i);
        *n += 1;
    }
    waves
}

#[cfg(test)]
mod tests {
    use distlock_core::Release;

    use super::*;
    use crate::error::NAME;

    fn unavailable() -> LockError {
        LockError::unavailable(NAME, "no member answered")
    }

    #[test]
    fn batch_items_that_failed_retryably_are_unreachable_while_others_answered() {
        let results = vec![
            Ok(Release::Released),
            Err(unavailable()),
            Ok(Release::NotHeld),
        ];
        let (items, failure) = per_item(results, Release::Unreachable);
        assert_eq!(
            items,
            [Release::Released, Release::Unreachable, Release::NotHeld]
        );
        assert!(failure.is_none(), "{failure:?}");
    }

    #[test]
    fn a_batch_fails_when_no_item_answered_or_an_error_cannot_be_retried() {
        let (_, failure) =
            per_item::<Option<()>>(vec![Err(unavailable()), Err(unavailable())], None);
        assert!(matches!(failure, Some(LockError::Unavailable { .. })));
        let config = LockError::Config("refused".into());
        let (_, failure) = per_item(vec![Ok(None), Err(unavailable()), Err(config)], None::<()>);
        assert!(matches!(failure, Some(LockError::Config(_))), "{failure:?}");
    }
}
