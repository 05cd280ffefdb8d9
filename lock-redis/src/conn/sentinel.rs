//! [`Sentinels`]: where the master Redis Sentinel monitors under a name is now.
//!
//! The Sentinels are asked in turn (`SENTINEL GET-MASTER-ADDR-BY-NAME`), each within the
//! connect timeout, and the first address one answers is the master's. redis-rs's own
//! `sentinel` module is not used: its lookup takes the Sentinels' answers in the order they
//! were given with no limit of its own on each, so one Sentinel that stopped answering
//! would hold every lookup, and the client it returns would not carry the backend's TCP
//! options. The master's connection is then made by [`super::Node`], which checks its
//! `ROLE`.
//!
//! A switchover leaves the old master serving writes until the Sentinels demote it, seconds
//! after they named the new one (they wait to see it report itself a master for a while
//! first). [`Sentinels::follow_switches`] listens for the Sentinels' `+switch-master` and
//! has the node's connection replaced at once, so writes stop going to the old master as
//! soon as the Sentinels name the new one, not when the old one starts refusing them.

use std::time::Duration;

use futures::StreamExt;
use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, RedisResult};
use tracing::debug;

/// The pause before subscribing again after a Sentinel's subscription ended.
const RESUBSCRIBE_PAUSE: Duration = Duration::from_millis(100);

/// The Sentinels of one master, and the settings of the connections to that master.
pub(crate) struct Sentinels {
    /// One client per Sentinel, in the order given.
    sentinels: Vec<redis::Client>,
    master_name: String,
    /// The master's settings (credentials, database, TLS, TCP options); its address is
    /// what the Sentinels answer.
    master: ConnectionInfo,
    certificates: Option<redis::TlsCertificates>,
    /// How long asking one Sentinel may take.
    timeout: Duration,
}

impl Sentinels {
    pub(crate) fn new(
        sentinels: Vec<redis::Client>,
        master_name: String,
        master: ConnectionInfo,
        certificates: Option<redis::TlsCertificates>,
        timeout: Duration,
    ) -> Self {
        Self {
            sentinels,
            master_name,
            master,
            certificates,
            timeout,
        }
    }

    /// The master's database, which every connection to it selects.
    pub(crate) fn db(&self) -> i64 {
        self.master.redis_settings().db()
    }

    /// A client of the master the first Sentinel that answers names.
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        let mut last = None;
        for sentinel in &self.sentinels {
            let asked = tokio::time::timeout(self.timeout, self.ask(sentinel)).await;
            match asked.unwrap_or_else(|_| {
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer from a Sentinel within {:?}", self.timeout),
                )))
            }) {
                Ok((host, port)) => {
                    debug!(%host, port, "the Sentinels name the master");
                    return self.client_at(host, port);
                }
                Err(e) => {
                    debug!(error = %e, "a Sentinel did not name the master");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::Client, "no Sentinel given"))))
    }

    /// Calls `switched` each time a Sentinel announces that the master moved
    /// (`+switch-master`), and once after each subscription but the first (a switch may
    /// have been missed in between), subscribed to one Sentinel at a time, the next one
    /// when it goes away. Runs until `switched` returns false.
    pub(crate) async fn follow_switches(&self, switched: impl Fn() -> bool) {
        let mut subscriptions = 0usize;
        let prefix = format!("{} ", self.master_name);
        for sentinel in self.sentinels.iter().cycle() {
            let subscribed = tokio::time::timeout(self.timeout, async {
                let mut pubsub = sentinel.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, RedisError>(pubsub)
            })
            .await;
            if let Ok(Ok(pubsub)) = subscribed {
                subscriptions += 1;
                if subscriptions > 1 && !switched() {
                    return;
                }
                let mut messages = pubsub.into_on_message();
                while let Some(message) = messages.next().await {
                    let payload: String = message.get_payload().unwrap_or_default();
                    // `<name> <old host> <old port> <new host> <new port>`
                    if payload.starts_with(&prefix) {
                        debug!(%payload, "the Sentinels switched the master");
                        if !switched() {
                            return;
                        }
                    }
                }
            }
            tokio::time::sleep(RESUBSCRIBE_PAUSE).await;
        }
    }

    /// The master's address, as `sentinel` knows it.
    async fn ask(&self, sentinel: &redis::Client) -> RedisResult<(String, u16)> {
        let mut conn = sentinel.get_multiplexed_async_connection().await?;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.master_name)
            .query_async(&mut conn)
            .await?;
        addr.ok_or_else(|| {
            RedisError::from((
                ErrorKind::InvalidClientConfig,
                "unknown master name",
                format!(
                    "the Sentinels monitor no master named `{}`",
                    self.master_name
                ),
            ))
        })
    }

    fn client_at(&self, host: String, port: u16) -> RedisResult<redis::Client> {
        let info = self
            .master
            .clone()
            .set_addr(addr_at(&self.master, host, port));
        client(info, self.certificates.clone())
    }
}

/// A client of `info`, trusting `certificates` (the backend's root CA) for TLS if given.
pub(crate) fn client(
    info: ConnectionInfo,
    certificates: Option<redis::TlsCertificates>,
) -> RedisResult<redis::Client> {
    match certificates {
        Some(certificates) => redis::Client::build_with_tls(info, certificates),
        None => redis::Client::open(info),
    }
}

/// `host:port`, reached as `info`'s address is: with its TLS settings, if any.
pub(crate) fn addr_at(info: &ConnectionInfo, host: String, port: u16) -> ConnectionAddr {
    match info.addr() {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host,
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => ConnectionAddr::Tcp(host, port),
    }
}
