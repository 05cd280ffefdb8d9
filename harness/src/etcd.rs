//! `etcd` for tests: a single member ([`EtcdServer`]) or a 3-member cluster
//! ([`EtcdCluster`]) on free 127.0.0.1 ports, each member with its own temp data dir.
//! Readiness is `GET /health`; the leader is found through the v3 JSON gateway
//! (`POST /v3/maintenance/status`), so no `etcdctl` is needed.
//!
//! [`EtcdServer::start_tls`] starts a single member whose client URL is `https://` with
//! certificates the test supplies ([`EtcdTls`]); its readiness is read from a plain-HTTP
//! metrics URL, since the client port then speaks TLS only.
//!
//! [`EtcdServer::start_with_auth`] and [`EtcdCluster::start_with_auth`] start members with
//! authentication enabled ([`EtcdAuth`]): a `root` user and simple tokens with a short TTL.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::process::{ManagedProcess, Spec};
use super::{
    HarnessError, Probe, START_ATTEMPTS, find_binary, free_port, http_request, is_port_clash,
    loopback, wait_until,
};

/// How long a member may take to report healthy after start or restart.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Time limit for one HTTP request to a member.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The ports and name of one member, known before any member is spawned.
#[derive(Debug, Clone)]
struct MemberPlan {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// TLS on the client URL, with the plain-HTTP metrics port that serves `/health`.
    tls: Option<(EtcdTls, u16)>,
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
    /// Starts a single-member cluster and waits until `/health` reports `"health":"true"`.
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
    /// with `tls`'s certificate (clients are not asked for one). Readiness and
    /// [`health`](Self::health) use a plain-HTTP metrics URL; [`status`](Self::status)
    /// needs a plain client URL and fails on this server.
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
        let tls = match tls {
            Some(tls) => Some((tls, free_port()?)),
            None => None,
        };
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
        if let Some((tls, metrics_port)) = &plan.tls {
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
                format!("--listen-metrics-urls=http://127.0.0.1:{metrics_port}"),
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
    /// still runs) and waits until `/health` is true. In a cluster, health needs a leader,
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

    /// `GET /health` once: `Ok(true)` when the member reports `"health":"true"`. A TLS
    /// member is asked on its plain-HTTP metrics URL.
    pub async fn health(&self) -> Result<bool, HarnessError> {
        let addr = match &self.plan.tls {
            Some((_, metrics_port)) => loopback(*metrics_port),
            None => self.addr(),
        };
        let (_, body) = http_request(addr, "GET", "/health", None, REQUEST_TIMEOUT).await?;
        Ok(body.contains("\"health\":\"true\""))
    }

    /// `(member_id, leader_id)` from `POST /v3/maintenance/status`.
    pub async fn status(&self) -> Result<(u64, u64), HarnessError> {
        let (code, body) = http_request(
            self.addr(),
            "POST",
            "/v3/maintenance/status",
            Some("{}"),
            REQUEST_TIMEOUT,
        )
        .await?;
        let what = format!("status of {}", self.process.what());
        let protocol = |detail: String| HarnessError::Protocol {
            what: what.clone(),
            detail,
        };
        if code != 200 {
            return Err(protocol(format!("HTTP {code}: {body}")));
        }
        let json: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| protocol(format!("{e}: {body}")))?;
        // The gateway encodes uint64 as JSON strings.
        let id = |v: &serde_json::Value| -> Option<u64> {
            match v {
                serde_json::Value::String(s) => s.parse().ok(),
                serde_json::Value::Number(n) => n.as_u64(),
                _ => None,
            }
        };
        let member = id(&json["header"]["member_id"])
            .ok_or_else(|| protocol(format!("no header.member_id in {body}")))?;
        let leader = id(&json["leader"]).unwrap_or(0);
        Ok((member, leader))
    }

