//! [`Background`]: a task of a backend's own (its release listener, PostgreSQL's
//! announcer), started on first use in the caller's runtime and started again there if it
//! ended (its runtime shut down).

use std::future::Future;

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle};

/// A task of a backend's own, started by [`Background::ensure_running`].
#[derive(Debug, Default)]
pub struct Background(Mutex<Option<JoinHandle<()>>>);

impl Background {
    /// Starts `task()` unless it runs; false outside a tokio runtime, where none can run.
    pub fn ensure_running<F>(&self, task: impl FnOnce() -> F) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let mut slot = self.0.lock();
        if slot.as_ref().is_some_and(|t| !t.is_finished()) {
            return true;
        }
        let Ok(runtime) = Handle::try_current() else {
            return false;
        };
        *slot = Some(runtime.spawn(task()));
        true
    }

    /// The task, once one was started: to see it end.
    pub fn abort_handle(&self) -> Option<AbortHandle> {
        self.0.lock().as_ref().map(JoinHandle::abort_handle)
    }
}
