//! Building a backend's [`Core`]: the connection to one node or a cluster (two for a
//! cluster), the credentials, server version and eviction policy checked, and the
//! scripts loaded.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::{BackendId, Capabilities, LockError, redact_url};
use parking_lot::Mutex;
use redis::aio::ConnectionManagerConfig;
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, ProtocolVersion, RedisResult, Value};
use tracing::{debug, warn};

use crate::config::RedisBackendBuilder;
use crate::conn::{ClusterState, Conn, Node, Sentinels, Target, addr_at, client, with_timeout};
use crate::core::{AckedConns, Calls, Connector, Core};
use crate::error::{KindName, config_error, connect_error};
use crate::releases::{ReleaseListener, Servers, announcements_refused, subscriptions_refused};
use crate::tcp::tcp_settings;
use crate::url::SentinelUrl;

/// The longest TTL a [`RedisBackend`](crate::RedisBackend) accepts, whatever
/// [`ttl_bounds`](RedisBackendBuilder::ttl_bounds) says: Redis keeps an expiry as a signed
/// 64-bit count of milliseconds since 1970, so `PX` must leave room for the current time.
/// 2^62 ms (about 146 million years) leaves plenty; a longer maximum fails `build` with
/// [`LockError::Config`].
pub const LONGEST_TTL: Duration = Duration::from_millis(1 << 62);

/// Connects to the servers `b` names, checks them and loads the scripts: the [`Core`] of
/// a new backend. In stages, in this order: [`validate`], [`open`], [`check_server`],
/// [`load_scripts`], [`announcing`], [`listening`], [`open_acked`], [`assemble`].
pub(crate) async fn connect(b: RedisBackendBuilder) -> Result<Core, LockError> {
    let shown = validate(&b)?;
    let opened = open(&b, &shown).await?;
    let server = check_server(&b, &opened.conn, &shown).await?;
    load_scripts(&b, &opened.conn, &shown).await?;
    let announced = announcing(&b, &opened.conn, server.sharded, &shown).await?;
    let heard = listening(&b, &opened, &announced, &shown).await?;
    let acked = open_acked(opened.acked, &shown).await?;
    Ok(assemble(
        b,
        opened.conn,
        shown,
        server,
        &announced,
        heard,
        acked,
    ))
}

/// The URLs with passwords hidden, one for each of `b`'s.
struct Shown(Vec<String>);

impl Shown {
    /// The first URL: a single node's, or a Sentinel master's.
    fn first(&self) -> &str {
        &self.0[0]
    }

    /// All of them, comma-separated.
    fn all(&self) -> String {
        self.0.join(",")
    }
}

/// What [`open`] made: the connection, and what the listener and the acquires with `WAIT`
/// are opened from later.
struct Opened {
    conn: Conn,
    /// The TLS roots `b` names, for every later connection.
    certificates: Option<redis::TlsCertificates>,
    /// The nodes a listener may `SUBSCRIBE` on.
    listen_on: Vec<redis::Client>,
    /// The Sentinels of a `redis+sentinel://` master, which the listener asks too.
    sentinels: Option<Arc<Sentinels>>,
    /// The seed nodes of a cluster, for the listener's connection with shard channels.
    cluster_nodes: Option<Vec<redis::ConnectionInfo>>,
    /// How to open the connections of their own for acquires with `WAIT` (see
    /// `AckedConns`).
    acked: Option<Connector>,
}

/// What [`check_server`] read of the servers.
struct Server {
    /// Hash slots divide the keys (see [`Calls::slotted`]).
    slotted: bool,
    /// Every master has shard channels (`SPUBLISH`, Redis 7.0), so releases may be
    /// announced on their key's shard.
    sharded: bool,
}

/// How releases are announced, as [`announcing`] found out.
struct Announced {
    /// With `SPUBLISH`, on their key's shard.
    sharded: bool,
    /// Why the server refuses this user's announcements, if it does.
    refused: Option<String>,
}

/// Where the release listener subscribes (none: wake-ups off), and whether releases are
/// still announced on their shard, as [`listening`] found out.
struct Heard {
    servers: Option<Servers>,
    sharded: bool,
}

