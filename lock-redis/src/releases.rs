//! [`ReleaseListener`]: one pub/sub connection per backend, so that a waiter in
//! [`distlock_core::Locker::lock`] is woken when the key it waits for is released.
//!
//! # A channel per key
//!
//! The release scripts `PUBLISH` on the lock's own key name (channels and keys are
//! separate namespaces) when they delete a lock. The listener `SUBSCRIBE`s to the keys
//! waiters in this process watch, and only those: a process hears the releases it waits
//! for, not every release of the deployment, and a release nobody waits for costs the
//! server one lookup. Expiries are not announced (that would take keyspace
//! notifications, a server setting); waiters find an expired key by their backoff.
//!
//! On a Redis Cluster of 7.0 or newer the scripts `SPUBLISH` instead, which stays on the
//! shard that owns the key (a `PUBLISH` goes to every node over the cluster bus), and the
//! listener `SSUBSCRIBE`s to each key on its shard through one cluster connection
//! ([`Servers::Shards`]), which subscribes again by itself after a reconnect or a slot
//! move. An older cluster `PUBLISH`es, and the listener subscribes on any one node.
//!
//! # Subscriptions follow the hub
//!
//! The [`ReleaseHub`] says which keys are watched. Each change only nudges the listener,
//! which then makes its subscriptions match the hub's keys, so changes that race each
//! other (the last waiter of a key leaving while a new one arrives) end in the right
//! state.
//!
//! # Users without channel rights
//!
//! The scripts announce with `redis.pcall`, so a `PUBLISH` the server refuses (an ACL
//! user without rights on the channel, Redis 7's default for new users) never fails or
//! undoes a release. When the backend is built, [`announcements_refused`] finds such a
//! user, and [`subscriptions_refused`] one that may announce but not subscribe (no
//! `+subscribe`): the backend then runs without a listener, says so once in a warning and
//! in its capabilities, and waiters poll. (On a Redis 7 cluster, a user refused `SPUBLISH`
//! or `SSUBSCRIBE` who may `PUBLISH` and `SUBSCRIBE` is heard over those instead.) That is
//! no configuration error: wake-ups only shorten a wait, the locks are the same without
//! them, and a deployment whose ACL lacks a pub/sub command keeps working as it did.
//!
//! A `SUBSCRIBE` (or `SSUBSCRIBE`) refused later (the user's rights changed) ends the
//! listener for good, with one warning, instead of connecting again every few seconds or
//! for every waiter. A backend that hears no release (no listener, or one refused) marks no
//! key waited for when it finds it held, and one whose announcements the server refuses
//! announces none (`-` to the release scripts): no `PUBLISH` for nobody, and no `ACL LOG`
//! entry per release.
//!
//! # Reconnects and lifetime
//!
//! The listener's lifecycle (started by the first watch, followed again with a growing
//! pause whenever the connection drops or falls silent, ended with the backend) is the
//! core's [`distlock_core::wake::ReleaseListener`]; [`Follower`] is how it follows Redis.
//! A subscription is quiet by nature, so the listener pings after a request timeout
//! without a word and gives the connection up when a ping (or a subscription change)
//! goes unanswered for another: a connection that died without a reset is replaced within
//! two request timeouts. After each reconnect it subscribes to every watched key (on the
//! next node, on a cluster) and wakes one waiter of each, since releases while it was
//! away were not heard. A cluster connection with shard channels subscribes again by
//! itself; each confirmation it hears wakes a waiter of that key, for the same reason.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::LockKey;
use distlock_core::wake::{FollowReleases, Followed, ReleaseWatch, Releases};
use futures::StreamExt;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{PushInfo, PushKind, RedisError, RedisResult, Value};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::conn::{Conn, Sentinels};
use crate::error::{KindName, is_no_permission};
use crate::keys::LockKeys;

/// The release subscriptions of one backend (shared by its clones); none when this user
/// may not announce releases, and waiters poll.
pub(crate) struct ReleaseListener(Option<distlock_core::wake::ReleaseListener<Follower>>);

/// How the listener follows the servers.
pub(crate) struct Follower {
    servers: Servers,
    prefix: String,
    connect_timeout: Duration,
    /// How long a subscription change or a ping may wait for its answer, and how long the
    /// connection may stay quiet before it is pinged.
    request_timeout: Duration,
}

/// Where the listener subscribes.
pub(crate) enum Servers {
    /// `SUBSCRIBE` on one of these (one node, or any node of a cluster older than 7.0),
    /// tried in turn.
    Nodes(Vec<redis::Client>),
    /// `SUBSCRIBE` on the master the Sentinels name when connecting: after a failover the
    /// next connection follows it. (A master demoted while subscribed keeps delivering:
    /// a replica receives its master's `PUBLISH`es.)
    Sentinel(Arc<Sentinels>),
    /// `SSUBSCRIBE`, each key on its shard, through a cluster connection of a client this
    /// makes, given the sender the pushes (messages, confirmations) are to go to.
    Shards(Box<ShardClient>),
}

