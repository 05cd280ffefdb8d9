//! Three etcd members forming one cluster ([`EtcdCluster`]), and which of them leads.

use std::collections::HashMap;
use std::time::Duration;

use super::member::{Etcd, EtcdServer, unique_token};
use super::options::EtcdAuth;
use crate::error::HarnessError;
use crate::ports::{free_port, start_on_free_ports};
use crate::probe::{Probe, wait_until_ready};

/// Three `etcd` members forming one cluster on 127.0.0.1 (unique `--initial-cluster-token`).
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts 3 members and waits until each reports healthy (a leader is elected).
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(None).await
    }

    /// Starts 3 members with authentication enabled as `auth` says; returns once each is
    /// healthy and clients must authenticate.
    pub async fn start_with_auth(auth: &EtcdAuth) -> Result<Self, HarnessError> {
        Self::start_with(Some(auth)).await
    }

    async fn start_with(auth: Option<&EtcdAuth>) -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once(auth)).await
    }

    async fn start_once(auth: Option<&EtcdAuth>) -> Result<Self, HarnessError> {
        let auth_token_ttl = auth.map(EtcdAuth::token_ttl_seconds).transpose()?;
        let mut plans = Vec::with_capacity(3);
        for i in 0..3 {
            plans.push(Etcd {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                tls: None,
                auth_token_ttl,
                space: None,
            });
        }
        let initial_cluster = plans
            .iter()
            .map(|p| format!("{}={}", p.name, p.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let token = unique_token();
        let mut members = Vec::with_capacity(3);
        for plan in plans {
            members.push(EtcdServer::spawn_member(plan, &initial_cluster, &token)?);
        }
        for member in &members {
            member.wait_ready().await?;
        }
        if let Some(auth) = auth {
            // Users and the auth switch are cluster-wide: set them through one member.
            members[0].enable_auth(auth).await?;
        }
        Ok(EtcdCluster { members })
    }

    /// The members, in start order.
    pub fn members(&self) -> &[EtcdServer] {
        &self.members
    }

    /// The client URLs of all members.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdServer::endpoint).collect()
    }

    /// The index (into [`members`](Self::members)) of the current leader.
    ///
    /// Asks every running, unpaused member for its status and returns the member that a
    /// majority of the cluster names as leader and that itself answers that it leads (so a
    /// killed or paused leader that its followers have not yet given up on is not
    /// returned). Retries for up to 15 s (an election after
    /// the leader died takes one election timeout, about 1–2 s).
    pub async fn leader_index(&self) -> Result<usize, HarnessError> {
        let majority = self.members.len() / 2 + 1;
        wait_until_ready(
            "etcd cluster leader",
            Duration::from_secs(15),
            Duration::from_millis(50),
            || async move {
                let mut votes: HashMap<u64, usize> = HashMap::new();
                let mut self_declared: HashMap<u64, usize> = HashMap::new();
                let mut errors = Vec::new();
                for (index, member) in self.members.iter().enumerate() {
                    if !member.is_running() || member.is_paused() {
                        continue;
                    }
                    match member.status().await {
                        Ok((id, leader)) => {
                            if leader == id {
                                self_declared.insert(id, index);
                            }
                            if leader != 0 {
                                *votes.entry(leader).or_default() += 1;
                            }
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                let elected = votes
                    .iter()
                    .find(|&(_, &n)| n >= majority)
                    .map(|(&leader, _)| leader);
                match elected {
                    Some(leader) => match self_declared.get(&leader) {
                        Some(&index) => Probe::Ready(index),
                        None => Probe::NotYet(format!(
                            "leader {leader:x} named by a majority did not confirm it leads \
                             (dead or paused, election pending)"
                        )),
                    },
                    None => Probe::NotYet(format!(
                        "no leader named by a majority: votes {votes:?}, errors {errors:?}"
                    )),
                }
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;
    use crate::etcd::member::tests::{VALUE, get, put};

    #[tokio::test]
    async fn three_member_cluster_elects_a_new_leader_after_a_kill() {
        let cluster = require(EtcdCluster::start().await);
        assert_eq!(cluster.endpoints().len(), 3);
        let leader = require(cluster.leader_index().await);
        let mut leaders = Vec::new();
        for member in cluster.members() {
            leaders.push(require(member.status().await).1);
        }
        assert!(
            leaders.iter().all(|l| *l == leaders[0] && *l != 0),
            "{leaders:?}"
        );
        assert_eq!(
            require(cluster.members()[leader].status().await).0,
            leaders[0]
        );
        // A write through any member is visible through another.
        require(put(&cluster.members()[(leader + 1) % 3]).await);
        assert_eq!(
            require(get(&cluster.members()[(leader + 2) % 3]).await).as_deref(),
            Some(VALUE)
        );

        require(cluster.members()[leader].kill());
        let new_leader = require(cluster.leader_index().await);
        assert_ne!(new_leader, leader);
        require(cluster.members()[leader].restart().await);
        assert!(require(cluster.members()[leader].health().await));
    }
}