/// Checks what needs no server: the TTL bounds; installs the TLS crypto provider where a
/// URL asks for TLS. The URLs with passwords hidden, for errors and `Debug`.
fn validate(b: &RedisBackendBuilder) -> Result<Shown, LockError> {
    let shown = Shown(b.urls.iter().map(|u| redact_url(u)).collect());
    if b.max_ttl > LONGEST_TTL {
        return Err(LockError::Config(format!(
            "the longest TTL {:?} (ttl_bounds) is longer than Redis can keep an expiry; at most \
             {LONGEST_TTL:?}",
            b.max_ttl
        )));
    }
    if b.uses_tls() {
        crate::tls::ensure_crypto_provider();
    }
    Ok(shown)
}

/// Opens the connection: to a cluster, or to one node (named by its URL or by
/// Sentinels).
async fn open(b: &RedisBackendBuilder, shown: &Shown) -> Result<Opened, LockError> {
    let certificates = b.tls_ca.clone().map(|pem| redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    });
    if b.cluster {
        open_cluster(b, certificates, shown).await
    } else {
        open_node(b, certificates, shown).await
    }
}

/// [`open`] for a cluster: two connections, one that retries (reads, and scripts safe to
/// run twice), one that never sends a request again (see `Conn`).
async fn open_cluster(
    b: &RedisBackendBuilder,
    certificates: Option<redis::TlsCertificates>,
    shown: &Shown,
) -> Result<Opened, LockError> {
    for (url, shown) in b.urls.iter().zip(&shown.0) {
        if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
            if info.redis_settings().db() != 0 {
                return Err(LockError::Config(format!(
                    "{shown}: a Redis Cluster has only database 0"
                )));
            }
        }
    }
    let nodes = b
        .urls
        .iter()
        .map(|u| parse_url(u))
        .collect::<Result<Vec<_>, _>>()?;
    let all = shown.all();
    // A PUBLISH reaches every node of a cluster: release notifications can be
    // heard on any of them (before Redis 7.0, which has shard channels).
    let mut listen_on = Vec::new();
    for node in &nodes {
        listen_on
            .push(client(node.clone(), certificates.clone()).map_err(|e| config_error(&all, &e))?);
    }
    let retrying = cluster_client(b, nodes.clone(), certificates.clone(), 2, &all)?;
    let c = connect_cluster(&retrying, b.connect_timeout, &all).await?;
    let once_client = cluster_client(b, nodes.clone(), certificates.clone(), 0, &all)?;
    let once = connect_cluster(&once_client, b.connect_timeout, &all).await?;
    let acked = b
        .replica_acks
        .is_some()
        .then(|| Connector::Cluster(Box::new(once_client), b.connect_timeout));
    let state = ClusterState {
        once,
        slots: Mutex::new(None),
    };
    Ok(Opened {
        conn: Conn::Cluster(c, Arc::new(state)),
        certificates,
        listen_on,
        sentinels: None,
        cluster_nodes: Some(nodes),
        acked,
    })
}

/// [`open`] for one node, at its URL or where its Sentinels say.
async fn open_node(
    b: &RedisBackendBuilder,
    certificates: Option<redis::TlsCertificates>,
    shown: &Shown,
) -> Result<Opened, LockError> {
    let mut listen_on = Vec::new();
    let mut sentinels = None;
    let target = match b.sentinel_url()? {
        Some(sentinel) => {
            let found = sentinel_target(b, sentinel, certificates.clone(), shown.first())?;
            sentinels = Some(found.clone());
            Target::Sentinel(found)
        }
        None => {
            let info = parse_url(&b.urls[0])?;
            let client =
                client(info, certificates.clone()).map_err(|e| config_error(shown.first(), &e))?;
            listen_on.push(client.clone());
            Target::Fixed(Box::new(client))
        }
    };
    // The backend applies its own request timeout to every request (to tell an
    // unknown outcome from an unreachable server), and the node's connection is
    // made again when a request it gave up on met silence (see `Node`); the
    // manager only bounds connecting.
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(b.connect_timeout))
        .set_response_timeout(None)
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    let c = with_timeout(
        b.connect_timeout * 2,
        Node::open(target.clone(), config.clone(), b.request_timeout),
    )
    .await
    .map_err(|e| connect_error(shown.first(), e))?;
    let acked = b.replica_acks.is_some().then(|| Connector::Single {
        target,
        config,
        request_timeout: b.request_timeout,
        limit: b.connect_timeout * 2,
    });
    Ok(Opened {
        conn: Conn::Single(c),
        certificates,
        listen_on,
        sentinels,
        cluster_nodes: None,
        acked,
    })
}