/// Makes the cluster client of [`Servers::Shards`].
pub(crate) type ShardClient = dyn Fn(PushSender) -> RedisResult<ClusterClient> + Send + Sync;

/// Where a cluster connection sends what the servers push.
pub(crate) type PushSender = UnboundedSender<PushInfo>;

impl ReleaseListener {
    /// A listener subscribing on `servers` to the lock keys under `prefix`, or none
    /// without servers (this user may not announce releases); nothing is opened until a
    /// key is watched.
    pub(crate) fn new(
        servers: Option<Servers>,
        prefix: String,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> Self {
        Self(servers.map(|servers| {
            distlock_core::wake::ReleaseListener::new(Follower {
                servers,
                prefix,
                connect_timeout,
                request_timeout,
            })
        }))
    }

    /// Starts watching `key`, and the listener if it does not run. `None` outside a tokio
    /// runtime, where no listener can run, and without a listener (callers poll).
    pub(crate) fn watch(&self, key: &LockKey) -> Option<ReleaseWatch> {
        self.0.as_ref()?.watch(key)
    }

    /// Starts watching a semaphore's slots with one watch, as [`Self::watch`] a key.
    pub(crate) fn watch_permits(&self, slots: &[LockKey]) -> Option<ReleaseWatch> {
        self.0.as_ref()?.watch_permits(slots)
    }

    /// Whether an acquire of `key` grants it marked waited for: more than one waiter of
    /// this process watches it (see [`distlock_core::wake::ReleaseHub::watchers`]). One may
    /// be the caller itself, in `Locker::lock`, whose own grant needs no announcement; any
    /// other was not woken by the release that freed the key, and would mark it only after
    /// its backoff.
    pub(crate) fn others_wait(&self, key: &LockKey) -> bool {
        self.0.as_ref().is_some_and(|l| l.watchers(key) > 1)
    }

    /// Whether this backend hears releases: it has a listener, which the server has not
    /// refused. Acquires mark the keys they find held only then (see `acquire.lua`).
    pub(crate) fn hears_releases(&self) -> bool {
        self.0.as_ref().is_some_and(|l| !l.refused())
    }

    /// The keys waiters of this backend are watching.
    pub(crate) fn watched_keys(&self) -> Vec<LockKey> {
        self.0.as_ref().map_or_else(Vec::new, |l| l.watched_keys())
    }
}

#[distlock_core::async_trait]
impl FollowReleases for Follower {
    const FIRST_PAUSE: Duration = Duration::from_millis(50);

    /// [`Self::follow_node`] on the next node, or [`Self::follow_shards`].
    async fn follow(&self, releases: &Releases, attempt: usize) -> Followed {
        let mut connected = false;
        let Err(e) = match &self.servers {
            Servers::Nodes(clients) => {
                let client = &clients[attempt % clients.len()];
                self.follow_node(client, releases, &mut connected).await
            }
            Servers::Sentinel(sentinels) => match sentinels.master().await {
                Ok(client) => self.follow_node(&client, releases, &mut connected).await,
                Err(e) => Err(e),
            },
            Servers::Shards(client) => self.follow_shards(client, releases, &mut connected).await,
        };
        if is_no_permission(&e) {
            warn!(
                error = %e.kind_name(),
                "release wake-ups are off: the server refuses this user's SUBSCRIBE (or \
                 SSUBSCRIBE) to the release channels; waiters poll instead"
            );
            return Followed::Refused;
        }
        debug!(error = %e, "release subscription lost; connecting again");
        if connected {
            Followed::Lost
        } else {
            Followed::Failed
        }
    }
}

impl Follower {
    /// One connection's life on one node: connect, then [`Self::deliver`] its messages.
    async fn follow_node(
        &self,
        client: &redis::Client,
        releases: &Releases,
        connected: &mut bool,
    ) -> redis::RedisResult<Infallible> {
        let pubsub = self.connecting(client.get_async_pubsub()).await?;
        let (mut sink, stream) = pubsub.split();
        let heard = stream.map(|message| message.get_channel_name().to_owned());
        self.deliver(Subscriber::Node(&mut sink), heard, releases, connected)
            .await
    }

