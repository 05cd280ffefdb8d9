//! Replica acknowledgements ([`RedisBackendBuilder::replica_acks`]): each acquire is
//! followed by `WAIT` in the same round trip, and a grant too few replicas acknowledged in
//! time is released again.
//!
//! `WAIT` counts the acknowledgements of the writes of its own connection, and Redis
//! answers nothing else of a client blocked in it. So an acquire and its `WAIT` go over a
//! connection no other call uses at the same time ([`AckedConns`]): renewals, releases and
//! other acquires never queue behind a `WAIT`.
//!
//! [`RedisBackendBuilder::replica_acks`]: crate::RedisBackendBuilder::replica_acks

use std::sync::Arc;
use std::time::Duration;

use distlock_core::Effect;
use distlock_core::{Lease, LockBackend, LockError, LockKey, OwnerId};
use parking_lot::Mutex;
use redis::aio::ConnectionManagerConfig;
use redis::cluster::ClusterClient;
use redis::{RedisError, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::connect::with_timeout;
use super::reply::parse_token;
use super::{AbandonOnDrop, NAME, RedisBackend};
use crate::conn::{ClusterState, Conn, Node, Target};
use crate::error::map_error;

/// How many connections of its own a backend with
/// [`replica_acks`](crate::RedisBackendBuilder::replica_acks) opens for its acquires: each
/// acquire and its `WAIT` take one for themselves, so this many run at once and later ones
/// wait (within the response timeout) for one to be free. The first is opened by
/// `build()`, the others when first needed; all are kept.
pub const ACKED_CONNECTIONS: usize = 4;

/// How to open one more connection for [`AckedConns`].
pub(super) enum Connector {
    /// Where the node is, its settings, the response timeout, and how long connecting
    /// may take.
    Single {
        target: Target,
        config: ConnectionManagerConfig,
        response_timeout: Duration,
        limit: Duration,
    },
    /// A client of the cluster that never sends a request twice, and how long connecting
    /// may take.
    Cluster(Box<ClusterClient>, Duration),
}

impl Connector {
    async fn connect(&self) -> Result<Conn, RedisError> {
        match self {
            Connector::Single {
                target,
                config,
                response_timeout,
                limit,
            } => {
                let c = with_timeout(
                    *limit,
                    Node::open(target.clone(), config.clone(), *response_timeout),
                )
                .await?;
                Ok(Conn::Single(c))
            }
            Connector::Cluster(client, limit) => {
                let c = with_timeout(*limit, client.get_async_connection()).await?;
                let state = ClusterState {
                    once: c.clone(),
                    slots: Mutex::new(None),
                };
                Ok(Conn::Cluster(c, Arc::new(state)))
            }
        }
    }
}

/// The connections acquires with `WAIT` go over, each used by one acquire at a time, at
/// most [`ACKED_CONNECTIONS`].
pub(super) struct AckedConns {
    connector: Connector,
    /// Connections whose last acquire got its whole reply: nothing of theirs is pending.
    idle: Mutex<Vec<Conn>>,
    free: Arc<Semaphore>,
}

impl AckedConns {
    /// The pool with its first connection open, so the first acquire sends at once.
    pub(super) async fn open(connector: Connector) -> Result<Arc<Self>, RedisError> {
        let first = connector.connect().await?;
        Ok(Arc::new(Self {
            connector,
            idle: Mutex::new(vec![first]),
            free: Arc::new(Semaphore::new(ACKED_CONNECTIONS)),
        }))
    }

    /// A connection for one acquire: an idle one, or a new one while fewer than
    /// [`ACKED_CONNECTIONS`] are open; otherwise waits for one to be free.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is sent.
    async fn take(self: &Arc<Self>) -> Result<AckedConn, RedisError> {
        let permit = self
            .free
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| RedisError::from((redis::ErrorKind::Client, "no connection")))?;
        let idle = self.idle.lock().pop();
        let conn = match idle {
            Some(conn) => conn,
            None => self.connector.connect().await?,
        };
        Ok(AckedConn {
            conn,
            pool: self.clone(),
            _permit: permit,
        })
    }
}

/// A connection of [`AckedConns`] in use. Dropped, it is closed: a request of its own may
/// still be pending (a `WAIT` that would hold up the next acquire). [`AckedConn::put_back`]
/// returns it for the next acquire.
pub(crate) struct AckedConn {
    conn: Conn,
    pool: Arc<AckedConns>,
    _permit: OwnedSemaphorePermit,
}

impl AckedConn {
    pub(super) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Returns the connection, once every reply of its requests came back.
    fn put_back(self) {
        self.pool.idle.lock().push(self.conn.clone());
    }
}

