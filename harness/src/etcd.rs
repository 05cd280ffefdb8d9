//! `etcd` for tests: a single member ([`EtcdServer`]) or a 3-member cluster
//! ([`EtcdCluster`]) on free 127.0.0.1 ports, each member with its own temp data dir.
//! The harness asks a member with `etcd-client`, connected to that member alone: health and
//! the leader come from the maintenance `Status` call, readiness also checks the member
//! list, so no `etcdctl` is needed.
//!
//! [`EtcdServer::start_tls`] starts a single member whose client URL is `https://` with
//! certificates the test supplies ([`EtcdTls`]); the harness reaches it over TLS, trusting
//! the test's CA.
//!
//! [`EtcdServer::start_with_auth`] and [`EtcdCluster::start_with_auth`] start members with
//! authentication enabled ([`EtcdAuth`]): a `root` user and simple tokens with a short TTL.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, TlsOptions};

use super::process::{ManagedProcess, Spec};
use super::{
    HarnessError, Probe, START_ATTEMPTS, find_binary, free_port, is_port_clash, loopback,
    wait_until,
};

/// How long a member may take to report healthy after start or restart.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Time limit for one request to a member, connecting included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Time limit for setting up authentication (three requests that each write to raft).
const AUTH_SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// The ports and name of one member, known before any member is spawned.
#[derive(Debug, Clone)]
struct MemberPlan {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// TLS on the client URL.
    tls: Option<EtcdTls>,
    /// `--auth-token-ttl` in seconds, for a member that will run with authentication.
    auth_token_ttl: Option<u64>,
}

impl MemberPlan {
    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }
}

/// The PEM files of a TLS client URL: the server's certificate and key, and the CA that
/// signed it, for clients to trust. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct EtcdTls {
    /// The server certificate (PEM), valid for `127.0.0.1`.
    pub cert_pem: String,
    /// The server's private key (PEM).
    pub key_pem: String,
    /// The CA certificate (PEM) that signed `cert_pem`.
    pub ca_pem: String,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("cert_pem", &format!("<{} bytes>", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .field("ca_pem", &format!("<{} bytes>", self.ca_pem.len()))
            .finish()
    }
}

/// Authentication for a test etcd: the user [`EtcdAuth::USER`] (with etcd's `root` role)
/// and its password, and simple tokens (`--auth-token=simple`) that a member forgets once
/// they have not been used there for `token_ttl` (`--auth-token-ttl`). Its `Debug` never
/// shows the password.
#[derive(Clone)]
pub struct EtcdAuth {
    /// The password of [`EtcdAuth::USER`].
    pub password: String,
    /// How long a token stays valid on a member without being used there (whole seconds,
    /// at least 1 s).
    pub token_ttl: Duration,
}

impl EtcdAuth {
    /// The user that is created: etcd's superuser, which may do everything.
    pub const USER: &'static str = "root";

    /// `root` with `password`, tokens expiring after `token_ttl` unused.
    pub fn new(password: impl Into<String>, token_ttl: Duration) -> Self {
        Self {
            password: password.into(),
            token_ttl,
        }
    }

    fn token_ttl_seconds(&self) -> Result<u64, HarnessError> {
        if self.token_ttl.subsec_nanos() != 0 || self.token_ttl.is_zero() {
            return Err(HarnessError::Setup(format!(
                "the etcd token TTL {:?} must be a positive whole number of seconds",
                self.token_ttl
            )));
        }
        Ok(self.token_ttl.as_secs())
    }
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &Self::USER)
            .field("password", &"<redacted>")
            .field("token_ttl", &self.token_ttl)
            .finish()
    }
}

