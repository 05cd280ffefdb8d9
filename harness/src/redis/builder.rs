//! The options of a single `redis-server` ([`RedisServerBuilder`], [`RedisTls`]) and its
//! command line.

use std::ffi::OsString;
use std::net::SocketAddr;

use super::node::{Redis, RedisServer};
use super::user::RedisUser;
use crate::binary::find_binary;
use crate::clock::ShiftedClock;
use crate::error::HarnessError;
use crate::ports::{free_port, free_port_with_bus, start_on_free_ports};
use crate::process::Spec;
use crate::server::Server;
use crate::temp::temp_dir;

/// The PEM files of a TLS port: the server's certificate chain and key, and the CA that
/// clients are told to trust. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct RedisTls {
    /// The server certificate (PEM), valid for `127.0.0.1`.
    pub cert_pem: String,
    /// The server's private key (PEM).
    pub key_pem: String,
    /// The CA certificate (PEM) that signed `cert_pem`.
    pub ca_pem: String,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("cert_pem", &format!("<{} bytes>", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .field("ca_pem", &format!("<{} bytes>", self.ca_pem.len()))
            .finish()
    }
}

/// When the append-only file is fsynced (`appendfsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AppendFsync {
    /// After every write: nothing acknowledged is lost, even on power loss.
    #[default]
    Always,
    /// Once a second, Redis's default: a `kill -9` loses nothing written, a power loss up
    /// to a second of writes.
    EverySec,
}

impl RedisServer {
    /// Starts a single node with default options (no persistence, no password).
    pub async fn start() -> Result<Self, HarnessError> {
        Self::builder().start().await
    }

    /// Options: append-only persistence, password, extra arguments.
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }
}

/// Options for a [`RedisServer`]; see [`RedisServer::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct RedisServerBuilder {
    appendonly: Option<AppendFsync>,
    snapshots: Vec<(u32, u32)>,
    users: Vec<RedisUser>,
    password: Option<String>,
    cluster: bool,
    extra_args: Vec<String>,
    tls: Option<RedisTls>,
    replica_of: Option<SocketAddr>,
    /// The environment of a [`ShiftedClock`]; empty for the real clock.
    clock: Vec<(OsString, OsString)>,
}

impl RedisServerBuilder {
    /// Turns on the append-only file with `appendfsync always`, so acknowledged writes
    /// survive [`RedisServer::kill`] + [`RedisServer::restart`]. Without it the server runs
    /// with `--save ""` and loses everything on restart.
    pub fn appendonly(mut self, on: bool) -> Self {
        self.appendonly = on.then_some(AppendFsync::Always);
        self
    }

    /// Turns on the append-only file with the given `appendfsync` policy.
    pub fn appendfsync(mut self, policy: AppendFsync) -> Self {
        self.appendonly = Some(policy);
        self
    }

    /// RDB snapshots, one `save SECONDS CHANGES` rule each: a background save once
    /// `changes` keys changed within `seconds`. Without rules the server takes no
    /// snapshots, unless the append-only file is on, which keeps Redis's default rules.
    pub fn snapshots(mut self, rules: &[(u32, u32)]) -> Self {
        self.snapshots = rules.to_vec();
        self
    }

    /// Also creates this ACL user, from the command line (`--user`), so it exists again
    /// after [`RedisServer::restart`]. The default user keeps every right (and the
    /// [`password`](Self::password), if any): [`RedisServer::command`] goes through it.
    pub fn user(mut self, user: RedisUser) -> Self {
        self.users.push(user);
        self
    }

    /// Requires this password (`requirepass`); `None` (the default) runs without one, with
    /// protected mode off.
    pub fn password(mut self, password: Option<&str>) -> Self {
        self.password = password.map(str::to_string);
        self
    }

    /// Appends raw command-line arguments, e.g. `["--maxmemory", "10mb"]`.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Also listens for TLS on a second free port ([`RedisServer::tls_port`],
    /// [`RedisServer::tls_url`]) with these PEMs, written to the server's temp dir
    /// (`--tls-port --tls-cert-file --tls-key-file --tls-ca-cert-file`, client certificates
    /// not required). The plain port stays open on 127.0.0.1 so that
    /// [`RedisServer::command`], readiness checks and fault proxies keep working.
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Starts the server as a replica of the master at `master` (`--replicaof`); with a
    /// [`password`](Self::password), it is also used as `masterauth`. [`start`](Self::start)
    /// returns once the replica has synced (`master_link_status:up`).
    pub fn replica_of(mut self, master: SocketAddr) -> Self {
        self.replica_of = Some(master);
        self
    }