    /// Adds [`EtcdAuth::USER`] with the `root` role and enables authentication, through the
    /// JSON gateway (health, status and the member list stay readable without a token).
    async fn enable_auth(&self, auth: &EtcdAuth) -> Result<(), HarnessError> {
        let user = serde_json::json!({ "name": EtcdAuth::USER, "password": auth.password });
        let grant = serde_json::json!({ "user": EtcdAuth::USER, "role": "root" });
        for (path, body) in [
            ("/v3/auth/user/add", user.to_string()),
            ("/v3/auth/user/grant", grant.to_string()),
            ("/v3/auth/enable", "{}".to_owned()),
        ] {
            let (code, reply) =
                http_request(self.addr(), "POST", path, Some(&body), REQUEST_TIMEOUT).await?;
            if code != 200 || reply.contains("\"error\"") {
                return Err(HarnessError::Protocol {
                    what: format!("{path} on {}", self.process.what()),
                    detail: format!("HTTP {code}: {reply}"),
                });
            }
        }
        Ok(())
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
                match self.health().await {
                    Ok(true) => {}
                    Ok(false) => {
                        return Probe::NotYet("/health is not true (no leader yet?)".into());
                    }
                    Err(e) => return Probe::NotYet(e.to_string()),
                }
                if self.plan.tls.is_some() {
                    // The client port speaks TLS only; the healthy metrics port was bound
                    // by this process (a clash would have made it exit, seen above).
                    return Probe::Ready(());
                }
                // Make sure the etcd on the port is ours (its cluster has our peer URL), not
                // another process's that took the port first.
                let members = http_request(
                    self.addr(),
                    "POST",
                    "/v3/cluster/member/list",
                    Some("{}"),
                    REQUEST_TIMEOUT,
                )
                .await;
                let peer_url = format!("\"{}\"", self.plan.peer_url());
                match members {
                    Ok((200, body)) if body.contains(&peer_url) => Probe::Ready(()),
                    Ok((code, body)) => Probe::NotYet(format!(
                        "member list (HTTP {code}) lacks our peer URL {peer_url}: {body}"
                    )),
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

    // base64("distlock-key") and base64("v1"): the JSON gateway takes bytes as base64.
    const KEY_B64: &str = "ZGlzdGxvY2sta2V5";
    const VALUE_B64: &str = "djE=";

    async fn put(server: &EtcdServer) -> Result<(u16, String), HarnessError> {
        let body = format!(r#"{{"key":"{KEY_B64}","value":"{VALUE_B64}"}}"#);
        http_request(
            server.addr(),
            "POST",
            "/v3/kv/put",
            Some(&body),
            REQUEST_TIMEOUT,
        )
        .await
    }

    async fn get(server: &EtcdServer) -> Result<String, HarnessError> {
        let body = format!(r#"{{"key":"{KEY_B64}"}}"#);
        http_request(
            server.addr(),
            "POST",
            "/v3/kv/range",
            Some(&body),
            REQUEST_TIMEOUT,
        )
        .await
        .map(|(_, body)| body)
    }

    #[tokio::test]
    async fn single_member_health_pause_and_restart_keeps_data() {
        let etcd = require(EtcdServer::start().await);
        assert_eq!(
            etcd.endpoint(),
            format!("http://127.0.0.1:{}", etcd.client_port())
        );
        assert!(require(etcd.health().await));
        let (code, _) = require(put(&etcd).await);
        assert_eq!(code, 200);
        assert!(require(get(&etcd).await).contains(VALUE_B64));
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
        assert!(
            require(get(&etcd).await).contains(VALUE_B64),
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
        let (code, _) = require(put(&cluster.members()[(leader + 1) % 3]).await);
        assert_eq!(code, 200);
        assert!(require(get(&cluster.members()[(leader + 2) % 3]).await).contains(VALUE_B64));

        require(cluster.members()[leader].kill());
        let new_leader = require(cluster.leader_index().await);
        assert_ne!(new_leader, leader);
        require(cluster.members()[leader].restart().await);
        assert!(require(cluster.members()[leader].health().await));
    }
}
