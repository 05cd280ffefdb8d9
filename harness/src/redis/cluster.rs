//! A 3-master Redis Cluster ([`RedisCluster`]) of [`RedisServer`] nodes, and the hash slot
//! of a key ([`key_slot`]).

use std::time::Duration;

use super::builder::RedisServerBuilder;
use super::node::RedisServer;
use super::resp::RespValue;
use crate::binary::find_binary;
use crate::clock::ShiftedClock;
use crate::error::HarnessError;
use crate::probe::{Probe, wait_until_ready};

/// How long a 3-node cluster may take to report `cluster_state:ok`.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);

/// The Redis Cluster hash slot of `key`: CRC16/XMODEM of its `{hash tag}` (or the whole
/// key) mod 16384, computed as redis-rs does (its own slot function is not public).
pub fn key_slot(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let len = rest.iter().position(|&b| b == b'}')?;
            (len > 0).then(|| &rest[..len])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % 16384
}

/// A Redis Cluster of 3 masters (no replicas) on 127.0.0.1, formed with
/// `redis-cli --cluster create`. Each node is a [`RedisServer`] with its own directory
/// (holding `nodes.conf`, so a restarted node rejoins with its identity and slots).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    /// The options every node is started with, replicas too.
    node: RedisServerBuilder,
}

impl RedisCluster {
    /// Starts 3 cluster-enabled masters (`--cluster-node-timeout 2000`), assigns all slots
    /// with `redis-cli --cluster create`, and waits until every node reports
    /// `cluster_state:ok`.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::builder().start().await
    }

    /// Options: the wall clock of the nodes.
    pub fn builder() -> RedisClusterBuilder {
        RedisClusterBuilder {
            node: RedisServer::builder().cluster(true),
        }
    }

    /// The nodes, in start order (node 0 holds the lowest slots after creation).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// `redis://127.0.0.1:PORT/` for every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The client ports of the masters.
    pub fn master_ports(&self) -> Vec<u16> {
        cluster_ports(&self.nodes)
    }

    /// Waits until every running, unpaused node reports `cluster_state:ok` in
    /// `CLUSTER INFO` (for example after [`RedisServer::restart`] of a node).
    pub async fn wait_healthy(&self, timeout: Duration) -> Result<(), HarnessError> {
        let ports = self.master_ports();
        wait_until_ready(
            &format!("redis cluster on ports {ports:?}"),
            timeout,
            Duration::from_millis(50),
            || async move {
                for node in &self.nodes {
                    if !node.is_running() || node.is_paused() {
                        continue;
                    }
                    match node
                        .command_timeout(&["CLUSTER", "INFO"], Duration::from_secs(2))
                        .await
                    {
                        Ok(reply) => {
                            let text = reply.as_text().unwrap_or_default();
                            if !text.contains("cluster_state:ok") {
                                return Probe::NotYet(format!(
                                    "node {} not ok: {}",
                                    node.port(),
                                    text.lines().next().unwrap_or("")
                                ));
                            }
                        }
                        Err(e) => return Probe::NotYet(e.to_string()),
                    }
                }
                Probe::Ready(())
            },
        )
        .await
    }

    /// The node that serves `slot`, according to `CLUSTER SLOTS` asked of the first running,
    /// unpaused node.
    pub async fn node_for_slot(&self, slot: u16) -> Result<&RedisServer, HarnessError> {
        let mut last = HarnessError::Setup("no running, unpaused cluster node to ask".into());
        for node in self
            .nodes
            .iter()
            .filter(|n| n.is_running() && !n.is_paused())
        {
            let reply = match node.command(&["CLUSTER", "SLOTS"]).await {
                Ok(r) => r,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let port = slot_owner_port(&reply, slot).ok_or_else(|| HarnessError::Protocol {
                what: format!("CLUSTER SLOTS on {}", node.port()),
                detail: format!("no owner for slot {slot} in {reply:?}"),
            })?;
            return self.nodes.iter().find(|n| n.port() == port).ok_or_else(|| {
                HarnessError::Setup(format!("slot {slot} is served by unknown port {port}"))
            });
        }
        Err(last)
    }

    /// Starts a cluster node that joins as a replica of `master` (one of [`nodes`]) and
    /// returns once it has synced with it, so the cluster can fail `master` over to it. It
    /// runs under the cluster's [clock](RedisClusterBuilder::clock), if it has one.
    ///
    /// [`nodes`]: Self::nodes
    pub async fn start_replica(&self, master: &RedisServer) -> Result<RedisServer, HarnessError> {
        let replica = self.node.clone().start().await?;
        let master_id = master
            .command(&["CLUSTER", "MYID"])
            .await?
            .as_text()
            .unwrap_or_default();
        let master_port = master.port().to_string();
        replica
            .command(&["CLUSTER", "MEET", "127.0.0.1", &master_port])
            .await?;
        let (replica_ref, master_id) = (&replica, master_id.as_str());
        wait_until_ready(
            &format!("replica {} of {}", replica.port(), master.port()),
            CLUSTER_TIMEOUT,
            Duration::from_millis(100),
            || async move {
                // REPLICATE fails until the node has learned of the master through MEET.
                match replica_ref
                    .command(&["CLUSTER", "REPLICATE", master_id])
                    .await
                {
                    Ok(RespValue::Simple(ok)) if ok == "OK" => Probe::Ready(()),
                    other => Probe::NotYet(format!("CLUSTER REPLICATE: {other:?}")),
                }
            },
        )
        .await?;
        wait_until_ready(
            &format!("replica {} to sync with {}", replica.port(), master.port()),
            CLUSTER_TIMEOUT,
            Duration::from_millis(100),
            || async move {
                let info = match replica_ref.command(&["INFO", "replication"]).await {
                    Ok(reply) => reply.as_text().unwrap_or_default(),
                    Err(e) => return Probe::NotYet(e.to_string()),
                };
                if info.contains("master_link_status:up") {
                    Probe::Ready(())
                } else {
                    Probe::NotYet("not synced yet".into())
                }
            },
        )
        .await?;
        Ok(replica)
    }

    /// The node that serves `key` (see [`key_slot`]).
    pub async fn node_for_key(&self, key: &[u8]) -> Result<&RedisServer, HarnessError> {
        self.node_for_slot(key_slot(key)).await
    }
}

