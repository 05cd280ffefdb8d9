//! One etcd member ([`EtcdServer`]): its command line, its URLs and ports, requests to it
//! alone with `etcd-client`, and the probe that tells it serves (and is the member the
//! harness started).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, TlsOptions};

use super::options::{EtcdAuth, EtcdSpace, EtcdTls};
use crate::binary::find_binary;
use crate::error::HarnessError;
use crate::ports::{free_port, start_on_free_ports};
use crate::process::Spec;
use crate::server::{Server, ServerKind};
use crate::temp::temp_dir;

/// Time limit for one request to a member, connecting included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Time limit for setting up authentication (three requests that each write to raft).
const AUTH_SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What an etcd member adds to [`Server`]: its name, ports and options, known before any
/// member of a cluster is spawned.
#[derive(Debug, Clone)]
pub struct Etcd {
    pub(super) name: String,
    pub(super) client_port: u16,
    pub(super) peer_port: u16,
    /// TLS on the client URL.
    pub(super) tls: Option<EtcdTls>,
    /// `--auth-token-ttl` in seconds, for a member that will run with authentication.
    pub(super) auth_token_ttl: Option<u64>,
    /// A space quota and automatic compaction.
    pub(super) space: Option<EtcdSpace>,
}

impl Etcd {
    pub(super) fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }
}

/// An `etcd` member process on 127.0.0.1 with its own data dir; killed and removed on drop.
///
/// [`restart`](Server::restart) starts it with the same ports and data dir and returns once
/// it is [healthy](Self::health). In a cluster, health needs a leader, so a restart returns
/// only once the member is back in a cluster that has a quorum.
pub type EtcdServer = Server<Etcd>;

impl ServerKind for Etcd {
    const READY_TIMEOUT: Duration = Duration::from_secs(30);
    const PROBE_INTERVAL: Duration = Duration::from_millis(50);

    fn client_port(&self) -> u16 {
        self.client_port
    }

    async fn probe(server: &EtcdServer) -> Result<(), String> {
        // Until the port is bound a request would wait out its whole time limit.
        if let Err(e) = tokio::net::TcpStream::connect(server.addr()).await {
            return Err(format!("TCP connect: {e}"));
        }
        match server.health().await {
            Ok(true) => {}
            Ok(false) => return Err("no leader yet, or an alarm".into()),
            Err(e) => return Err(e.to_string()),
        }
        // Make sure the etcd on the port is ours (its cluster has our peer URL), not
        // another process's that took the port first.
        let peer_url = server.kind().peer_url();
        let list = server
            .request("member list", REQUEST_TIMEOUT, |mut client| async move {
                client.member_list().await
            })
            .await
            .map_err(|e| e.to_string())?;
        let ours = list
            .members()
            .iter()
            .any(|m| m.peer_urls().contains(&peer_url));
        if ours {
            Ok(())
        } else {
            Err(format!("the member list lacks our peer URL {peer_url}"))
        }
    }
}

fn data_dir(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    dir.join(format!("{name}.etcd"))
}

