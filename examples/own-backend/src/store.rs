//! [`TableStore`]: the store every client shares, its millisecond clock, and the hub that
//! wakes waiters when a key is released.

use std::sync::{Arc, Mutex, PoisonError};

use distlock::LockKey;
use distlock::backend::wake::{AllKeys, ReleaseHub};
use tokio::time::Instant;

use crate::client::TableClient;
use crate::table::Table;

/// A lock store in this process: one table of keys behind one lock, a clock in whole
/// milliseconds, and announcements of releases. Cheap to clone; every clone and every
/// [`TableClient`] of it is the same store.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use std::{sync::Arc, time::Duration};
/// use distlock::{LockKey, Locker};
/// use distlock_own_backend_example::TableStore;
///
/// let store = TableStore::new();
/// let locker = Locker::builder(Arc::new(store.client()))
///     .ttl(Duration::from_secs(5))
///     .build()?;
/// let key = LockKey::new("payout:42")?;
/// let first = locker.lock(&key).await?;
/// // Another client of the same store sees the key held.
/// let other = Locker::builder(Arc::new(store.client())).build()?;
/// assert!(other.try_lock(&key).await?.is_none());
/// let token = first.token();
/// first.release().await?;
/// assert!(other.lock(&key).await?.token() > token);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct TableStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    table: Mutex<Table>,
    /// The instant the store's clock reads zero.
    epoch: Instant,
    /// Wakes waiters of every client when a key is released.
    releases: ReleaseHub,
}

impl Default for TableStore {
    fn default() -> Self {
        Self::new()
    }
}

impl TableStore {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                table: Mutex::new(Table::default()),
                epoch: Instant::now(),
                releases: ReleaseHub::new(AllKeys),
            }),
        }
    }

    /// A new client: a separate backend instance on this store, whose leases no other
    /// client accepts (as with two connections to one server).
    pub fn client(&self) -> TableClient {
        TableClient::new(self.clone())
    }

    /// Runs `f` on the table under the store's lock, with the store's clock read under
    /// the same lock, so calls see time move forward in the order they hold the lock.
    pub(crate) fn with_table<R>(&self, f: impl FnOnce(&mut Table, u64) -> R) -> R {
        // Nothing panics while the lock is held, so a poisoned lock's table is whole.
        let mut table = self
            .shared
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = u64::try_from(self.shared.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        f(&mut table, now)
    }

    /// The hub the clients' waiters watch.
    pub(crate) fn releases(&self) -> &ReleaseHub {
        &self.shared.releases
    }

    /// Announces that `key` was released.
    pub(crate) fn announce_release(&self, key: &LockKey) {
        self.shared.releases.notify(key);
    }
}
