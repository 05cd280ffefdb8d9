//! Keeping a lock's lease: renewal (the key checked and one keep-alive, both at once),
//! the lease of an adopted lock found from its key, and revoking.
//!
//! # Why renewal never extends someone else's lock
//!
//! Renewal checks the key (its value is the lease's `<owner id>:<token>`) and sends one
//! `LeaseKeepAlive` for the lock's own lease, both at once. A key is bound to the lease it
//! was created with for its whole life, so a keep-alive can only ever extend *this*
//! acquisition's key. If that key was deleted (released, or deleted by hand) the keep-alive
//! extends an empty lease, which holds nothing and lapses by itself; a new holder's key has
//! its own lease, which this renewal never touches. A lease that already expired is gone
//! from etcd and cannot be kept alive: the keep-alive answers TTL 0 and renewal is `Lost`.

use std::time::Duration;

use distlock_core::{Lease, LockError, Renewal, valid_until};
use etcd_client::Txn;
use tokio::time::Instant;

use super::{EtcdBackend, is_held_by};
use crate::error::Effect;

/// How often renewal asks again when the key is held but the leader does not know its lease.
const KEEP_ALIVE_RETRIES: u32 = 3;
const KEEP_ALIVE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The lease a lock key is attached to, kept in the [`Lease`] so that renew and release
/// need not look it up.
#[derive(Debug, Clone, Copy)]
pub(super) struct EtcdLease {
    pub(super) id: i64,
}

impl EtcdBackend {
    /// Revokes a lease in the background: used when the lease holds no lock (a contended
    /// acquire, a released lock) or must not hold one (an acquire whose reply was lost).
    /// Revoking only ever deletes keys attached to *this* lease, so it cannot harm another
    /// holder; if the revoke is lost too, the lease lapses by itself within its TTL.
    /// Outside a tokio runtime (an acquire dropped as its runtime shuts down) nothing is
    /// sent.
    pub(super) fn revoke_in_background(&self, lease_id: i64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.clone();
        runtime.spawn(async move { backend.revoke(lease_id).await });
    }

    /// Revokes a lease, deleting the keys attached to it; errors are the caller's to ignore.
    pub(super) async fn revoke(&self, lease_id: i64) -> Result<(), LockError> {
        self.call(Effect::Write("revoke"), |client| async move {
            client.lease_client().revoke(lease_id).await
        })
        .await
        .map(drop)
    }

    /// The lease a lock key is attached to, and the TTL etcd granted it: from the
    /// [`Lease`]'s handle (its TTL was checked when it was granted), or, for an adopted
    /// lease, read from the key (only while the key still belongs to `lease`) and from
    /// etcd's record of the lease, since the TTL given to `adopt` is only what the caller
    /// believes.
    async fn lease_of(&self, lease: &Lease) -> Result<Option<(i64, Duration)>, LockError> {
        if let Some(handle) = lease.handle::<EtcdLease>() {
            return Ok(Some((handle.id, lease.ttl())));
        }
        let found = self.lookup(lease.key()).await?;
        let Some(lease_id) = found
            .lock()
            .filter(|kv| is_held_by(kv, lease))
            .map(|kv| kv.lease())
            .filter(|&id| id != 0)
        else {
            return Ok(None);
        };
        let live = self
            .call(Effect::None, |client| async move {
                client.lease_client().time_to_live(lease_id, None).await
            })
            .await?;
        // An expired lease answers TTL -1 and no granted TTL.
        Ok(u64::try_from(live.granted_ttl())
            .ok()
            .filter(|&granted| granted > 0 && live.ttl() >= 0)
            .map(|granted| (lease_id, Duration::from_secs(granted))))
    }

    /// Checks the key and keeps its lease alive, both in flight at once (see the module docs).
    pub(super) async fn renew_sent(
        &self,
        lease: &Lease,
        sent: Instant,
    ) -> Result<Renewal, LockError> {
        let Some((lease_id, granted_ttl)) = self.lease_of(lease).await? else {
            return Ok(Renewal::Lost);
        };
        let check = Txn::new().when([self.held_by(lease)]);
        let (check, kept) = tokio::join!(
            self.txn(Effect::None, check),
            self.keep_alive_once(lease_id)
        );
        if !check?.succeeded() {
            return Ok(Renewal::Lost);
        }
        if kept? {
            return Ok(Renewal::Renewed {
                valid_until: valid_until(sent, granted_ttl),
            });
        }
        // The key was held at a linearizable read, yet the leader did not know its lease:
        // a leader that has not applied the grant yet (in a cluster, the member that
        // answered the grant may apply it first). Ask again; a lease that really expired
        // stays unknown and the renewal is `Lost`.
        for _ in 0..KEEP_ALIVE_RETRIES {
            tokio::time::sleep(KEEP_ALIVE_RETRY_PAUSE).await;
            let retry_sent = Instant::now();
            if self.keep_alive_once(lease_id).await? {
                return Ok(Renewal::Renewed {
                    valid_until: valid_until(retry_sent, granted_ttl),
                });
            }
        }
        Ok(Renewal::Lost)
    }

    /// One `LeaseKeepAlive` round trip: `Ok(false)` when etcd does not know the lease.
    async fn keep_alive_once(&self, lease_id: i64) -> Result<bool, LockError> {
        self.call(Effect::Write("renew"), |client| async move {
            match client.lease_client().keep_alive(lease_id).await {
                Ok(_) => Ok(true),
                Err(e) if is_lease_gone(&e) => Ok(false),
                Err(e) => Err(e),
            }
        })
        .await
    }
}

fn is_lease_gone(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("not found"),
        etcd_client::Error::GRpcStatus(s) => s.message().contains("requested lease not found"),
        _ => false,
    }
}
