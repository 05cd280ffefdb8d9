//! The connection to one node or a cluster, script invocation and pipelines.
//!
//! Single calls go through [`redis::Script`] (EVALSHA, and SCRIPT LOAD + retry on
//! NOSCRIPT). Batches are one pipeline of EVALSHA per node; replies that say the command
//! did not run (NOSCRIPT, MOVED, ASK) are sent again after loading the script or through
//! the cluster client's own redirect handling. Anything that may have run is never resent.

mod node;
mod sentinel;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

pub(crate) use self::node::{Node, Target};
pub(crate) use self::sentinel::{Sentinels, addr_at, client};
use crate::scripts::Lua;
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{
    Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisResult, ServerError,
    ServerErrorKind, Value,
};

/// One script call in a batch.
#[derive(Clone)]
pub(crate) struct Call {
    pub(crate) script: &'static Lua,
    pub(crate) keys: Vec<String>,
    /// Sent as they are: a fenced write's value may be any bytes.
    pub(crate) args: Vec<Vec<u8>>,
}

impl Call {
    fn cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }

    /// The call as `EVAL` with the script's source: runs whether or not the node has
    /// the script, and leaves it cached there.
    fn eval_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(self.script.source()).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }

    fn invocation(&self) -> redis::ScriptInvocation<'static> {
        let mut inv = self.script.prepare_invoke();
        for k in &self.keys {
            inv.key(k);
        }
        for a in &self.args {
            inv.arg(a.as_slice());
        }
        inv
    }

    fn slot(&self) -> u16 {
        self.keys.first().map_or(0, |k| key_slot(k.as_bytes()))
    }
}

/// A connection to a single node (made again after it drops, after a reply that says the
/// node is a replica now, and after it fell silent: see [`Node`]) or to a cluster.
///
/// The cluster connection follows redirects and, after a connection error, sends a request
/// again, which may then run twice. A script whose second run reports something else than
/// its first (see [`Lua::runs_once`]) goes through [`ClusterState::once`]
/// instead, and its redirects are followed here.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(Node),
    Cluster(ClusterConnection, Arc<ClusterState>),
}

/// The rest of a cluster connection.
pub(crate) struct ClusterState {
    /// A connection to the same cluster that never sends a request twice.
    pub(crate) once: ClusterConnection,
    pub(crate) slots: Mutex<Option<Arc<SlotOwners>>>,
}

/// Which node (`host`, `port`) serves each slot range, from `CLUSTER SLOTS`.
pub(crate) struct SlotOwners {
    ranges: Vec<(u16, u16, String, u16)>,
    /// A batch met a sign that the map may be out of date (a redirect, a node that could
    /// not be reached, a demoted master): the next batch asks again.
    stale: AtomicBool,
}

impl SlotOwners {
    fn new(ranges: Vec<(u16, u16, String, u16)>) -> Self {
        Self {
            ranges,
            stale: AtomicBool::new(false),
        }
    }

    fn node(&self, slot: u16) -> Option<(&str, u16)> {
        self.ranges
            .iter()
            .find(|(start, end, _, _)| (*start..=*end).contains(&slot))
            .map(|(_, _, host, port)| (host.as_str(), *port))
    }
}