impl EtcdServer {
    /// Starts a single-member cluster and waits until it is [healthy](Self::health).
    pub async fn start() -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once_with(None, None, None)).await
    }

    /// Starts a single-member cluster with `space`'s quota and automatic compaction.
    pub async fn start_with_space(space: EtcdSpace) -> Result<Self, HarnessError> {
        space.args()?;
        start_on_free_ports(|| Self::start_once_with(None, None, Some(space))).await
    }

    /// Starts a single-member cluster whose client URL is `https://127.0.0.1:PORT`, served
    /// with `tls`'s certificate (clients are not asked for one). The harness's own requests
    /// go over TLS too, trusting [`EtcdTls::ca_pem`].
    pub async fn start_tls(tls: EtcdTls) -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once_with(Some(tls.clone()), None, None)).await
    }

    /// Starts a single-member cluster with authentication enabled as `auth` says; returns
    /// once it is healthy and clients must authenticate.
    pub async fn start_with_auth(auth: &EtcdAuth) -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once_with(None, Some(auth), None)).await
    }

    async fn start_once_with(
        tls: Option<EtcdTls>,
        auth: Option<&EtcdAuth>,
        space: Option<EtcdSpace>,
    ) -> Result<Self, HarnessError> {
        let plan = Etcd {
            name: "single".into(),
            client_port: free_port()?,
            peer_port: free_port()?,
            tls,
            auth_token_ttl: auth.map(EtcdAuth::token_ttl_seconds).transpose()?,
            space,
        };
        let initial_cluster = format!("{}={}", plan.name, plan.peer_url());
        let server = Self::spawn_member(plan, &initial_cluster, &unique_token())?;
        server.wait_ready().await?;
        if let Some(auth) = auth {
            server.enable_auth(auth).await?;
        }
        Ok(server)
    }

    /// Spawns the member `plan` of the cluster `initial_cluster` (`--initial-cluster`)
    /// with the cluster's `token`; it does not wait until it serves.
    pub(super) fn spawn_member(
        plan: Etcd,
        initial_cluster: &str,
        token: &str,
    ) -> Result<Self, HarnessError> {
        let program = find_binary("etcd", &[])?;
        let dir = temp_dir("distlock-etcd-")?;
        let client_url = plan.client_url();
        let peer_url = plan.peer_url();
        let data_dir = data_dir(dir.path(), &plan.name);
        let mut args: Vec<String> = vec![
            format!("--name={}", plan.name),
            format!("--data-dir={}", data_dir.display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster={initial_cluster}"),
            "--initial-cluster-state=new".into(),
            format!("--initial-cluster-token={token}"),
            "--logger=zap".into(),
            "--log-outputs=stderr".into(),
        ];
        if let Some(tls) = &plan.tls {
            let mut files = Vec::with_capacity(3);
            // No `--trusted-ca-file`: with it etcd requires a client certificate.
            for (name, pem) in [("server.crt", &tls.cert_pem), ("server.key", &tls.key_pem)] {
                let path = dir.path().join(name);
                std::fs::write(&path, pem)
                    .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
                files.push(path.display().to_string());
            }
            args.extend([
                format!("--cert-file={}", files[0]),
                format!("--key-file={}", files[1]),
            ]);
        }
        if let Some(ttl) = plan.auth_token_ttl {
            args.extend([
                "--auth-token=simple".to_owned(),
                format!("--auth-token-ttl={ttl}"),
            ]);
        }
        if let Some(space) = &plan.space {
            args.extend(space.args()?);
        }
        let mut envs = Vec::new();
        // etcd refuses to start on architectures other than amd64/ppc64le/s390x unless told.
        let unsupported = match std::env::consts::ARCH {
            "x86_64" | "powerpc64" | "s390x" => None,
            "aarch64" => Some("arm64"),
            other => Some(other),
        };
        if let Some(arch) = unsupported {
            envs.push(("ETCD_UNSUPPORTED_ARCH".into(), arch.into()));
        }
        let spec = Spec {
            what: format!(
                "etcd member {} on 127.0.0.1:{}",
                plan.name, plan.client_port
            ),
            program,
            args: args.into_iter().map(Into::into).collect(),
            envs,
            cwd: dir.path().to_path_buf(),
            user: None,
            log: dir.path().join("etcd.log"),
        };
        Server::spawn(spec, plan, dir)
    }

    /// `http://127.0.0.1:PORT`, the client URL (`https://` for a TLS member).
    pub fn endpoint(&self) -> String {
        self.kind().client_url()
    }

    /// True when the client URL is `https://` ([`start_tls`](Self::start_tls)).
    pub fn is_tls(&self) -> bool {
        self.kind().tls.is_some()
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.kind().client_port
    }

    /// The peer (raft) port.
    pub fn peer_port(&self) -> u16 {
        self.kind().peer_port
    }

    /// The member name (`--name`).
    pub fn name(&self) -> &str {
        &self.kind().name
    }

    /// The member's data dir (`--data-dir`).
    pub(super) fn data_dir(&self) -> std::path::PathBuf {
        data_dir(self.dir(), self.name())
    }

    /// Runs `request` with an `etcd-client` connected to this member alone (over TLS,
    /// trusting the test CA, for a TLS member), cut off after `timeout`.
    pub(super) async fn request<T, F, Fut>(
        &self,
        what: &str,
        timeout: Duration,
        request: F,
    ) -> Result<T, HarnessError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let what = format!("{what} on {}", self.what());
        // The client's own limits stay off: `timeout` covers connecting and the reply.
        let mut options = ConnectOptions::new();
        if let Some(tls) = &self.kind().tls {
            options = options.with_tls(
                TlsOptions::new().ca_certificate(Certificate::from_pem(tls.ca_pem.as_bytes())),
            );
        }
        let fut = async {
            let client = Client::connect([self.endpoint()], Some(options))
                .await
                .map_err(|e| HarnessError::client(format!("connecting for {what}"), e))?;
            request(client)
                .await
                .map_err(|e| HarnessError::client(what.clone(), e))
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(HarnessError::Timeout {
                what,
                after: timeout,
            }),
        }
    }

    /// Asks the member's status once: `Ok(true)` when it knows a leader and reports no
    /// alarm (what etcd's `/health` checks).
    pub async fn health(&self) -> Result<bool, HarnessError> {
        let status = self
            .request("status", REQUEST_TIMEOUT, |mut client| async move {
                client.status().await
            })
            .await?;
        Ok(status.leader() != 0 && status.errors().is_empty())
    }

    /// `(member_id, leader_id)` from the member's status; the leader is 0 while it knows
    /// none.
    pub async fn status(&self) -> Result<(u64, u64), HarnessError> {
        let status = self
            .request("status", REQUEST_TIMEOUT, |mut client| async move {
                client.status().await
            })
            .await?;
        let member = status
            .header()
            .map(|header| header.member_id())
            .ok_or_else(|| HarnessError::Protocol {
                what: format!("status of {}", self.what()),
                detail: "no response header".into(),
            })?;
        Ok((member, status.leader()))
    }

    /// Adds [`EtcdAuth::USER`] with the `root` role and enables authentication (status and
    /// the member list stay readable without a token).
    pub(super) async fn enable_auth(&self, auth: &EtcdAuth) -> Result<(), HarnessError> {
        let password = auth.password.clone();
        self.request(
            "enabling authentication",
            AUTH_SETUP_TIMEOUT,
            |mut client| async move {
                client.user_add(EtcdAuth::USER, password, None).await?;
                client.user_grant_role(EtcdAuth::USER, "root").await?;
                client.auth_enable().await?;
                Ok(())
            },
        )
        .await
    }
}