/// Options for a [`RedisCluster`]; see [`RedisCluster::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisClusterBuilder {
    node: RedisServerBuilder,
}

impl RedisClusterBuilder {
    /// Runs every node under `clock`, one clock for them all (also replicas started with
    /// [`RedisCluster::start_replica`], and nodes after a restart); it must outlive them.
    pub fn clock(mut self, clock: &ShiftedClock) -> Self {
        self.node = self.node.clock(clock);
        self
    }

    /// Starts the cluster as [`RedisCluster::start`] describes.
    pub async fn start(self) -> Result<RedisCluster, HarnessError> {
        let redis_cli = find_binary("redis-cli", &[])?;
        let mut nodes = Vec::with_capacity(3);
        for _ in 0..3 {
            nodes.push(self.node.clone().start().await?);
        }
        let mut cmd = tokio::process::Command::new(&redis_cli);
        cmd.arg("--cluster").arg("create");
        for node in &nodes {
            cmd.arg(format!("127.0.0.1:{}", node.port()));
        }
        cmd.args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let command_line = format!("redis-cli --cluster create ({:?})", cluster_ports(&nodes));
        let output = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .map_err(|_| HarnessError::Timeout {
                what: command_line.clone(),
                after: Duration::from_secs(60),
            })?
            .map_err(|e| HarnessError::io(format!("running {command_line}"), e))?;
        if !output.status.success() {
            return Err(HarnessError::CommandFailed {
                command: command_line,
                status: output.status.to_string(),
                stderr: format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stderr),
                    String::from_utf8_lossy(&output.stdout)
                ),
            });
        }
        let cluster = RedisCluster {
            nodes,
            node: self.node,
        };
        cluster.wait_healthy(CLUSTER_TIMEOUT).await?;
        Ok(cluster)
    }
}

fn cluster_ports(nodes: &[RedisServer]) -> Vec<u16> {
    nodes.iter().map(RedisServer::port).collect()
}

/// Finds the master port for `slot` in a `CLUSTER SLOTS` reply:
/// `[[start, end, [ip, port, id, ..], replicas..], ..]`.
fn slot_owner_port(reply: &RespValue, slot: u16) -> Option<u16> {
    let RespValue::Array(Some(ranges)) = reply else {
        return None;
    };
    ranges.iter().find_map(|range| {
        let RespValue::Array(Some(items)) = range else {
            return None;
        };
        match items.as_slice() {
            [
                RespValue::Integer(start),
                RespValue::Integer(end),
                RespValue::Array(Some(master)),
                ..,
            ] if (*start..=*end).contains(&i64::from(slot)) => match master.get(1) {
                Some(RespValue::Integer(port)) => u16::try_from(*port).ok(),
                _ => None,
            },
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;

    #[test]
    fn key_slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
    }

    #[tokio::test]
    async fn three_master_cluster_is_ok_and_routes_slots() {
        let cluster = require(RedisCluster::start().await);
        assert_eq!(cluster.nodes().len(), 3);
        assert_eq!(cluster.urls().len(), 3);
        for node in cluster.nodes() {
            let info = require(node.command(&["CLUSTER", "INFO"]).await)
                .as_text()
                .unwrap();
            assert!(info.contains("cluster_state:ok"), "{info}");
            assert!(info.contains("cluster_known_nodes:3"), "{info}");
        }
        let owner = require(cluster.node_for_key(b"foo").await);
        assert_eq!(
            require(owner.command(&["SET", "foo", "1"]).await)
                .as_text()
                .as_deref(),
            Some("OK")
        );
        let other = cluster
            .nodes()
            .iter()
            .find(|n| n.port() != owner.port())
            .unwrap();
        // The slot function agrees with the server's.
        for key in [
            "foo",
            "bar",
            "{user1000}.following",
            "foo{}{bar}",
            "a{b}c{d}",
            "",
        ] {
            let slot = require(owner.command(&["CLUSTER", "KEYSLOT", key]).await);
            assert_eq!(
                slot,
                RespValue::Integer(i64::from(key_slot(key.as_bytes()))),
                "{key}"
            );
        }
        let moved = require(other.command(&["SET", "foo", "1"]).await);
        assert!(
            matches!(&moved, RespValue::Error(e) if e.starts_with(&format!("MOVED {} 127.0.0.1:{}", key_slot(b"foo"), owner.port()))),
            "{moved:?}"
        );

        // A killed node comes back with its slots (nodes.conf in its dir).
        let victim = &cluster.nodes()[0];
        require(victim.kill());
        require(victim.restart().await);
        require(cluster.wait_healthy(Duration::from_secs(30)).await);
        let slot0 = require(cluster.node_for_slot(0).await);
        assert_eq!(slot0.port(), victim.port());
    }
}