/// A cluster client that sends a request at most `retries` more times after an error.
fn cluster_client(
    b: &RedisBackendBuilder,
    nodes: Vec<redis::ConnectionInfo>,
    certificates: Option<redis::TlsCertificates>,
    retries: u32,
    shown_urls: &str,
) -> Result<ClusterClient, LockError> {
    let mut client = ClusterClientBuilder::new(nodes)
        .connection_timeout(b.connect_timeout)
        .response_timeout(b.request_timeout)
        .tcp_settings(tcp_settings())
        .retries(retries);
    if let Some(certificates) = certificates {
        client = client.certs(certificates);
    }
    client.build().map_err(|e| config_error(shown_urls, &e))
}

async fn connect_cluster(
    client: &ClusterClient,
    connect_timeout: Duration,
    shown_urls: &str,
) -> Result<ClusterConnection, LockError> {
    with_timeout(connect_timeout, client.get_async_connection())
        .await
        .map_err(|e| connect_error(shown_urls, e))
}

/// The Sentinels of a `redis+sentinel://` URL, each reached with the URL's TLS and the
/// [`RedisBackendBuilder::sentinel_auth`] credentials, and the master's settings.
fn sentinel_target(
    b: &RedisBackendBuilder,
    sentinel: SentinelUrl,
    certificates: Option<redis::TlsCertificates>,
    shown_url: &str,
) -> Result<Arc<Sentinels>, LockError> {
    let master = parse_url(&sentinel.master_url)?;
    let mut clients = Vec::new();
    for (host, port) in sentinel.sentinels {
        let addr = addr_at(&master, host, port);
        let mut settings = redis::RedisConnectionInfo::default().set_skip_set_lib_name();
        if let Some((user, password)) = &b.sentinel_auth {
            settings = settings.set_password(password);
            if !user.is_empty() {
                settings = settings.set_username(user);
            }
        }
        let info = master.clone().set_addr(addr).set_redis_settings(settings);
        clients.push(client(info, certificates.clone()).map_err(|e| config_error(shown_url, &e))?);
    }
    Ok(Arc::new(Sentinels::new(
        clients,
        sentinel.master_name,
        master,
        certificates,
        b.connect_timeout,
    )))
}

/// The connection settings of `url`, with [`tcp_settings`]. A connection sends no
/// `CLIENT SETINFO` (the client library's name): a user limited to the commands README
/// names may not run it, and Redis 7.2 and later log every refusal.
fn parse_url(url: &str) -> Result<redis::ConnectionInfo, LockError> {
    let info = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| config_error(&redact_url(url), &e))?;
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    Ok(info
        .set_redis_settings(settings)
        .set_tcp_settings(tcp_settings()))
}

/// Checks the servers before anything is loaded or locked: the credentials (`PING`), the
/// version (`INFO server`) and that no node may evict lock keys (`INFO memory`); reads
/// whether hash slots divide the keys and whether every master has shard channels.
async fn check_server(
    b: &RedisBackendBuilder,
    conn: &Conn,
    shown: &Shown,
) -> Result<Server, LockError> {
    // Connecting does not prove the credentials: a server with a password accepts the
    // connection and refuses the first command.
    bounded(b, shown, conn.command::<Value>(&redis::cmd("PING"))).await?;
    // A node that refuses `INFO` (an ACL rule, a renamed command) is left out.
    let infos: Vec<String> = bounded(b, shown, conn.infos("server"))
        .await?
        .into_iter()
        .filter_map(|(_, info)| String::from_redis_value(info).ok())
        .collect();
    for info in &infos {
        crate::version::check(info)
            .map_err(|m| LockError::Config(format!("{}: {m}", shown.all())))?;
    }
    let slotted = b.cluster
        || infos
            .iter()
            .any(|info| info.lines().any(|l| l.trim() == "redis_mode:cluster"));
    // Before anything is loaded or locked: a Redis that may evict lock keys is refused.
    // The `replica_acks` connections go to these same nodes: nothing more to read.
    let memory = bounded(b, shown, memory_infos(conn, shown.first())).await?;
    crate::eviction::check(memory)?;
    // Releases are announced on their key's shard when every master has shard
    // channels (SPUBLISH, Redis 7.0).
    let sharded = b.cluster
        && infos.iter().all(|info| {
            crate::version::server_version(info)
                .is_some_and(|(major, minor, _)| (major, minor) >= SHARD_CHANNELS)
        });
    Ok(Server { slotted, sharded })
}

