//! [`Node`]: the connection to a single Redis node, made anew when it stops serving.
//!
//! redis-rs's [`ConnectionManager`] connects again after an error it sees on its socket.
//! Two failures never show one:
//!
//! * **A master that became a replica** (a switchover, `REPLICAOF`) keeps the connection
//!   and answers every write `READONLY` (or `MASTERDOWN`) for as long as it lives, while
//!   the address it was reached by (a virtual IP, a DNS name, a proxy) may lead to the new
//!   master by now. Such a reply replaces the connection, and a single command it refused
//!   (so it did not run) is sent once more, over the new one.
//! * **A connection that died silently** (a NAT or balancer that dropped its flow, a host
//!   gone without a reset) holds every request behind the first one for ever. Every
//!   request on it runs under the backend's request timeout; one given up after waiting
//!   half of that or more, with nothing heard over its connection since it was sent,
//!   replaces the connection, so the requests after it go over a new one.
//!
//! A new connection is made on its first request, to wherever the address leads then.
//! Requests already on their way over the old one end there (with their reply, or their
//! caller's timeout), and it closes once the last of them is gone.
//!
//! A master found through Redis Sentinel ([`Target::Sentinel`]) has no fixed address: each
//! new connection asks the Sentinels where the master is first, checks that the node it
//! reaches says `ROLE` master, and a connection that failed (the master gone) is replaced
//! too, so the next request asks the Sentinels again and follows a failover.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OnceCell;

use super::Sentinels;
use redis::{
    Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;
use tracing::debug;

/// The connection to one node, replaced as the module docs say. Cheap to clone: clones
/// share the connection.
#[derive(Clone)]
pub(crate) struct Node(Arc<Shared>);

/// Where a node's connections go.
#[derive(Clone)]
pub(crate) enum Target {
    /// One address.
    Fixed(Box<redis::Client>),
    /// Wherever the Sentinels say the master is.
    Sentinel(Arc<Sentinels>),
}

struct Shared {
    target: Target,
    config: ConnectionManagerConfig,
    /// A request given up after half of this, its connection silent meanwhile, replaces
    /// the connection.
    request_timeout: Duration,
    /// The instant [`Connection::heard`] counts from.
    epoch: Instant,
    current: Mutex<Arc<Connection>>,
    /// The task that follows the Sentinels' switches ([`Sentinels::follow_switches`]),
    /// stopped with the node.
    follower: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(follower) = self.follower.get_mut().take() {
            follower.abort();
        }
    }
}

/// One connection (reconnecting on its own after an error it sees), made on its first
/// request for a [`Target::Sentinel`].
struct Connection {
    manager: OnceCell<ConnectionManager>,
    /// When the server last answered over it, in nanoseconds since [`Shared::epoch`].
    heard: AtomicU64,
}

impl Connection {
    fn new(manager: Option<ConnectionManager>) -> Arc<Self> {
        Arc::new(Self {
            manager: OnceCell::new_with(manager),
            heard: AtomicU64::new(0),
        })
    }
}

impl Node {
    /// Connects to the node `client` names, with `config`; the connection is made now, so
    /// that a node that cannot be reached fails here.
    pub(crate) async fn open(
        target: Target,
        config: ConnectionManagerConfig,
        request_timeout: Duration,
    ) -> RedisResult<Self> {
        let node = Self(Arc::new(Shared {
            target,
            config,
            request_timeout,
            epoch: Instant::now(),
            current: Mutex::new(Connection::new(None)),
            follower: Mutex::new(None),
        }));
        node.manager(&node.current()).await?;
        if let Target::Sentinel(sentinels) = &node.0.target {
            let (sentinels, weak) = (sentinels.clone(), Arc::downgrade(&node.0));
            let task = tokio::spawn(async move {
                sentinels
                    .follow_switches(|| match weak.upgrade() {
                        Some(shared) => {
                            let node = Node(shared);
                            node.replace(&node.current(), "the Sentinels switched the master");
                            true
                        }
                        None => false,
                    })
                    .await;
            });
            *node.0.follower.lock() = Some(task.abort_handle());
        }
        Ok(node)
    }

    /// The manager of `conn`, made now when it has none yet: to the fixed address, or to
    /// the master the Sentinels name, which must say it is one.
    async fn manager(&self, conn: &Connection) -> RedisResult<ConnectionManager> {
        let shared = &self.0;
        let manager = conn
            .manager
            .get_or_try_init(|| async {
                match &shared.target {
                    Target::Fixed(client) => {
                        ConnectionManager::new_with_config(*client.clone(), shared.config.clone())
                            .await
                    }
                    Target::Sentinel(sentinels) => {
                        let client = sentinels.master().await?;
                        let mut manager =
                            ConnectionManager::new_with_config(client, shared.config.clone())
                                .await?;
                        check_master(&mut manager).await?;
                        Ok(manager)
                    }
                }
            })
            .await?;
        Ok(manager.clone())
    }

    fn current(&self) -> Arc<Connection> {
        self.0.current.lock().clone()
    }