impl Conn {
    /// Runs one script call.
    pub(crate) async fn invoke<T: FromRedisValue>(&self, call: &Call) -> RedisResult<T> {
        let inv = call.invocation();
        // The cluster paths are boxed: their futures are several times the size of the
        // single node's, which every call's future would otherwise carry.
        match self {
            Conn::Single(c) => inv.invoke_async(&mut c.clone()).await,
            Conn::Cluster(..) if call.script.runs_once() => {
                let reply = Box::pin(self.invoke_once(call)).await?;
                T::from_redis_value(reply).map_err(RedisError::from)
            }
            Conn::Cluster(c, _) => match Box::pin(inv.invoke_async(&mut c.clone())).await {
                // The client's own reload sends SCRIPT LOAD, which has no key, where its
                // slot map says the masters are: after a switchover or a failover that may
                // not be the node its EVALSHA reached, which then still lacks the script.
                // NOSCRIPT proves the call did not run: load it where the call goes.
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    let reply = Box::pin(self.invoke_once(call)).await?;
                    T::from_redis_value(reply).map_err(RedisError::from)
                }
                reply => reply,
            },
        }
    }

    /// One call on a cluster, following redirects here, twice at most (an ASK with
    /// `ASKING` first), and loading the script on the node that answers NOSCRIPT: for a
    /// script that must not run twice (through the cluster connection that never sends a
    /// request again; redirects prove the call did not run), and for a batch's call
    /// redirected after a switchover or a failover.
    async fn invoke_once(&self, call: &Call) -> RedisResult<Value> {
        let mut route =
            SingleNodeRoutingInfo::SpecificNode(Route::new(call.slot(), SlotAddr::Master));
        let mut asking = false;
        let mut redirects = 0;
        loop {
            // A single call: a redirect may come back as the error of the whole request.
            let reply = self
                .node_batch(std::slice::from_ref(call), &[0], route.clone(), asking)
                .await
                .and_then(|mut replies| {
                    replies
                        .pop()
                        .unwrap_or_else(|| Err(RedisError::from((ErrorKind::Client, "no reply"))))
                });
            let e = match reply {
                Err(e) if is_redirect(&e) && redirects < 2 => e,
                other => return other,
            };
            let Some((host, port)) = e
                .redirect_node()
                .and_then(|(addr, _)| addr.rsplit_once(':'))
                .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
            else {
                return Err(e);
            };
            asking = e.kind() == ErrorKind::Server(ServerErrorKind::Ask);
            route = SingleNodeRoutingInfo::ByAddress { host, port };
            redirects += 1;
        }
    }

    /// Runs one script call followed by extra commands in one pipeline to the call's node,
    /// loading the script and resending once if it was missing.
    pub(crate) async fn invoke_with(&self, call: &Call, extra: &[Cmd]) -> RedisResult<Vec<Value>> {
        let mut pipe = Pipeline::new();
        pipe.add_command(call.cmd());
        for cmd in extra {
            pipe.add_command(cmd.clone());
        }
        let route = Route::new(call.slot(), SlotAddr::Master);
        let route = SingleNodeRoutingInfo::SpecificNode(route);
        let mut replies = self.send(&pipe, route.clone(), false, false).await?;
        if is_noscript(&replies[0]) {
            self.load(call.script, route.clone()).await?;
            replies = self.send(&pipe, route, false, false).await?;
        }
        Ok(replies)
    }

    /// Runs one plain command (routed by its first key in a cluster).
    pub(crate) async fn command<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Cluster(c, _) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Runs `pipe` in one round trip (on a cluster its keys must share a slot).
    pub(crate) async fn pipeline<T: FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> RedisResult<T> {
        match self {
            Conn::Single(c) => pipe.query_async(&mut c.clone()).await,
            Conn::Cluster(c, _) => pipe.query_async(&mut c.clone()).await,
        }
    }

    /// Runs many script calls: one pipeline per node. Returns one reply per call, in order;
    /// the outer error means nothing can be said about any call (single node only).
    ///
    /// In a cluster each node's pipeline waits at most `node_timeout`: the calls of a node
    /// that does not answer in time get a timeout error of their own, so the replies of
    /// the other nodes are still returned.
    pub(crate) async fn batch(
        &self,
        calls: &[Call],
        node_timeout: Duration,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        match self {
            Conn::Single(_) => {
                let all: Vec<usize> = (0..calls.len()).collect();
                self.node_batch(calls, &all, SingleNodeRoutingInfo::Random, false)
                    .await
            }
            Conn::Cluster(..) => Box::pin(self.cluster_batch(calls, node_timeout)).await,
        }
    }

    async fn cluster_batch(
        &self,
        calls: &[Call],
        node_timeout: Duration,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        let owners = self.slot_owners(node_timeout).await?;
        let mut groups: BTreeMap<(String, u16), Vec<usize>> = BTreeMap::new();
        for (i, call) in calls.iter().enumerate() {
            let (host, port) = owners.node(call.slot()).unwrap_or(("", 0));
            groups.entry((host.to_owned(), port)).or_default().push(i);
        }
        let sends = groups.into_iter().map(|((host, port), idx)| async move {
            let route = if port == 0 {
                // The map does not know the slot: let the client route by the first key.
                SingleNodeRoutingInfo::SpecificNode(Route::new(
                    calls[idx[0]].slot(),
                    SlotAddr::Master,
                ))
            } else {
                SingleNodeRoutingInfo::ByAddress { host, port }
            };
            let replies = match tokio::time::timeout(
                node_timeout,
                self.node_batch(calls, &idx, route, false),
            )
            .await
            {
                Ok(Ok(replies)) => replies,
                Ok(Err(e)) => idx.iter().map(|_| Err(e.clone())).collect(),
                Err(_) => {
                    let e = no_reply_within(node_timeout);
                    idx.iter().map(|_| Err(e.clone())).collect()
                }
            };
            (idx, replies)
        });
        let mut out: Vec<Option<RedisResult<Value>>> = calls.iter().map(|_| None).collect();
        for (idx, replies) in futures::future::join_all(sends).await {
            for (i, reply) in idx.into_iter().zip(replies) {
                // A redirected command did not run: send it again to the node the redirect
                // names, loading its script there if that node lacks it. (Not through the
                // client's script invocation: after a switchover its SCRIPT LOAD, which has
                // no key, may reach another node than its EVALSHA, and the new master,
                // which has no scripts, answers NOSCRIPT until the lease runs out.)
                let reply = match reply {
                    Err(e) if is_redirect(&e) => {
                        owners.stale.store(true, Ordering::Relaxed);
                        tokio::time::timeout(node_timeout, Box::pin(self.invoke_once(&calls[i])))
                            .await
                            .unwrap_or_else(|_| Err(no_reply_within(node_timeout)))
                    }
                    other => other,
                };
                // After a failover the map names a dead or demoted master until asked again.
                if matches!(&reply, Err(e) if may_have_moved(e)) {
                    owners.stale.store(true, Ordering::Relaxed);
                }
                out[i] = Some(reply);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(RedisError::from((ErrorKind::Client, "no reply")))))
            .collect())
    }

    /// One pipeline of the calls at `idx` to one node (after `ASKING` when `asking`).
    /// Calls that did not run are sent again, twice at most: NOSCRIPT replies after
    /// loading their scripts on that node, and on a single node the calls a replica
    /// refused, over the connection made again (the address may lead to the new master by
    /// now, which may need the scripts loaded in turn). A resend that fails fails only the
    /// calls it carried. In a cluster, calls of a script that [runs once](Lua::runs_once)
    /// are never sent again after a connection error.
    async fn node_batch(
        &self,
        calls: &[Call],
        idx: &[usize],
        route: SingleNodeRoutingInfo,
        asking: bool,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        let once = idx.iter().any(|&i| calls[i].script.runs_once());
        let pipeline = |calls: &mut dyn Iterator<Item = &Call>| {
            let mut pipe = Pipeline::with_capacity(idx.len() + 1);
            if asking {
                pipe.cmd("ASKING");
            }
            for call in calls {
                pipe.add_command(call.cmd());
            }
            pipe
        };
        let pipe = pipeline(&mut idx.iter().map(|&i| &calls[i]));
        let replies = self.send(&pipe, route.clone(), once, asking).await?;
        let mut out: Vec<RedisResult<Value>> = replies.into_iter().map(reply_error).collect();
        let single = matches!(self, Conn::Single(_));
        for _ in 0..2 {
            let again: Vec<usize> = (0..out.len())
                .filter(|&j| matches!(&out[j], Err(e) if did_not_run(e, single)))
                .collect();
            if again.is_empty() {
                break;
            }
            // A call that met NOSCRIPT goes again as EVAL, with the script's source: it
            // runs on whichever node the route reaches and caches the script there. (A
            // SCRIPT LOAD first could reach another node: on a Cluster right after a
            // switchover the client's map may route a keyless command elsewhere, and the
            // new master, which has no scripts, answered NOSCRIPT until the lease ran out.)
            let resent = async {
                let mut pipe = Pipeline::with_capacity(again.len() + 1);
                if asking {
                    pipe.cmd("ASKING");
                }
                for &j in &again {
                    let call = &calls[idx[j]];
                    let missing = matches!(&out[j], Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript));
                    pipe.add_command(if missing { call.eval_cmd() } else { call.cmd() });
                }
                self.send(&pipe, route.clone(), once, asking).await
            };
            match resent.await {
                Ok(replies) => {
                    for (&j, reply) in again.iter().zip(replies) {
                        out[j] = reply_error(reply);
                    }
                }
                Err(e) => {
                    for &j in &again {
                        out[j] = Err(e.clone());
                    }
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Sends `pipe` (through the connection that never resends when `once`); the reply of
    /// a leading `ASKING` is left out.
    async fn send(
        &self,
        pipe: &Pipeline,
        route: SingleNodeRoutingInfo,
        once: bool,
        asking: bool,
    ) -> RedisResult<Vec<Value>> {
        let skip = usize::from(asking);
        let count = pipe.len() - skip;
        match self {
            Conn::Single(c) => c.clone().req_packed_commands(pipe, skip, count).await,
            Conn::Cluster(_, state) if once && !asking => {
                // One request per call: a redirect then fails only its own call, where in
                // a pipeline it would fail every call, though the others ran.
                let sends = pipe.cmd_iter().map(|cmd| {
                    let (mut c, route) =
                        (state.once.clone(), RoutingInfo::SingleNode(route.clone()));
                    async move { c.route_command(cmd.clone(), route).await }
                });
                futures::future::join_all(sends)
                    .await
                    .into_iter()
                    .map(|reply| {
                        reply.or_else(|e| ServerError::try_from(e).map(Value::ServerError))
                    })
                    .collect()
            }
            Conn::Cluster(c, state) => {
                let mut c = if once { state.once.clone() } else { c.clone() };
                c.route_pipeline(pipe.clone(), skip, count, route).await
            }
        }
    }

    async fn load(&self, script: &Lua, route: SingleNodeRoutingInfo) -> RedisResult<()> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(script.source());
        match self {
            Conn::Single(c) => c.clone().req_packed_command(&cmd).await?.extract_error()?,
            Conn::Cluster(c, _) => {
                c.clone()
                    .route_command(cmd, RoutingInfo::SingleNode(route))
                    .await?
            }
        };
        Ok(())
    }

    /// Loads every script on every node (every master of a cluster), so the first call of
    /// each is one round trip. Later losses (restart, `SCRIPT FLUSH`) are handled by reloading.
    pub(crate) async fn load_all(&self) -> RedisResult<()> {
        for script in crate::scripts::ALL {
            match self {
                Conn::Single(_) => self.load(script, SingleNodeRoutingInfo::Random).await?,
                Conn::Cluster(c, _) => {
                    let mut cmd = redis::cmd("SCRIPT");
                    cmd.arg("LOAD").arg(script.source());
                    c.clone()
                        .route_command(
                            cmd,
                            RoutingInfo::MultiNode((
                                redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
                                Some(redis::cluster_routing::ResponsePolicy::AllSucceeded),
                            )),
                        )
                        .await?
                        .extract_error()?;
                }
            }
        }
        Ok(())
    }

    /// The `INFO <section>` reply of the node, or of every master of a cluster with the
    /// master's `host:port` (a master the client has no connection to is left out by the
    /// client). A node's error reply (an ACL rule, a renamed command) is kept as its reply.
    pub(crate) async fn infos(&self, section: &str) -> RedisResult<Vec<(Option<String>, Value)>> {
        let mut cmd = redis::cmd("INFO");
        cmd.arg(section);
        let reply = match self {
            Conn::Single(c) => return Ok(vec![(None, c.clone().req_packed_command(&cmd).await?)]),
            Conn::Cluster(c, _) => {
                // No response policy: one reply per master, by its address.
                let route = RoutingInfo::MultiNode((
                    redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
                    None,
                ));
                c.clone().route_command(cmd, route).await?
            }
        };
        Ok(match reply {
            Value::Map(nodes) => nodes
                .into_iter()
                .map(|(node, info)| {
                    (
                        Some(String::from_redis_value(node).unwrap_or_default()),
                        info,
                    )
                })
                .collect(),
            one => vec![(None, one)],
        })
    }

    /// The cached slot map; asked for again (within `node_timeout`) when there is none or
    /// it is stale. A stale map is still used when asking fails: most of it is usually
    /// right, and the next batch asks again.
    async fn slot_owners(&self, node_timeout: Duration) -> RedisResult<Arc<SlotOwners>> {
        let Conn::Cluster(c, state) = self else {
            return Ok(Arc::new(SlotOwners::new(Vec::new())));
        };
        let cached = state.slots.lock().clone();
        if let Some(owners) = &cached {
            if !owners.stale.load(Ordering::Relaxed) {
                return Ok(owners.clone());
            }
        }
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let asked = tokio::time::timeout(
            node_timeout,
            c.clone().route_command(
                cmd,
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            ),
        )
        .await
        .unwrap_or_else(|_| Err(no_reply_within(node_timeout)));
        match (asked, cached) {
            (Ok(reply), _) => {
                let owners = Arc::new(parse_cluster_slots(reply));
                *state.slots.lock() = Some(owners.clone());
                Ok(owners)
            }
            (Err(_), Some(stale)) => Ok(stale),
            (Err(e), None) => Err(e),
        }
    }
}

fn parse_cluster_slots(reply: Value) -> SlotOwners {
    let mut ranges = Vec::new();
    if let Value::Array(items) = reply {
        for item in items {
            let Value::Array(parts) = item else { continue };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                continue;
            };
            let host = match master.first() {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Value::SimpleString(s)) => s.clone(),
                _ => continue,
            };
            let Some(Value::Int(port)) = master.get(1) else {
                continue;
            };
            if let (Ok(s), Ok(e), Ok(p)) = (
                u16::try_from(*start),
                u16::try_from(*end),
                u16::try_from(*port),
            ) {
                ranges.push((s, e, host, p));
            }
        }
    }
    SlotOwners::new(ranges)
}

