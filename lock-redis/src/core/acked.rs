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

use parking_lot::Mutex;
use redis::RedisError;
use redis::aio::ConnectionManagerConfig;
use redis::cluster::ClusterClient;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::conn::{ClusterState, Conn, Node, Target, with_timeout};

/// How many connections of its own a backend with
/// [`replica_acks`](crate::RedisBackendBuilder::replica_acks) opens for its acquires: each
/// acquire and its `WAIT` take one for themselves, so this many run at once and later ones
/// wait (within the request timeout) for one to be free. The first is opened by
/// `build()`, the others when first needed; all are kept.
pub const ACKED_CONNECTIONS: usize = 4;

/// How to open one more connection for [`AckedConns`].
pub(crate) enum Connector {
    /// Where the node is, its settings, the request timeout, and how long connecting
    /// may take.
    Single {
        target: Target,
        config: ConnectionManagerConfig,
        request_timeout: Duration,
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
                request_timeout,
                limit,
            } => {
                let c = with_timeout(
                    *limit,
                    Node::open(target.clone(), config.clone(), *request_timeout),
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
pub(crate) struct AckedConns {
    connector: Connector,
    /// Connections whose last acquire got its whole reply: nothing of theirs is pending.
    idle: Mutex<Vec<Conn>>,
    free: Arc<Semaphore>,
}

impl AckedConns {
    /// The pool with its first connection open, so the first acquire sends at once.
    pub(crate) async fn open(connector: Connector) -> Result<Arc<Self>, RedisError> {
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
    pub(crate) async fn take(self: &Arc<Self>) -> Result<AckedConn, RedisError> {
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
    pub(crate) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Returns the connection, once every reply of its requests came back.
    pub(crate) fn put_back(self) {
        self.pool.idle.lock().push(self.conn.clone());
    }
}
