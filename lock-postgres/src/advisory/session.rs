//! The server session behind an advisory lease: a pooled connection that runs the acquire
//! and, once the lock is taken, stays pinned to the lease (with the capacity it takes up)
//! until release; renewal and fence check that it is still the session that took the lock.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::{FencingToken, Lease, LockError, LockKey, OwnerId, Renewal, valid_until};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Postgres};
use tokio::sync::{Mutex, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::keys::split;
use super::{NAME, PgAdvisoryBackend};
use crate::client::{owner_uuid, token_from, ttl_ms};
use crate::error::Operation;

/// How many keepalive probes go unanswered before the server drops a session.
const KEEPALIVE_PROBES: i64 = 3;

/// Checks that this session holds the advisory lock `(classid, objid)` of a bigint key.
/// Also returns the server session's pid, which must be the one that took the lock.
/// Reads `pg_locks`, which takes every lock-manager partition lock: `fence` only.
const HOLDS: &str = "SELECT pg_backend_pid() AS pid, EXISTS (SELECT 1 FROM pg_locks \
     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
       AND classid = $1::bigint::oid AND objid = $2::bigint::oid AND objsubid = 1)";

/// The renewal's check: the server session that took the lock still answers. A
/// session-level advisory lock lasts until it is unlocked or its session ends, and on a
/// pinned session nothing but `release` (which unpins it) unlocks, so the live session
/// with the pid that took the lock is the proof. `pg_locks`, whose cost grows with every
/// lock on the server, is not read once per held lock per renewal.
const ALIVE: &str = "SELECT pg_backend_pid() AS pid, true";

/// The private handle of an advisory lease: the pinned session, while it is pinned.
pub(super) struct Session {
    pub(super) key: i64,
    /// The server session (`pg_backend_pid()`) that took the lock.
    pub(super) pid: i32,
    owner: OwnerId,
    token: FencingToken,
    pub(super) pinned: Mutex<Option<Pinned>>,
}

/// A connection pinned to a held lock, with the capacity it takes up; both are given
/// back when it is taken out of its [`Session`] (release, or loss found).
pub(super) struct Pinned {
    pub(super) conn: PoolConnection<Postgres>,
    _slot: OwnedSemaphorePermit,
    _held: Held,
}

/// A connection while an acquire runs on it, closed on drop unless the acquire finished.
/// Once its statement is sent, an acquire may take the lock even when the caller's future
/// is then dropped or the reply is lost, and a session lock outlives the statement: such
/// a connection must never go back to the pool, where it would keep holding the lock.
struct Attempt<'a> {
    conn: &'a mut PoolConnection<Postgres>,
    finished: bool,
}

impl Attempt<'_> {
    /// The statement completed and its result is in hand: the connection is either about
    /// to be pinned to the new lease or, lock not taken, clean for the pool.
    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

/// Counts one held lock while it lives.
struct Held(Arc<AtomicUsize>);

impl Held {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Still pinned: the lease was dropped without release. Closing the session frees
        // the lock; returning it to the pool would leak the lock to the next user.
        if let Some(pinned) = self.pinned.get_mut().take() {
            close(pinned);
        }
    }
}

/// Closes a pinned connection, which ends its server session and so frees any lock it
/// still holds. Inside a tokio runtime the pool closes it (in a task of its own);
/// outside one (a lease dropped after `block_on` returned) no task can be spawned, so
/// the connection leaves the pool and its socket is closed at once.
pub(super) fn close(pinned: Pinned) {
    let Pinned { mut conn, .. } = pinned;
    if tokio::runtime::Handle::try_current().is_ok() {
        conn.close_on_drop();
    } else {
        drop(conn.detach());
    }
}

/// A pinned connection taken out of its session while a release runs on it: closed on
/// drop unless [`give_back`](Self::give_back) or [`keep`](Self::keep) took it. Once the
/// release's statement is sent, a cancelled release leaves the reply pending and the lock
/// perhaps already freed: the session must not stay pinned to a lease (a later renewal
/// would read the pending reply and report the lock held), nor go back to the pool
/// (where it may still hold the lock).
pub(super) struct Releasing(Option<Pinned>);

impl Releasing {
    pub(super) fn new(pinned: Pinned) -> Self {
        Self(Some(pinned))
    }

