//! [`LockedService`]: the inner service each of this module's layers wraps, named once.

use tower_service::Service;

use super::job::Locked;

/// A service that runs a job `R` handed over as [`Locked<R>`], which [`LockService`],
/// [`LeaderService`] and [`TickService`] can wrap: cloneable, and sendable with its
/// future, response and error, since a wrapped call runs on a spawned task.
///
/// Every such service is one (a blanket implementation); nothing to implement.
///
/// [`LockService`]: super::LockService
/// [`LeaderService`]: super::LeaderService
/// [`TickService`]: super::TickService
pub trait LockedService<R>:
    Service<Locked<R>, Future: Send, Response: Send, Error: Send> + Clone + Send + 'static
{
}

impl<S, R> LockedService<R> for S where
    S: Service<Locked<R>, Future: Send, Response: Send, Error: Send> + Clone + Send + 'static
{
}