/// `f` within `limit`, or a timed-out I/O error: for connecting, which has no request
/// timeout of its own.
pub(crate) async fn with_timeout<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no connection within {limit:?}"),
        )))
    })
}

/// A reply that is an error, as an error. Errors nested in a multi-key script's array are
/// left in place: they belong to one item each, not to the whole call.
pub(crate) fn reply_error(reply: Value) -> RedisResult<Value> {
    match reply {
        Value::ServerError(e) => Err(e.into()),
        other => Ok(other),
    }
}

/// The error of a node that sent no reply in time: an I/O timeout, like the client's own.
fn no_reply_within(limit: Duration) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no reply from the node within {limit:?}"),
    ))
}

/// True for the error of a call that did not run and may when sent again: its script was
/// missing, or (`single`: on a single node, whose connection is then made again) a replica
/// refused it.
fn did_not_run(e: &RedisError, single: bool) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
        || (single && node::is_replica_error(e))
}

fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript))
}

/// True for the errors that a node gone, demoted or not serving may cause.
fn may_have_moved(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_io_error()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::TryAgain
            ) | ErrorKind::ClusterConnectionNotFound
        )
}

fn is_redirect(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
    )
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&close| close > 0)
                .map(|close| &rest[..close])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in tagged {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_redis_cluster_spec() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // An empty tag hashes the whole key.
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"a{}x"), key_slot(b""));
    }
}