    /// Runs the server under `clock` (also after [`RedisServer::restart`]), which must
    /// outlive it: `TIME`, key expiry and every other use of the wall clock read it.
    pub fn clock(mut self, clock: &ShiftedClock) -> Self {
        self.clock = clock.envs();
        self
    }

    /// Starts the server as a Redis Cluster node (`cluster-enabled`, its `nodes.conf` in the
    /// server's directory, a 2 s node timeout) on a port whose cluster bus port (+10000) is
    /// free too. It holds no slot and knows no other node until told (`CLUSTER ADDSLOTS`,
    /// `CLUSTER MEET`); [`RedisCluster`](crate::redis::RedisCluster) does both for a whole
    /// cluster.
    pub fn cluster(mut self, on: bool) -> Self {
        self.cluster = on;
        self
    }

    /// Starts the server and waits until it answers `PING` with `+PONG` (and `INFO`
    /// reports this process's pid).
    pub async fn start(self) -> Result<RedisServer, HarnessError> {
        start_on_free_ports(|| self.clone().start_once()).await
    }

    async fn start_once(self) -> Result<RedisServer, HarnessError> {
        let program = find_binary("redis-server", &[])?;
        let port = if self.cluster {
            free_port_with_bus()?
        } else {
            free_port()?
        };
        let dir = temp_dir("distlock-redis-")?;
        let mut args: Vec<String> = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            dir.path().display().to_string(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            String::new(),
        ];
        match self.appendonly {
            Some(policy) => {
                let policy = match policy {
                    AppendFsync::Always => "always",
                    AppendFsync::EverySec => "everysec",
                };
                args.extend(["--appendonly", "yes", "--appendfsync", policy].map(String::from));
            }
            None => args.extend(["--appendonly", "no"].map(String::from)),
        }
        // The first `save` line replaces Redis's default rules, the next ones add to it.
        if !self.snapshots.is_empty() {
            for (seconds, changes) in &self.snapshots {
                args.extend(["--save".to_string(), format!("{seconds} {changes}")]);
            }
        } else if self.appendonly.is_none() {
            args.extend(["--save".to_string(), String::new()]);
        }
        for user in &self.users {
            args.extend(user.directive());
        }
        match &self.password {
            Some(pw) => args.extend(["--requirepass".to_string(), pw.clone()]),
            None => args.extend(["--protected-mode", "no"].map(String::from)),
        }
        let tls_port = match &self.tls {
            Some(tls) => {
                let tls_port = free_port()?;
                let mut files = Vec::with_capacity(3);
                for (name, pem) in [
                    ("tls.crt", &tls.cert_pem),
                    ("tls.key", &tls.key_pem),
                    ("ca.crt", &tls.ca_pem),
                ] {
                    let path = dir.path().join(name);
                    std::fs::write(&path, pem)
                        .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
                    files.push(path.display().to_string());
                }
                args.extend([
                    "--tls-port".to_string(),
                    tls_port.to_string(),
                    "--tls-cert-file".to_string(),
                    files[0].clone(),
                    "--tls-key-file".to_string(),
                    files[1].clone(),
                    "--tls-ca-cert-file".to_string(),
                    files[2].clone(),
                    "--tls-auth-clients".to_string(),
                    "no".to_string(),
                ]);
                Some(tls_port)
            }
            None => None,
        };
        if let Some(master) = self.replica_of {
            args.extend([
                "--replicaof".to_string(),
                master.ip().to_string(),
                master.port().to_string(),
            ]);
            if let Some(pw) = &self.password {
                args.extend(["--masterauth".to_string(), pw.clone()]);
            }
        }
        if self.cluster {
            args.extend(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
                .map(String::from),
            );
        }
        args.extend(self.extra_args.iter().cloned());
        let spec = Spec {
            what: format!(
                "redis-server{} on 127.0.0.1:{port}",
                if self.cluster { " (cluster node)" } else { "" }
            ),
            program,
            args: args.into_iter().map(Into::into).collect(),
            envs: self.clock,
            cwd: dir.path().to_path_buf(),
            user: None,
            log: dir.path().join("redis.log"),
        };
        let kind = Redis {
            port,
            tls_port,
            password: self.password,
            users: self.users,
            replica: self.replica_of.is_some(),
        };
        let server = Server::spawn(spec, kind, dir)?;
        server.wait_ready().await?;
        Ok(server)
    }
}