/// An `etcd` member process on 127.0.0.1 with its own data dir; killed and removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    // Field order matters: the process is killed before the directory is removed.
    process: ManagedProcess,
    plan: MemberPlan,
    dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts a single-member cluster and waits until it is [healthy](Self::health).
    pub async fn start() -> Result<Self, HarnessError> {
        let mut attempt = 1;
        loop {
            match Self::start_once().await {
                Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
                result => return result,
            }
        }
    }

    /// Starts a single-member cluster whose client URL is `https://127.0.0.1:PORT`, served
    /// with `tls`'s certificate (clients are not asked for one). The harness's own requests
    /// go over TLS too, trusting [`EtcdTls::ca_pem`].
    pub async fn start_tls(tls: EtcdTls) -> Result<Self, HarnessError> {
        let mut attempt = 1;
        loop {
            match Self::start_once_with(Some(tls.clone()), None).await {
                Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
                result => return result,
            }
        }
    }

    /// Starts a single-member cluster with authentication enabled as `auth` says; returns
    /// once it is healthy and clients must authenticate.
    pub async fn start_with_auth(auth: &EtcdAuth) -> Result<Self, HarnessError> {
        let mut attempt = 1;
        loop {
            match Self::start_once_with(None, Some(auth)).await {
                Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
                result => return result,
            }
        }
    }

    async fn start_once() -> Result<Self, HarnessError> {
        Self::start_once_with(None, None).await
    }

    async fn start_once_with(
        tls: Option<EtcdTls>,
        auth: Option<&EtcdAuth>,
    ) -> Result<Self, HarnessError> {
        let plan = MemberPlan {
            name: "single".into(),
            client_port: free_port()?,
            peer_port: free_port()?,
            tls,
            auth_token_ttl: auth.map(EtcdAuth::token_ttl_seconds).transpose()?,
        };
        let initial_cluster = format!("{}={}", plan.name, plan.peer_url());
        let server = Self::spawn(plan, &initial_cluster, &unique_token())?;
        server.wait_ready().await?;
        if let Some(auth) = auth {
            server.enable_auth(auth).await?;
        }
        Ok(server)
    }

    fn spawn(plan: MemberPlan, initial_cluster: &str, token: &str) -> Result<Self, HarnessError> {
        let program = find_binary("etcd", &[])?;
        let dir = super::temp_dir("distlock-etcd-")?;
        let client_url = plan.client_url();
        let peer_url = plan.peer_url();
        let data_dir = dir.path().join(format!("{}.etcd", plan.name));
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
        let process = ManagedProcess::spawn(spec)?;
        Ok(EtcdServer { process, plan, dir })
    }

    /// `http://127.0.0.1:PORT`, the client URL (`https://` for a TLS member).
    pub fn endpoint(&self) -> String {
        self.plan.client_url()
    }

    /// True when the client URL is `https://` ([`start_tls`](Self::start_tls)).
    pub fn is_tls(&self) -> bool {
        self.plan.tls.is_some()
    }

    /// The client address, for example as the upstream of a [`super::proxy::FaultProxy`].
    pub fn addr(&self) -> SocketAddr {
        loopback(self.plan.client_port)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.plan.client_port
    }

    /// The peer (raft) port.
    pub fn peer_port(&self) -> u16 {
        self.plan.peer_port
    }

    /// The member name (`--name`).
    pub fn name(&self) -> &str {
        &self.plan.name
    }

    /// The pid of the running member, `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The member's temp directory (data dir and `etcd.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Freezes the member with `SIGSTOP`; returns once every thread is stopped (a few
    /// milliseconds; blocks the caller).
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.process.pause()
    }

    /// Continues a paused member with `SIGCONT`.
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.process.resume()
    }

    /// Kills the member with `SIGKILL` and waits for it to exit.
    pub fn kill(&self) -> Result<(), HarnessError> {
        self.process.kill()
    }

    /// Starts the member again with the same ports and data dir (killing it first if it
    /// still runs) and waits until it is [healthy](Self::health). In a cluster, health needs a leader,
    /// so this returns only once the member is back in a cluster that has a quorum.
    pub async fn restart(&self) -> Result<(), HarnessError> {
        self.process.respawn().await?;
        self.wait_ready().await
    }

    /// True while the process runs (also while paused).
    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// True while the member is paused.
    pub fn is_paused(&self) -> bool {
        self.process.is_paused()
    }

    /// The last lines of the member log.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// Runs `request` with an `etcd-client` connected to this member alone (over TLS,
    /// trusting the test CA, for a TLS member), cut off after `timeout`.
    async fn request<T, F, Fut>(
        &self,
        what: &str,
        timeout: Duration,
        request: F,
    ) -> Result<T, HarnessError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let what = format!("{what} on {}", self.process.what());
        // The client's own limits stay off: `timeout` covers connecting and the reply.
        let mut options = ConnectOptions::new();
        if let Some(tls) = &self.plan.tls {
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
                what: format!("status of {}", self.process.what()),
                detail: "no response header".into(),
            })?;
        Ok((member, status.leader()))
    }

    /// Adds [`EtcdAuth::USER`] with the `root` role and enables authentication (status and
    /// the member list stay readable without a token).
    async fn enable_auth(&self, auth: &EtcdAuth) -> Result<(), HarnessError> {
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

    async fn wait_ready(&self) -> Result<(), HarnessError> {
        wait_until(
            self.process.what(),
            READY_TIMEOUT,
            Duration::from_millis(50),
            || async move {
                if let Some(fatal) = self.process.check_alive() {
                    return fatal;
                }
                // Until the port is bound a request would wait out its whole time limit.
                if let Err(e) = tokio::net::TcpStream::connect(self.addr()).await {
                    return Probe::NotYet(format!("TCP connect: {e}"));
                }
                match self.health().await {
                    Ok(true) => {}
                    Ok(false) => return Probe::NotYet("no leader yet, or an alarm".into()),
                    Err(e) => return Probe::NotYet(e.to_string()),
                }
                // Make sure the etcd on the port is ours (its cluster has our peer URL), not
                // another process's that took the port first.
                let peer_url = self.plan.peer_url();
                let members = self
                    .request("member list", REQUEST_TIMEOUT, |mut client| async move {
                        client.member_list().await
                    })
                    .await;
                match members {
                    Ok(list) => {
                        let ours = list
                            .members()
                            .iter()
                            .any(|m| m.peer_urls().contains(&peer_url));
                        if ours {
                            Probe::Ready(())
                        } else {
                            Probe::NotYet(format!("the member list lacks our peer URL {peer_url}"))
                        }
                    }
                    Err(e) => Probe::NotYet(e.to_string()),
                }
            },
        )
        .await
    }
}

fn unique_token() -> String {
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
        let mut attempt = 1;
        loop {
            match Self::start_once(auth).await {
                Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
                result => return result,
            }
        }
    }

    async fn start_once(auth: Option<&EtcdAuth>) -> Result<Self, HarnessError> {
        let auth_token_ttl = auth.map(EtcdAuth::token_ttl_seconds).transpose()?;
        let mut plans = Vec::with_capacity(3);
        for i in 0..3 {
            plans.push(MemberPlan {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                tls: None,
                auth_token_ttl,
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
            members.push(EtcdServer::spawn(plan, &initial_cluster, &token)?);
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
        wait_until(
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
    use crate::require;

    const KEY: &str = "distlock-key";
    const VALUE: &str = "v1";

    async fn put(server: &EtcdServer) -> Result<(), HarnessError> {
        server
            .request("put", REQUEST_TIMEOUT, |mut client| async move {
                client.put(KEY, VALUE, None).await.map(drop)
            })
            .await
    }

    async fn get(server: &EtcdServer) -> Result<Option<String>, HarnessError> {
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