    /// The connection, while it is held here.
    pub(super) fn conn(&mut self) -> &mut PoolConnection<Postgres> {
        &mut self.0.as_mut().expect("held until given back or kept").conn
    }

    /// The lock is freed and the session reset: the connection goes back to the pool.
    pub(super) fn give_back(mut self) {
        self.0.take();
    }

    /// The connection stays pinned to its lease after all.
    pub(super) fn keep(mut self) -> Option<Pinned> {
        self.0.take()
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        if let Some(pinned) = self.0.take() {
            close(pinned);
        }
    }
}

impl PgAdvisoryBackend {
    /// The session of a lease granted by this backend; `None` for a lease that does not
    /// carry this acquisition's session (another owner or token), which holds nothing.
    pub(super) fn session<'a>(&self, lease: &'a Lease) -> Result<Option<&'a Session>, LockError> {
        lease.check_backend(self.id, NAME)?;
        Ok(lease
            .handle::<Session>()
            .filter(|s| s.owner == lease.owner() && s.token == lease.token()))
    }

    fn exhausted(&self) -> LockError {
        LockError::unavailable(
            NAME,
            format!(
                "all {} lock slots are in use: each held advisory lock pins one of the \
                 pool's connections; release a lock or raise pool_size",
                self.max_held
            ),
        )
    }

    /// Acquires with the validity counted from `sent` (taken before anything was sent).
    pub(super) async fn acquire_sent(
        &self,
        key: &LockKey,
        ttl: Duration,
        sent: Instant,
    ) -> Result<Option<Lease>, LockError> {
        self.check_pooling().await?;
        if self.held.load(Ordering::SeqCst) >= self.max_held {
            return Err(self.exhausted());
        }
        // Attempts in flight finish quickly; wait for one of them, not for a lock holder.
        let slot = tokio::time::timeout(
            self.client.connect_timeout,
            self.slots.clone().acquire_owned(),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .ok_or_else(|| self.exhausted())?;
        let id = self.lock_id(key);
        let ms = ttl_ms(ttl);
        // Keepalive probes start after a third of the TTL and give up after about one TTL.
        let keepalive_secs = (ms / 1000 / (KEEPALIVE_PROBES + 1)).max(1);
        let owner = OwnerId::random();
        let mut conn = self.client.conn(NAME).await?;
        let attempt = Attempt {
            conn: &mut conn,
            finished: false,
        };
        let (held_before, pid, token): (i64, i32, Option<i64>) = self
            .client
            .timed(
                NAME,
                Operation::Acquire,
                sqlx::query_as(AssertSqlSafe(self.sql.acquire.clone()))
                    .bind(id)
                    .bind(key.as_str())
                    .bind(ms.to_string())
                    .bind(keepalive_secs.to_string())
                    .bind(KEEPALIVE_PROBES.to_string())
                    .bind(owner_uuid(owner))
                    .bind(ms)
                    .fetch_one(&mut **attempt.conn),
            )
            .await
            .map_err(|failed| failed.error)?;
        if held_before != 0 {
            // Dropping the attempt closes the session, and so frees what it held.
            return Err(LockError::unavailable(
                NAME,
                "the pooled session already held a lock taken through another connection \
                 (its session setting distlock.holds says so); it was closed. Behind a \
                 transaction-pooling proxy (PgBouncer pool_mode = transaction or statement) \
                 advisory locks cannot work",
            ));
        }
        attempt.finish();
        let Some(token) = token else {
            return Ok(None);
        };
        let token = token_from(token);
        let session = Session {
            key: id,
            pid,
            owner,
            token,
            pinned: Mutex::new(Some(Pinned {
                conn,
                _slot: slot,
                _held: Held::new(&self.held),
            })),
        };
        let lease = Lease::new(
            self.id,
            key.clone(),
            owner,
            token,
            ttl,
            valid_until(sent, ttl),
        );
        Ok(Some(lease.with_handle(Arc::new(session))))
    }

    /// Renews with the validity counted from `sent`.
    pub(super) async fn renew_sent(
        &self,
        lease: &Lease,
        sent: Instant,
    ) -> Result<Renewal, LockError> {
        let Some(session) = self.session(lease)? else {
            return Ok(Renewal::Lost);
        };
        Ok(if self.holds(session, Operation::Renew).await? {
            Renewal::Renewed {
                valid_until: valid_until(sent, lease.ttl()),
            }
        } else {
            Renewal::Lost
        })
    }

    /// Whether the pinned session still holds the lock; `None` when the session is gone
    /// (and then the connection has been dropped, closing it).
    pub(super) async fn holds(&self, session: &Session, op: Operation) -> Result<bool, LockError> {
        let mut slot = session.pinned.lock().await;
        let Some(pinned) = slot.as_mut() else {
            return Ok(false);
        };
        let (classid, objid) = split(session.key);
        let result = self
            .client
            .timed(
                NAME,
                op,
                if op == Operation::Renew {
                    sqlx::query_as::<_, (i32, bool)>(ALIVE)
                } else {
                    sqlx::query_as::<_, (i32, bool)>(HOLDS)
                        .bind(classid)
                        .bind(objid)
                }
                .fetch_one(&mut *pinned.conn),
            )
            .await;
        match result {
            // Left pinned: closing this client connection would not end the proxy's
            // server sessions, and a lease dropped later closes it anyway.
            Ok((pid, _)) if pid != session.pid => Err(session_moved(session.pid, Some(pid))),
            Ok((_, true)) => Ok(true),
            Ok((_, false)) => {
                // Nothing else unlocks on this session; unpin it rather than trust it.
                unpin(&mut slot);
                Ok(false)
            }
            Err(failed) if failed.broken => {
                // The session is gone or unusable, and with it the lock.
                unpin(&mut slot);
                Ok(false)
            }
            Err(failed) => Err(failed.error),
        }
    }
}