/// The first Redis with shard channels (`SPUBLISH`, `SSUBSCRIBE`).
const SHARD_CHANNELS: (u32, u32) = (7, 0);

/// The `INFO memory` reply of each node the backend talks to (every master of a cluster),
/// with the node's name: its shown URL, or `host:port` in a cluster. A node's error reply
/// (a user without `+info`, a renamed `INFO`) is kept as that node's reply.
///
/// `INFO` rather than `CONFIG GET maxmemory-policy`: README's ACL user may run it, and
/// managed services that rename or block `CONFIG` still answer it.
async fn memory_infos(conn: &Conn, shown_url: &str) -> RedisResult<Vec<(String, Value)>> {
    let mut nodes: Vec<(String, Value)> = conn
        .infos("memory")
        .await?
        .into_iter()
        .map(|(node, info)| (node.unwrap_or_else(|| shown_url.to_owned()), info))
        .collect();
    nodes.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(nodes)
}

/// One step of `build` against the servers: bounded by the connect timeout, its error
/// naming the servers as the user gave them.
async fn bounded<T>(
    b: &RedisBackendBuilder,
    shown: &Shown,
    step: impl std::future::Future<Output = Result<T, redis::RedisError>>,
) -> Result<T, LockError> {
    with_timeout(b.connect_timeout, step)
        .await
        .map_err(|e| connect_error(&shown.all(), e))
}

/// Loads every script on every node.
async fn load_scripts(
    b: &RedisBackendBuilder,
    conn: &Conn,
    shown: &Shown,
) -> Result<(), LockError> {
    bounded(b, shown, conn.load_all()).await
}

/// Why the server refuses this user's announcements (with `SPUBLISH` if `sharded`), if it
/// does.
async fn refused_to_announce(
    b: &RedisBackendBuilder,
    conn: &Conn,
    sharded: bool,
    shown: &Shown,
) -> Result<Option<String>, LockError> {
    bounded(b, shown, announcements_refused(conn, &b.prefix, sharded)).await
}

/// Probes how this user may announce releases: on their shard where the masters have
/// shard channels, else with `PUBLISH` if the server lets it, else not at all (wake-ups
/// off, said in a warning).
async fn announcing(
    b: &RedisBackendBuilder,
    conn: &Conn,
    sharded: bool,
    shown: &Shown,
) -> Result<Announced, LockError> {
    let mut sharded = sharded;
    let mut refused = refused_to_announce(b, conn, sharded, shown).await?;
    if let Some(why) = refused.as_ref().filter(|_| sharded) {
        // A user with README's rules from before shard channels may PUBLISH: it keeps
        // its wake-ups, announced to every node.
        if refused_to_announce(b, conn, false, shown).await?.is_none() {
            warn!(
                "releases are announced with PUBLISH, which reaches every node of the \
                 cluster: {why}. Grant the user +spublish +ssubscribe +sunsubscribe to \
                 keep them on their key's shard"
            );
            (sharded, refused) = (false, None);
        }
    }
    if let Some(why) = &refused {
        warn!(
            "release wake-ups are off: {why}; waiters poll with backoff instead. Grant \
             the user the channels &{}:* to turn them on",
            b.prefix
        );
    }
    Ok(Announced { sharded, refused })
}

/// Where the release listener will subscribe: none when announcements are refused; the
/// shards where they go with `SPUBLISH`; otherwise the node, its Sentinels or the
/// cluster's nodes. A user who may announce but not subscribe gets no listener, which
/// would only be refused; on a cluster whose shard channels it may not subscribe to, one
/// over `PUBLISH` if it may (releases are then announced with `PUBLISH` too).
async fn listening(
    b: &RedisBackendBuilder,
    opened: &Opened,
    announced: &Announced,
    shown: &Shown,
) -> Result<Heard, LockError> {
    let sharded = announced.sharded;
    let mut node_servers = Some(match &opened.sentinels {
        Some(sentinels) => Servers::Sentinel(sentinels.clone()),
        None => Servers::Nodes(opened.listen_on.clone()),
    });
    let servers = match &opened.cluster_nodes {
        _ if announced.refused.is_some() => None,
        Some(nodes) if sharded => Some(shard_servers(b, nodes.clone(), &opened.certificates)),
        _ => node_servers.take(),
    };
    let Some(listening) = &servers else {
        return Ok(Heard { servers, sharded });
    };
    let Some(why) = subscribe_refused(b, listening).await else {
        return Ok(Heard { servers, sharded });
    };
    let unsharded = match node_servers.take() {
        Some(nodes)
            if sharded
                && refused_to_announce(b, &opened.conn, false, shown)
                    .await?
                    .is_none()
                && subscribe_refused(b, &nodes).await.is_none() =>
        {
            Some(nodes)
        }
        _ => None,
    };
    if unsharded.is_some() {
        warn!(
            "releases are announced with PUBLISH, which reaches every node of the \
             cluster: {why}. Grant the user +spublish +ssubscribe +sunsubscribe to \
             keep them on their key's shard"
        );
        return Ok(Heard {
            servers: unsharded,
            sharded: false,
        });
    }
    warn!(
        "release wake-ups are off: {why}; waiters poll with backoff instead. \
         Grant the user +subscribe +unsubscribe (+ssubscribe +sunsubscribe on \
         a Redis 7 cluster) to turn them on"
    );
    Ok(Heard {
        servers: None,
        sharded,
    })
}