/// A cluster token (`--initial-cluster-token`) no other cluster on the machine has.
pub(super) fn unique_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "distlock-test-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::error::require;

    const KEY: &str = "distlock-key";
    pub(in crate::etcd) const VALUE: &str = "v1";

    pub(in crate::etcd) async fn put(server: &EtcdServer) -> Result<(), HarnessError> {
        server
            .request("put", REQUEST_TIMEOUT, |mut client| async move {
                client.put(KEY, VALUE, None).await.map(drop)
            })
            .await
    }

    pub(in crate::etcd) async fn get(server: &EtcdServer) -> Result<Option<String>, HarnessError> {
        let reply = server
            .request("get", REQUEST_TIMEOUT, |mut client| async move {
                client.get(KEY, None).await
            })
            .await?;
        Ok(reply
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    #[tokio::test]
    async fn single_member_health_pause_and_restart_keeps_data() {
        let etcd = require(EtcdServer::start().await);
        assert_eq!(
            etcd.endpoint(),
            format!("http://127.0.0.1:{}", etcd.client_port())
        );
        assert!(require(etcd.health().await));
        require(put(&etcd).await);
        assert_eq!(require(get(&etcd).await).as_deref(), Some(VALUE));
        let (id, leader) = require(etcd.status().await);
        assert_eq!(id, leader, "a single member leads itself");

        require(etcd.pause());
        let paused = etcd.health().await;
        assert!(
            matches!(paused, Err(HarnessError::Timeout { .. })),
            "a paused member must not answer: {paused:?}"
        );
        require(etcd.resume());
        assert!(require(etcd.health().await));

        let pid = etcd.pid();
        require(etcd.kill());
        assert!(!etcd.is_running());
        assert!(etcd.health().await.is_err());
        require(etcd.restart().await);
        assert!(etcd.pid().is_some() && etcd.pid() != pid);
        assert_eq!(
            require(get(&etcd).await).as_deref(),
            Some(VALUE),
            "the data dir is kept across a restart"
        );
    }
}
