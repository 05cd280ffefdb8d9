//! Building a [`RedisBackend`]: the connection to one node or a cluster (two for a
//! cluster), the credentials and server version checked, and the scripts loaded.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::{BackendId, Capabilities, LockError};
use parking_lot::Mutex;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};

use super::coalesce::Queue;
use super::{Inner, LONGEST_TTL, RedisBackend};
use crate::config::{RedisBackendBuilder, redact_url};
use crate::conn::{ClusterState, Conn};
use crate::error::{config_error, connect_error};
use crate::releases::ReleaseListener;

impl RedisBackend {
    pub(crate) async fn connect(b: RedisBackendBuilder) -> Result<Self, LockError> {
        let shown_urls: Vec<String> = b.urls.iter().map(|u| redact_url(u)).collect();
        if b.max_ttl > LONGEST_TTL {
            return Err(LockError::Config(format!(
                "max_ttl {:?} is longer than Redis can keep an expiry; at most {LONGEST_TTL:?}",
                b.max_ttl
            )));
        }
        if b.uses_tls() {
            crate::tls::ensure_crypto_provider();
        }
        let certificates = b.tls_root_ca.clone().map(|pem| redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(pem),
        });
        let mut listen_on = Vec::new();
        let conn = if b.cluster {
            for (url, shown) in b.urls.iter().zip(&shown_urls) {
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
            // A PUBLISH reaches every node of a cluster: release notifications can be
            // heard on any of them.
            for node in &nodes {
                listen_on.push(
                    match certificates.clone() {
                        Some(certificates) => {
                            redis::Client::build_with_tls(node.clone(), certificates)
                        }
                        None => redis::Client::open(node.clone()),
                    }
                    .map_err(|e| config_error(&shown_urls.join(","), &e))?,
                );
            }
            let shown = shown_urls.join(",");
            // Two connections: one that retries (reads, and scripts safe to run twice), one
            // that never sends a request again (see `Conn`).
            let c = cluster_connection(&b, nodes.clone(), certificates.clone(), 2, &shown).await?;
            let once = cluster_connection(&b, nodes, certificates, 0, &shown).await?;
            Conn::Cluster(
                c,
                Arc::new(ClusterState {
                    once,
                    slots: Mutex::new(None),
                }),
            )
        } else {
            let info = parse_url(&b.urls[0])?;
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(info, certificates),
                None => redis::Client::open(info),
            }
            .map_err(|e| config_error(&shown_urls[0], &e))?;
            listen_on.push(client.clone());
            // The backend applies its own response timeout (to tell an unknown outcome
            // from an unreachable server); the manager only bounds connecting.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(b.connect_timeout))
                .set_response_timeout(None)
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let c = with_timeout(
                b.connect_timeout * 2,
                ConnectionManager::new_with_config(client, config),
            )
            .await
            .map_err(|e| connect_error(&shown_urls[0], e))?;
            Conn::Single(c)
        };
        // Connecting does not prove the credentials: a server with a password accepts the
        // connection and refuses the first command.
        let ping = redis::cmd("PING");
        let probe = match &conn {
            Conn::Single(c) => {
                with_timeout(b.connect_timeout, c.clone().req_packed_command(&ping)).await
            }
            Conn::Cluster(c, _) => {
                with_timeout(b.connect_timeout, c.clone().req_packed_command(&ping)).await
            }
        };
        probe
            .and_then(Value::extract_error)
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        let infos = with_timeout(b.connect_timeout, conn.server_infos())
            .await
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        for info in infos {
            crate::version::check(&info)
                .map_err(|m| LockError::Config(format!("{}: {m}", shown_urls.join(","))))?;
        }
        with_timeout(b.connect_timeout, conn.load_all())
            .await
            .map_err(|e| connect_error(&shown_urls.join(","), e))?;
        let caps = Capabilities::new(Duration::from_millis(1), b.min_ttl, b.max_ttl)
            .native_batch(true)
            .server_side_ttl(true)
            .inspect(true)
            .wakes_waiters(true);
        Ok(Self {
            inner: Arc::new(Inner {
                conn,
                listener: ReleaseListener::new(listen_on, b.prefix.clone(), b.connect_timeout),
                prefix: b.prefix,
                caps,
                response_timeout: b.response_timeout,
                replica_acks: b.replica_acks,
                fence_retention: b.fence_retention,
                id: BackendId::next(),
                shown_urls,
                cluster: b.cluster,
                acquires: Queue::default(),
                releases: Queue::default(),
            }),
        })
    }
}

async fn cluster_connection(
    b: &RedisBackendBuilder,
    nodes: Vec<redis::ConnectionInfo>,
    certificates: Option<redis::TlsCertificates>,
    retries: u32,
    shown_urls: &str,
) -> Result<ClusterConnection, LockError> {
    let mut client = ClusterClientBuilder::new(nodes)
        .connection_timeout(b.connect_timeout)
        .response_timeout(b.response_timeout)
        .retries(retries);
    if let Some(certificates) = certificates {
        client = client.certs(certificates);
    }
    let client = client.build().map_err(|e| config_error(shown_urls, &e))?;
    with_timeout(b.connect_timeout, client.get_async_connection())
        .await
        .map_err(|e| connect_error(shown_urls, e))
}

async fn with_timeout<T>(
    limit: Duration,
    f: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no connection within {limit:?}"),
        )))
    })
}

fn parse_url(url: &str) -> Result<redis::ConnectionInfo, LockError> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| config_error(&redact_url(url), &e))
}