/// The cluster's shards, for a listener that subscribes to each key on its shard.
fn shard_servers(
    b: &RedisBackendBuilder,
    nodes: Vec<redis::ConnectionInfo>,
    certificates: &Option<redis::TlsCertificates>,
) -> Servers {
    let (connect_timeout, certificates) = (b.connect_timeout, certificates.clone());
    Servers::Shards(Box::new(move |pushes| {
        let mut client = ClusterClientBuilder::new(nodes.clone())
            .connection_timeout(connect_timeout)
            .tcp_settings(tcp_settings())
            .use_protocol(ProtocolVersion::RESP3)
            .push_sender(pushes);
        if let Some(certificates) = certificates.clone() {
            client = client.certs(certificates);
        }
        client.build()
    }))
}

/// Why `servers` refuse this user's subscriptions, if they do; none when they cannot be
/// reached now (the listener finds out when it runs).
async fn subscribe_refused(b: &RedisBackendBuilder, servers: &Servers) -> Option<String> {
    let probed = with_timeout(b.connect_timeout, subscriptions_refused(servers, &b.prefix)).await;
    probed.unwrap_or_else(|e| {
        debug!(error = %e.kind_name(), "no subscription tried at build");
        None
    })
}

/// Opens the first of the connections of acquires with `WAIT`, if `replica_acks` asks for
/// them.
async fn open_acked(
    connector: Option<Connector>,
    shown: &Shown,
) -> Result<Option<Arc<AckedConns>>, LockError> {
    match connector {
        Some(connector) => AckedConns::open(connector)
            .await
            .map(Some)
            .map_err(|e| connect_error(&shown.all(), e)),
        None => Ok(None),
    }
}

/// The [`Core`], with its capabilities and its release listener (started on its first
/// watch).
fn assemble(
    b: RedisBackendBuilder,
    conn: Conn,
    shown: Shown,
    server: Server,
    announced: &Announced,
    heard: Heard,
    acked: Option<Arc<AckedConns>>,
) -> Core {
    let caps = Capabilities::new(Duration::from_millis(1), b.min_ttl, b.max_ttl)
        .native_batch(true)
        .server_side_ttl(true)
        .inspect(true)
        .wakes_waiters(heard.servers.is_some());
    Core {
        conn,
        index_refused: std::sync::atomic::AtomicBool::new(false),
        listener: ReleaseListener::new(
            heard.servers,
            b.prefix.clone(),
            b.connect_timeout,
            b.request_timeout,
        ),
        calls: Calls {
            prefix: b.prefix,
            slotted: server.slotted,
            sharded: heard.sharded,
            announces: announced.refused.is_none(),
        },
        caps,
        request_timeout: b.request_timeout,
        replica_acks: b.replica_acks,
        acked,
        id: BackendId::next(),
        shown_urls: shown.0,
        cluster: b.cluster,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection the backend opens is made from these settings (the cluster
    /// clients are given [`tcp_settings`] too).
    #[test]
    fn connections_have_nodelay_and_keepalive() {
        for url in ["redis://127.0.0.1:6379/", "rediss://u:p@127.0.0.1:6380/2"] {
            let info = parse_url(url).unwrap();
            assert!(info.tcp_settings().nodelay(), "{url}");
            assert!(info.tcp_settings().keepalive().is_some(), "{url}");
        }
    }
}