    /// [`Self::follow_node`] with shard channels, through one cluster connection, which
    /// subscribes again by itself after reconnecting to a node or when a slot moves, and
    /// whose pushes come on a channel. It ends when a subscription fails (the cluster
    /// unreachable, or the command refused).
    async fn follow_shards(
        &self,
        client: &ShardClient,
        releases: &Releases,
        connected: &mut bool,
    ) -> RedisResult<Infallible> {
        let (sender, mut pushes) = unbounded_channel();
        let client = client(sender)?;
        let mut cluster = self.connecting(client.get_async_connection()).await?;
        // A message is a release; a confirmation may come from subscribing again after a
        // reconnect, when releases may have been missed: both wake a waiter.
        let heard = futures::stream::poll_fn(move |cx| pushes.poll_recv(cx)).filter_map(|push| {
            let channel = match (push.kind, push.data.first()) {
                (PushKind::SMessage | PushKind::SSubscribe, Some(Value::BulkString(channel))) => {
                    Some(String::from_utf8_lossy(channel).into_owned())
                }
                _ => None,
            };
            std::future::ready(channel)
        });
        self.deliver(Subscriber::Shards(&mut cluster), heard, releases, connected)
            .await
    }

    /// One connection's life once made: subscribe to the watched keys, wake their waiters
    /// (releases may have been missed while there was no connection), then wake a waiter
    /// of each channel `heard`, keeping the subscriptions matching the hub, until the
    /// connection drops or falls silent, which are the only ways it ends. `connected` is
    /// set once the watched keys are subscribed.
    ///
    /// A subscription is quiet by nature, and a connection that died without a reset (a
    /// NAT or balancer that dropped its flow) stays quiet for ever: after a request
    /// timeout with nothing heard the listener pings, and a ping or a subscription change
    /// not answered within the request timeout ends the connection. A dead one is thus
    /// given up within two request timeouts.
    async fn deliver(
        &self,
        mut sink: Subscriber<'_>,
        heard: impl futures::Stream<Item = String>,
        releases: &Releases,
        connected: &mut bool,
    ) -> RedisResult<Infallible> {
        let mut subscribed: HashMap<String, LockKey> = HashMap::new();
        self.answered(self.reconcile(&mut sink, releases, &mut subscribed))
            .await?;
        *connected = true;
        let mut heard_at = Instant::now();
        tokio::pin!(heard);
        loop {
            tokio::select! {
                () = releases.changed() => {
                    self.answered(self.reconcile(&mut sink, releases, &mut subscribed)).await?;
                    heard_at = Instant::now();
                }
                channel = heard.next() => {
                    let Some(channel) = channel else {
                        return Err(RedisError::from(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "the release subscription's connection closed",
                        )));
                    };
                    heard_at = Instant::now();
                    if let Some(key) = subscribed.get(&channel) {
                        releases.wake(key);
                    }
                }
                () = tokio::time::sleep_until(heard_at + self.request_timeout) => {
                    self.answered(sink.ping()).await?;
                    heard_at = Instant::now();
                }
            }
        }
    }

    /// `request`, given at most the request timeout: a connection that does not answer
    /// in time is taken for dead.
    async fn answered<T>(&self, request: impl Future<Output = RedisResult<T>>) -> RedisResult<T> {
        tokio::time::timeout(self.request_timeout, request)
            .await
            .map_err(|_| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the release subscription's connection did not answer within {:?}",
                        self.request_timeout
                    ),
                ))
            })?
    }

    /// `connect`, given at most the connect timeout.
    async fn connecting<T>(&self, connect: impl Future<Output = RedisResult<T>>) -> RedisResult<T> {
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "connecting for release notifications timed out",
                ))
            })?
    }

    /// Subscribes to the watched keys not yet subscribed, and unsubscribes from the rest.
    async fn reconcile(
        &self,
        sink: &mut Subscriber<'_>,
        releases: &Releases,
        subscribed: &mut HashMap<String, LockKey>,
    ) -> redis::RedisResult<()> {
        let wanted: HashMap<String, LockKey> = releases
            .watched_keys()
            .into_iter()
            .map(|key| (LockKeys::new(&self.prefix, &key).lock, key))
            .collect();
        let gone: Vec<String> = subscribed
            .keys()
            .filter(|channel| !wanted.contains_key(*channel))
            .cloned()
            .collect();
        let new: HashSet<&String> = wanted
            .keys()
            .filter(|channel| !subscribed.contains_key(*channel))
            .collect();
        if !gone.is_empty() {
            sink.unsubscribe(&gone).await?;
        }
        let new: Vec<String> = new.into_iter().cloned().collect();
        if !new.is_empty() {
            sink.subscribe(&new).await?;
        }
        *subscribed = wanted;
        // A key may have been released between its waiter's last look and the
        // subscription taking effect: that waiter looks once more.
        for channel in &new {
            if let Some(key) = subscribed.get(channel) {
                releases.wake(key);
            }
        }
        Ok(())
    }
}