impl RedisBackend {
    /// An acquire followed by `WAIT` in the same round trip. Whatever it took is given back
    /// in the background when its future is dropped before it returns, and when it fails
    /// after taking the key.
    pub(super) async fn acquire_with_replicas(
        &self,
        key: &LockKey,
        ttl: Duration,
        replicas: usize,
        wait: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let Some(pool) = &self.inner.acked else {
            return Err(LockError::backend(NAME, "no connections for replica_acks"));
        };
        // Nothing is sent yet: no connection free within the response timeout is a plain
        // failure.
        let acked = self.timed("acquire", Effect::None, pool.take()).await?;
        let keys = self.acquire_keys(key);
        let owner = OwnerId::random();
        let call = self.acquire_call(&keys, owner, ttl);
        let mut wait_cmd = redis::cmd("WAIT");
        wait_cmd.arg(replicas).arg(wait.as_millis().to_string());
        let conn = acked.conn().clone();
        let mut pending = AbandonOnDrop {
            backend: self,
            attempts: vec![(keys, owner)],
            ttl,
            over: Some(acked),
        };
        let sent = Instant::now();
        let replies = self
            .timed(
                "acquire",
                Effect::Write("acquire"),
                conn.invoke_with(&call, &[wait_cmd]),
            )
            .await;
        let mut replies = match replies {
            Ok(r) => r.into_iter(),
            Err(e) => {
                // The connection is dropped with `pending` (after the cleanup, if any):
                // a request of it may still be pending.
                if !matches!(e, LockError::OutcomeUnknown { .. }) {
                    pending.attempts.clear();
                }
                return Err(e);
            }
        };
        // Every reply came back: the connection can serve the next acquire.
        if let Some(acked) = pending.over.take() {
            acked.put_back();
        }
        // The script's own error, or no grant: nothing was taken.
        let Some(token) = parse_token(replies.next()).inspect_err(|_| pending.attempts.clear())?
        else {
            pending.attempts.clear();
            return Ok(None);
        };
        let acked: i64 = match replies.next().map(Value::extract_error) {
            Some(Ok(v)) => redis::from_redis_value(v).map_err(|e| LockError::backend(NAME, e))?,
            Some(Err(e)) => return Err(map_error("acquire", Effect::Write("acquire"), &e)),
            None => 0,
        };
        let lease = self.lease(key, owner, token, ttl, sent);
        if usize::try_from(acked).unwrap_or(0) < replicas {
            let short = format!(
                "only {acked} of {replicas} replicas acknowledged the lock within {wait:?}"
            );
            return match self.release(&lease).await {
                Ok(_) => {
                    pending.attempts.clear();
                    Err(LockError::unavailable(
                        NAME,
                        format!("{short}; it was released"),
                    ))
                }
                // The lock may still be held (until its TTL, or until the cleanup that
                // dropping `pending` starts gets through).
                Err(e) => Err(LockError::outcome_unknown(
                    NAME,
                    "acquire",
                    format!("{short}; releasing it failed ({e})"),
                )),
            };
        }
        pending.attempts.clear();
        Ok(Some(lease))
    }

    /// `acquire_many` with replica acknowledgements: each grant needs its own `WAIT`
    /// verdict, so the keys are taken one at a time. A failed batch holds nothing.
    pub(super) async fn acquire_many_with_replicas(
        &self,
        keys: &[LockKey],
        ttl: Duration,
    ) -> Result<Vec<Option<Lease>>, LockError> {
        let mut taken = ReleaseOnDrop {
            backend: self,
            leases: Vec::new(),
        };
        let mut granted: Vec<bool> = Vec::with_capacity(keys.len());
        for key in keys {
            match self.acquire(key, ttl).await {
                Ok(lease) => {
                    granted.push(lease.is_some());
                    taken.leases.extend(lease);
                }
                Err(e) => {
                    // A failed batch holds nothing: give back what it took (what this
                    // cannot give back, dropping `taken` tries again in the background).
                    return match self.release_many(&taken.leases).await {
                        Ok(_) => {
                            taken.leases.clear();
                            Err(e)
                        }
                        Err(release) => Err(LockError::outcome_unknown(
                            NAME,
                            "acquire_many",
                            format!(
                                "{e}; releasing the {} locks taken before failed ({release})",
                                taken.leases.len()
                            ),
                        )),
                    };
                }
            }
        }
        let mut leases = std::mem::take(&mut taken.leases).into_iter();
        Ok(granted
            .into_iter()
            .map(|g| if g { leases.next() } else { None })
            .collect())
    }
}

/// Leases a batch has taken so far: released in the background if the batch's future is
/// dropped before it hands them over.
struct ReleaseOnDrop<'a> {
    backend: &'a RedisBackend,
    leases: Vec<Lease>,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        if leases.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.backend.clone();
        runtime.spawn(async move {
            let released = backend.release_many(&leases).await;
            tracing::debug!(
                leases = leases.len(),
                done = released.is_ok(),
                "released the leases of a batch whose caller had gone"
            );
        });
    }
}
