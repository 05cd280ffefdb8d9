//! [`TableClient`]: the [`LockBackend`] over a [`TableStore`].

use std::time::Duration;

use distlock::backend::wake::ReleaseWatch;
use distlock::backend::{BackendId, async_trait, valid_until};
use distlock::{
    Capabilities, Fence, Lease, LockBackend, LockError, LockInfo, LockKey, Release, Renewal,
};
use tokio::time::Instant;

use crate::store::TableStore;

const NAME: &str = "table";

/// One client of a [`TableStore`]: a backend instance with an id of its own, so a lease it
/// granted is refused by every other client as foreign.
///
/// TTLs from 3 ms (the shortest a lease is trusted for at all) to one day, in whole
/// milliseconds: the store's clock counts whole milliseconds and does not round.
#[derive(Debug)]
pub struct TableClient {
    id: BackendId,
    store: TableStore,
}

impl TableClient {
    pub(crate) fn new(store: TableStore) -> Self {
        Self {
            id: BackendId::next(),
            store,
        }
    }

    fn check_lease(&self, lease: &Lease) -> Result<(), LockError> {
        lease.check_backend(self.id, NAME)
    }
}

/// A TTL the capabilities accepted (whole milliseconds, at most a day) in milliseconds.
fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl LockBackend for TableClient {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            Duration::from_millis(1),
            Duration::from_millis(3),
            Duration::from_secs(24 * 3600),
        )
        .inspect(true)
        .wakes_waiters(true)
    }

    async fn acquire(&self, key: &LockKey, ttl: Duration) -> Result<Option<Lease>, LockError> {
        self.capabilities().check_ttl(ttl)?;
        // Validity counts from before the store saw the request.
        let sent = Instant::now();
        let granted = self
            .store
            .with_table(|table, now| table.grant(key, millis(ttl), now));
        Ok(granted.map(|(owner, token)| {
            Lease::new(
                self.id,
                key.clone(),
                owner,
                token,
                ttl,
                valid_until(sent, ttl),
            )
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<Renewal, LockError> {
        self.check_lease(lease)?;
        let sent = Instant::now();
        let ttl = lease.ttl();
        let extended = self.store.with_table(|table, now| {
            table.extend(lease.key(), lease.owner(), lease.token(), millis(ttl), now)
        });
        Ok(if extended {
            Renewal::Renewed {
                valid_until: valid_until(sent, ttl),
            }
        } else {
            Renewal::Lost
        })
    }

    async fn release(&self, lease: &Lease) -> Result<Release, LockError> {
        self.check_lease(lease)?;
        let freed = self
            .store
            .with_table(|table, now| table.free(lease.key(), lease.owner(), lease.token(), now));
        if !freed {
            return Ok(Release::NotHeld);
        }
        self.store.announce_release(lease.key());
        Ok(Release::Released)
    }

    async fn fence(&self, lease: &Lease) -> Result<Fence, LockError> {
        self.check_lease(lease)?;
        let fence = self
            .store
            .with_table(|table, now| table.fence(lease.key(), lease.owner(), lease.token(), now));
        Ok(match fence {
            Ok(()) => Fence::Current,
            Err(newest) => Fence::Stale {
                // A key purged since has no row: the lease's own token is all we know.
                current: newest.unwrap_or(lease.token()),
            },
        })
    }

    async fn inspect(&self, key: &LockKey) -> Result<LockInfo, LockError> {
        Ok(self.store.with_table(|table, now| table.info(key, now)))
    }

    fn watch_releases(&self, key: &LockKey) -> Option<ReleaseWatch> {
        Some(self.store.releases().watch(key))
    }

    /// The keys waiters watch on every client of the store (they share one hub).
    fn watched_keys(&self) -> Vec<LockKey> {
        self.store.releases().watched_keys()
    }

    /// Adopted leases act on the table as any other: it checks owner and token.
    fn adopts_as(&self) -> Option<BackendId> {
        Some(self.id)
    }

    async fn purge(&self, key: &LockKey) -> Result<(), LockError> {
        self.store.with_table(|table, _| table.remove(key));
        Ok(())
    }
}