/// What [`Follower::reconcile`] subscribes with.
enum Subscriber<'a> {
    /// A pub/sub connection to one node.
    Node(&'a mut redis::aio::PubSubSink),
    /// A cluster connection, which sends each shard channel's command to its key's shard.
    Shards(&'a mut ClusterConnection),
}

impl Subscriber<'_> {
    async fn subscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        match self {
            Self::Node(sink) => sink.subscribe(channels).await,
            Self::Shards(cluster) => each_shard_channel(cluster, channels, true).await,
        }
    }

    async fn unsubscribe(&mut self, channels: &[String]) -> RedisResult<()> {
        match self {
            Self::Node(sink) => sink.unsubscribe(channels).await,
            Self::Shards(cluster) => each_shard_channel(cluster, channels, false).await,
        }
    }

    /// `PING` over the connection (every master's, in a cluster), which must answer.
    async fn ping(&mut self) -> RedisResult<()> {
        match self {
            Self::Node(sink) => sink.ping::<Value>().await.map(drop),
            Self::Shards(cluster) => cluster
                .route_command(
                    redis::cmd("PING"),
                    RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::AllSucceeded),
                    )),
                )
                .await
                .and_then(Value::extract_error)
                .map(drop),
        }
    }
}

/// `SSUBSCRIBE` (or `SUNSUBSCRIBE`) to `channels`, one command per channel: a command's
/// shard channels must share a slot, and each lock key has a slot of its own.
async fn each_shard_channel(
    cluster: &ClusterConnection,
    channels: &[String],
    subscribe: bool,
) -> RedisResult<()> {
    futures::future::try_join_all(channels.iter().map(|channel| {
        let mut cluster = cluster.clone();
        async move {
            if subscribe {
                cluster.ssubscribe(channel).await
            } else {
                cluster.sunsubscribe(channel).await
            }
        }
    }))
    .await?;
    Ok(())
}

/// Why this backend's user may not announce releases, or `None` when it may: a `PUBLISH`
/// (`SPUBLISH` when `sharded`) to `<prefix>:{}`, a channel under the prefix that no lock
/// uses (a lock name is never empty), which the server refuses with `NOPERM` when the
/// user has no rights on the release channels or on the command.
pub(crate) async fn announcements_refused(
    conn: &Conn,
    prefix: &str,
    sharded: bool,
) -> Result<Option<String>, RedisError> {
    let channel = format!("{prefix}:{{}}");
    let command = if sharded { "SPUBLISH" } else { "PUBLISH" };
    let mut publish = redis::cmd(command);
    publish.arg(&channel).arg("");
    match conn.command::<i64>(&publish).await {
        Ok(_) => Ok(None),
        Err(e) if is_no_permission(&e) => Ok(Some(format!(
            "the server refuses {command} to {channel} for this user ({})",
            e.kind_name()
        ))),
        Err(e) => Err(e),
    }
}

/// Why this backend's user may not subscribe to the release channels on `servers`, or
/// `None` when it may: a `SUBSCRIBE` (`SSUBSCRIBE` on [`Servers::Shards`]) to the channel
/// [`announcements_refused`] publishes to, over a connection made for it and closed after,
/// which the server refuses with `NOPERM` when the user lacks the command or the channel.
/// Any other error says nothing of the user's rights.
pub(crate) async fn subscriptions_refused(
    servers: &Servers,
    prefix: &str,
) -> Result<Option<String>, RedisError> {
    let channel = format!("{prefix}:{{}}");
    let (command, subscribed) = match servers {
        Servers::Nodes(clients) => ("SUBSCRIBE", subscribe_on(&clients[0], &channel).await),
        Servers::Sentinel(sentinels) => match sentinels.master().await {
            Ok(master) => ("SUBSCRIBE", subscribe_on(&master, &channel).await),
            Err(e) => return Err(e),
        },
        Servers::Shards(client) => {
            let (sender, _pushes) = unbounded_channel();
            let cluster = client(sender)?.get_async_connection().await;
            ("SSUBSCRIBE", cluster?.ssubscribe(&channel).await)
        }
    };
    match subscribed {
        Ok(()) => Ok(None),
        Err(e) if is_no_permission(&e) => Ok(Some(format!(
            "the server refuses {command} to {channel} for this user ({})",
            e.kind_name()
        ))),
        Err(e) => Err(e),
    }
}

/// `SUBSCRIBE` to `channel` over a pub/sub connection of `client`'s, closed after.
async fn subscribe_on(client: &redis::Client, channel: &str) -> RedisResult<()> {
    client.get_async_pubsub().await?.subscribe(channel).await
}
