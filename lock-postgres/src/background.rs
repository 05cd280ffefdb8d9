//! [`Background`]: a task of the backend's own (the announcer),
//! started on first use in the caller's runtime and started again there if it ended (its
//! runtime shut down).

use std::future::Future;
use std::sync::{Mutex, PoisonError};

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

#[derive(Default)]
pub(crate) struct Background(Mutex<Option<JoinHandle<()>>>);

impl Background {
    /// Starts `task()` unless it runs; false outside a tokio runtime, where none can run.
    pub(crate) fn ensure_running<F>(&self, task: impl FnOnce() -> F) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|t| !t.is_finished()) {
            return true;
        }
        let Ok(runtime) = Handle::try_current() else {
            return false;
        };
        *slot = Some(runtime.spawn(task()));
        true
    }
}