    /// Puts a new connection (made on its first request) in the place of `old`, unless
    /// another request replaced `old` already.
    fn replace(&self, old: &Arc<Connection>, why: &'static str) {
        // Dropped outside a runtime (its shutdown): nothing can connect any more.
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut current = self.0.current.lock();
        if !Arc::ptr_eq(&current, old) {
            return;
        }
        match &self.0.target {
            Target::Fixed(client) => {
                match ConnectionManager::new_lazy_with_config(
                    *client.clone(),
                    self.0.config.clone(),
                ) {
                    Ok(manager) => {
                        debug!(why, "connecting to the node again");
                        *current = Connection::new(Some(manager));
                    }
                    Err(e) => debug!(why, error = %e, "cannot connect to the node again"),
                }
            }
            Target::Sentinel(_) => {
                debug!(why, "asking the Sentinels for the master again");
                *current = Connection::new(None);
            }
        }
    }

    /// `request` over `conn`, watched: see [`Waiting`].
    async fn over<T>(
        &self,
        conn: &Arc<Connection>,
        request: impl Future<Output = RedisResult<T>>,
    ) -> RedisResult<T> {
        let mut waiting = Waiting {
            node: self,
            conn,
            sent: Instant::now(),
            answered: false,
        };
        let reply = request.await;
        waiting.answered = true;
        if server_answered(&reply) {
            let now = self.0.epoch.elapsed().as_nanos();
            conn.heard
                .store(u64::try_from(now).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        reply
    }

    /// One command; sent once more over a new connection when a replica refused it.
    async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let conn = self.current();
        let mut manager = self.manager(&conn).await?;
        let reply = self.over(&conn, manager.send_packed_command(cmd)).await;
        let refused = match &reply {
            Ok(value) => is_replica_reply(value),
            Err(e) => is_replica_error(e),
        };
        if !refused {
            if let Err(e) = &reply {
                self.lost(&conn, e);
            }
            return reply;
        }
        self.replace(&conn, "the node refused a write as a replica");
        // It did not run: the address may lead to the new master by now.
        let conn = self.current();
        let mut manager = self.manager(&conn).await?;
        let reply = self.over(&conn, manager.send_packed_command(cmd)).await;
        if let Err(e) = &reply {
            self.lost(&conn, e);
        }
        reply
    }

    /// After `e` on `conn`: a master found through the Sentinels that cannot be reached
    /// may have been failed over, so the next request asks them again. (A fixed address's
    /// manager connects there again by itself.)
    fn lost(&self, conn: &Arc<Connection>, e: &RedisError) {
        if matches!(self.0.target, Target::Sentinel(_))
            && (e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal())
        {
            self.replace(conn, "the master could not be reached");
        }
    }

    /// `count` replies of a pipeline from `offset`. A reply that says the node is a
    /// replica replaces the connection; the caller decides what to send again.
    async fn pipeline(
        &self,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let conn = self.current();
        let mut manager = self.manager(&conn).await?;
        let reply = self
            .over(&conn, manager.send_packed_commands(pipe, offset, count))
            .await;
        let refused = match &reply {
            Ok(values) => values.iter().any(is_replica_reply),
            Err(e) => is_replica_error(e),
        };
        if refused {
            self.replace(&conn, "the node refused a write as a replica");
        } else if let Err(e) = &reply {
            self.lost(&conn, e);
        }
        reply
    }
}

impl ConnectionLike for Node {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.pipeline(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        match &self.0.target {
            Target::Fixed(client) => client.get_connection_info().redis_settings().db(),
            Target::Sentinel(sentinels) => sentinels.db(),
        }
    }
}

/// A request on its way. Dropped before its reply came (its caller's timeout, or its
/// caller gone) after half the request timeout or more, with nothing heard over its
/// connection since it was sent, it replaces the connection: a server that answers at all
/// answers a script in microseconds, so such silence is a connection that died.
struct Waiting<'a> {
    node: &'a Node,
    conn: &'a Arc<Connection>,
    sent: Instant,
    answered: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let shared = &self.node.0;
        if self.answered || self.sent.elapsed() < shared.request_timeout / 2 {
            return;
        }
        let heard = Duration::from_nanos(self.conn.heard.load(Ordering::Relaxed));
        if shared.epoch + heard < self.sent {
            self.node
                .replace(self.conn, "no reply over the connection in time");
        }
    }
}

/// Fails unless the node `manager` reaches says `ROLE` master: the Sentinels may name a
/// master that was demoted since. A user not allowed `ROLE` takes the Sentinels' word.
async fn check_master(manager: &mut ConnectionManager) -> RedisResult<()> {
    let role: RedisResult<Vec<Value>> = redis::cmd("ROLE").query_async(manager).await;
    match role {
        Ok(role) if matches!(role.first(), Some(Value::BulkString(r)) if r == b"master") => Ok(()),
        Ok(_) => Err(RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "the node the Sentinels name as master is not one (yet)",
        ))),
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) => Ok(()),
        Err(e) => Err(e),
    }
}

/// True for a reply the server sent: a value, or an error it answered with.
fn server_answered<T>(reply: &RedisResult<T>) -> bool {
    match reply {
        Ok(_) => true,
        Err(e) => matches!(e.kind(), ErrorKind::Server(_) | ErrorKind::Extension),
    }
}

/// The errors of a node that is a replica now: a write refused (`READONLY`), or any
/// command while its link to its master is down (`MASTERDOWN`). Either way the request
/// did not run.
pub(crate) fn is_replica_error(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
}

/// [`is_replica_error`] for one reply of a pipeline.
fn is_replica_reply(v: &Value) -> bool {
    matches!(v, Value::ServerError(e)
        if matches!(e.kind(), Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)))
}