/// The error for a lease whose connection no longer reaches the server session that took
/// its lock (`now`, when known): only a proxy that pools server sessions per transaction
/// or statement does that.
pub(super) fn session_moved(took: i32, now: Option<i32>) -> LockError {
    let now = now.map_or_else(
        || "another server session".to_owned(),
        |p| format!("server session {p}"),
    );
    LockError::Config(format!(
        "the advisory lock was taken by server session {took}, but its connection now \
         reaches {now}: a transaction-pooling proxy (PgBouncer pool_mode = transaction or \
         statement) is between client and server. Advisory locks need the session: \
         connect directly or through a session-mode pool"
    ))
}

/// Takes the pinned connection out of its session and closes it, which ends the server
/// session and so frees any lock it still holds.
pub(super) fn unpin(slot: &mut Option<Pinned>) {
    if let Some(pinned) = slot.take() {
        close(pinned);
    }
}

#[cfg(test)]
mod tests {
    use distlock_core::LockBackend;

    use super::*;

    /// Behind a transaction-pooling proxy a lease's connection reaches whichever server
    /// session the proxy picks. Swapping two leases' pinned connections does exactly
    /// that, on a real server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_answered_by_another_server_session_names_the_pooling_proxy() {
        let (_server, backend) = crate::advisory::tests::on_a_private_server().await;
        let ttl = Duration::from_secs(30);
        let (ka, kb) = (
            LockKey::new("pooled:a").unwrap(),
            LockKey::new("pooled:b").unwrap(),
        );
        let a = backend.acquire(&ka, ttl).await.unwrap().expect("free");
        let b = backend.acquire(&kb, ttl).await.unwrap().expect("free");
        let (sa, sb) = (
            a.handle::<Session>().unwrap(),
            b.handle::<Session>().unwrap(),
        );
        std::mem::swap(&mut *sa.pinned.lock().await, &mut *sb.pinned.lock().await);

        let names_the_pooler = |e: &LockError| matches!(e, LockError::Config(m) if m.contains("pool_mode = transaction"));
        let err = backend.renew(&a).await.unwrap_err();
        assert!(names_the_pooler(&err), "{err}");
        let err = backend.release(&b).await.unwrap_err();
        assert!(names_the_pooler(&err), "{err}");
        // Nothing ran in the wrong sessions: `b`'s release did not unlock (or unlock all
        // of) the session holding `a`, so both keys are still held.
        assert_eq!(backend.inspect(&ka).await.unwrap().owner, Some(a.owner()));
        assert_eq!(backend.inspect(&kb).await.unwrap().owner, Some(b.owner()));
    }
}
