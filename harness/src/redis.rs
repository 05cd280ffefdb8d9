//! `redis-server` for tests: a single node ([`RedisServer`]), optionally with a TLS port
//! ([`RedisServerBuilder::tls`]) or as a replica of another ([`RedisServerBuilder::replica_of`]),
//! or a 3-master Redis Cluster ([`RedisCluster`]), each node on a free 127.0.0.1 port with
//! its own temp dir. Commands go through the `redis` crate ([`resp_command`]), one fresh
//! RESP2 connection per command, so a test sees exactly what a client sees.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use redis::IntoConnectionInfo;

use super::process::{ManagedProcess, Spec};
use super::{
    HarnessError, Probe, START_ATTEMPTS, find_binary, free_port, free_port_with_bus, is_port_clash,
    loopback, wait_until,
};

/// How long a single node may take to answer `PING` after start or restart.
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a 3-node cluster may take to report `cluster_state:ok`.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time limit for one command sent by [`RedisServer::command`].
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// One RESP2 reply, as the `redis` crate reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`-style status reply.
    Simple(String),
    /// `-ERR ...` error reply (the text after the `-`).
    Error(String),
    /// `:42` integer reply.
    Integer(i64),
    /// `$n` bulk string; `None` is the nil bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*n` array. Always `Some`: the `redis` crate reads the nil array (`*-1`) as nil,
    /// which is `Bulk(None)` here.
    Array(Option<Vec<RespValue>>),
}

impl RespValue {
    /// The reply as text, for simple strings, errors, integers and bulk strings.
    pub fn as_text(&self) -> Option<String> {
        match self {
            RespValue::Simple(s) | RespValue::Error(s) => Some(s.clone()),
            RespValue::Integer(i) => Some(i.to_string()),
            RespValue::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            RespValue::Bulk(None) | RespValue::Array(_) => None,
        }
    }

    /// True for an error reply.
    pub fn is_error(&self) -> bool {
        matches!(self, RespValue::Error(_))
    }
}

impl TryFrom<redis::Value> for RespValue {
    type Error = String;

    /// Converts a reply read on a RESP2 connection; the RESP3-only kinds (maps, sets,
    /// doubles, ...) never arrive there and are refused.
    fn try_from(value: redis::Value) -> Result<Self, String> {
        use redis::Value;
        Ok(match value {
            Value::Nil => RespValue::Bulk(None),
            Value::Int(i) => RespValue::Integer(i),
            Value::BulkString(bytes) => RespValue::Bulk(Some(bytes)),
            Value::Array(items) => RespValue::Array(Some(
                items
                    .into_iter()
                    .map(RespValue::try_from)
                    .collect::<Result<_, _>>()?,
            )),
            Value::SimpleString(s) => RespValue::Simple(s),
            Value::Okay => RespValue::Simple("OK".into()),
            Value::ServerError(e) => RespValue::Error(error_text(&e)),
            other => return Err(format!("a reply RESP2 does not have: {other:?}")),
        })
    }
}

/// The text of an error reply as the server sent it, e.g. `MOVED 12182 127.0.0.1:7001`.
fn error_text(e: &redis::ServerError) -> String {
    match e.details() {
        Some(details) => format!("{} {details}", e.code()),
        None => e.code().to_owned(),
    }
}

/// Sends one command over a fresh connection (after `AUTH password` when given) and
/// returns the reply. An error reply is returned as `Ok(RespValue::Error(..))`, except a
/// failed `AUTH`, which is a [`HarnessError::Protocol`]; a server that cannot be reached
/// is a [`HarnessError::Client`], one that does not answer within `timeout` a
/// [`HarnessError::Timeout`].
pub async fn resp_command<A: AsRef<[u8]>>(
    addr: SocketAddr,
    password: Option<&str>,
    args: &[A],
    timeout: Duration,
) -> Result<RespValue, HarnessError> {
    let name = args
        .first()
        .map(|a| String::from_utf8_lossy(a.as_ref()).into_owned())
        .unwrap_or_default();
    let what = format!("redis {name} on {addr}");
    let mut cmd = redis::Cmd::new();
    for arg in args {
        cmd.arg(arg.as_ref());
    }
    let fut = async {
        let conn = connect(addr, password).await;
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) if e.kind() == redis::ErrorKind::AuthenticationFailed => {
                return Err(HarnessError::Protocol {
                    what: what.clone(),
                    detail: format!("AUTH failed: {e}"),
                });
            }
            Err(e) => return Err(HarnessError::client(format!("connecting for {what}"), e)),
        };
        match cmd.query_async::<redis::Value>(&mut conn).await {
            Ok(value) => RespValue::try_from(value).map_err(|detail| HarnessError::Protocol {
                what: what.clone(),
                detail,
            }),
            Err(e) => match redis::ServerError::try_from(e) {
                Ok(server) => Ok(RespValue::Error(error_text(&server))),
                Err(e) => Err(HarnessError::client(what.clone(), e)),
            },
        }
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(HarnessError::Timeout {
            what,
            after: timeout,
        }),
    }
}

/// A RESP2 connection to `addr` that sends nothing before the caller's command but `AUTH`
/// (no `CLIENT SETINFO`), so command statistics count only what a test sent. The caller's
/// time limit covers connecting and the reply, so the client's own limits are off.
async fn connect(
    addr: SocketAddr,
    password: Option<&str>,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let mut settings = redis::RedisConnectionInfo::default().set_skip_set_lib_name();
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    let info = redis::ConnectionAddr::Tcp(addr.ip().to_string(), addr.port())
        .into_connection_info()?
        .set_redis_settings(settings);
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(None)
        .set_response_timeout(None);
    redis::Client::open(info)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// `scheme://127.0.0.1:PORT/`, with the password percent-encoded as user info when given.
fn server_url(scheme: &str, port: u16, password: Option<&str>) -> String {
    let plain = format!("{scheme}://127.0.0.1:{port}/");
    let Some(password) = password else {
        return plain;
    };
    let Ok(mut url) = url::Url::parse(&plain) else {
        return plain;
    };
    // Cannot fail: the URL has a host, so it takes a password.
    match url.set_password(Some(password)) {
        Ok(()) => url.into(),
        Err(()) => plain,
    }
}

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

/// Options for a [`RedisServer`]; see [`RedisServer::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct RedisServerBuilder {
    appendonly: bool,
    password: Option<String>,
    cluster: bool,
    extra_args: Vec<String>,
    tls: Option<RedisTls>,
    replica_of: Option<SocketAddr>,
}

impl RedisServerBuilder {
    /// Turns on the append-only file with `appendfsync always`, so acknowledged writes
    /// survive [`RedisServer::kill`] + [`RedisServer::restart`]. Without it the server runs
    /// with `--save ""` and loses everything on restart.
    pub fn appendonly(mut self, on: bool) -> Self {
        self.appendonly = on;
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

    pub(crate) fn cluster(mut self, on: bool) -> Self {
        self.cluster = on;
        self
    }

    /// Starts the server and waits until it answers `PING` with `+PONG` (and `INFO`
    /// reports this process's pid).
    pub async fn start(self) -> Result<RedisServer, HarnessError> {
        let mut attempt = 1;
        loop {
            match self.clone().start_once().await {
                Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
                result => return result,
            }
        }
    }

    async fn start_once(self) -> Result<RedisServer, HarnessError> {
        let program = find_binary("redis-server", &[])?;
        let port = if self.cluster {
            free_port_with_bus()?
        } else {
            free_port()?
        };
        let dir = super::temp_dir("distlock-redis-")?;
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
        if self.appendonly {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        } else {
            args.extend(["--save".to_string(), String::new()]);
            args.extend(["--appendonly", "no"].map(String::from));
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
            envs: Vec::new(),
            cwd: dir.path().to_path_buf(),
            user: None,
            log: dir.path().join("redis.log"),
        };
        let process = ManagedProcess::spawn(spec)?;
        let server = RedisServer {
            process,
            port,
            tls_port,
            password: self.password,
            replica: self.replica_of.is_some(),
            dir,
        };
        server.wait_ready().await?;
        Ok(server)
    }
}

/// A `redis-server` process on 127.0.0.1 with its own temp dir; killed and removed on drop.
#[derive(Debug)]
pub struct RedisServer {
    // Field order matters: the process is killed before the directory is removed.
    process: ManagedProcess,
    port: u16,
    tls_port: Option<u16>,
    password: Option<String>,
    replica: bool,
    dir: tempfile::TempDir,
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

    /// `redis://127.0.0.1:PORT/`, or `redis://:PASSWORD@127.0.0.1:PORT/` with a password.
    pub fn url(&self) -> String {
        server_url("redis", self.port, self.password.as_deref())
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The TLS port, when started with [`RedisServerBuilder::tls`].
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:TLS_PORT/` (with the password, like [`url`](Self::url)), when
    /// started with [`RedisServerBuilder::tls`]. Clients must trust [`RedisTls::ca_pem`].
    pub fn tls_url(&self) -> Option<String> {
        let tls_port = self.tls_port?;
        Some(server_url("rediss", tls_port, self.password.as_deref()))
    }

    /// `127.0.0.1:PORT`, for example as the upstream of a [`super::proxy::FaultProxy`].
    pub fn addr(&self) -> SocketAddr {
        loopback(self.port)
    }

    /// The password, if the server requires one.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The pid of the running server process, `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// The server's working directory (RDB/AOF files, `nodes.conf`, `redis.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Freezes the server with `SIGSTOP`: connections stay open, nothing is answered.
    /// Returns once every thread is stopped (a few milliseconds; blocks the caller).
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.process.pause()
    }

    /// Continues a paused server with `SIGCONT`.
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.process.resume()
    }

    /// Kills the server with `SIGKILL` (no shutdown save) and waits for it to exit.
    pub fn kill(&self) -> Result<(), HarnessError> {
        self.process.kill()
    }

    /// Starts the server again on the same port with the same directory and options (killing
    /// it first if it still runs) and waits until it answers `PING`. Data survives only with
    /// [`RedisServerBuilder::appendonly`].
    pub async fn restart(&self) -> Result<(), HarnessError> {
        self.process.respawn().await?;
        self.wait_ready().await
    }

    /// True while the process runs (also while paused).
    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// True while the server is paused.
    pub fn is_paused(&self) -> bool {
        self.process.is_paused()
    }

    /// The last lines of the server log.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// Sends one command (authenticating when a password is set), waiting at most
    /// [`COMMAND_TIMEOUT`].
    pub async fn command<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<RespValue, HarnessError> {
        self.command_timeout(args, COMMAND_TIMEOUT).await
    }

    /// Like [`command`](Self::command) with an explicit time limit.
    pub async fn command_timeout<A: AsRef<[u8]>>(
        &self,
        args: &[A],
        timeout: Duration,
    ) -> Result<RespValue, HarnessError> {
        resp_command(self.addr(), self.password.as_deref(), args, timeout).await
    }

    async fn wait_ready(&self) -> Result<(), HarnessError> {
        let addr = self.addr();
        let password = self.password.as_deref();
        wait_until(
            self.process.what(),
            READY_TIMEOUT,
            Duration::from_millis(20),
            || async move {
                if let Some(fatal) = self.process.check_alive() {
                    return fatal;
                }
                match resp_command(addr, password, &["PING"], Duration::from_secs(2)).await {
                    Ok(RespValue::Simple(s)) if s == "PONG" => {}
                    Ok(other) => return Probe::NotYet(format!("PING answered {other:?}")),
                    Err(e) => return Probe::NotYet(e.to_string()),
                }
                // Make sure the server on the port is ours, not another process's that took
                // the port first (ours then exits: the next check_alive reports it).
                let info =
                    resp_command(addr, password, &["INFO", "server"], Duration::from_secs(2))
                        .await
                        .map(|reply| reply.as_text().unwrap_or_default());
                let ours = self
                    .process
                    .pid()
                    .map(|pid| format!("process_id:{pid}\r\n"));
                match (info, ours) {
                    (Ok(info), Some(ours)) if info.contains(&ours) => {
                        if self.replica {
                            replica_synced(addr, password).await
                        } else {
                            Probe::Ready(())
                        }
                    }
                    (Ok(_), _) => Probe::NotYet(format!(
                        "another process answers on {addr} (process_id is not ours)"
                    )),
                    (Err(e), _) => Probe::NotYet(e.to_string()),
                }
            },
        )
        .await
    }
}

/// Ready once a replica reports its link to the master up (the initial sync is done).
async fn replica_synced(addr: SocketAddr, password: Option<&str>) -> Probe<()> {
    match resp_command(
        addr,
        password,
        &["INFO", "replication"],
        Duration::from_secs(2),
    )
    .await
    {
        Ok(reply) => {
            let info = reply.as_text().unwrap_or_default();
            if info.contains("master_link_status:up") {
                Probe::Ready(())
            } else {
                Probe::NotYet(format!(
                    "replica not synced yet: {}",
                    info.lines()
                        .find(|l| l.starts_with("master_link_status"))
                        .unwrap_or("no master_link_status")
                ))
            }
        }
        Err(e) => Probe::NotYet(e.to_string()),
    }
}

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
}

impl RedisCluster {
    /// Starts 3 cluster-enabled masters (`--cluster-node-timeout 2000`), assigns all slots
    /// with `redis-cli --cluster create`, and waits until every node reports
    /// `cluster_state:ok`.
    pub async fn start() -> Result<Self, HarnessError> {
        let redis_cli = find_binary("redis-cli", &[])?;
        let mut nodes = Vec::with_capacity(3);
        for _ in 0..3 {
            nodes.push(RedisServer::builder().cluster(true).start().await?);
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
        let cluster = RedisCluster { nodes };
        cluster.wait_healthy(CLUSTER_TIMEOUT).await?;
        Ok(cluster)
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
        wait_until(
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
    /// returns once it has synced with it, so the cluster can fail `master` over to it.
    ///
    /// [`nodes`]: Self::nodes
    pub async fn start_replica(&self, master: &RedisServer) -> Result<RedisServer, HarnessError> {
        let replica = RedisServer::builder().cluster(true).start().await?;
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
        wait_until(
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
        wait_until(
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
    use crate::require;

    fn text(v: RespValue) -> Option<String> {
        v.as_text()
    }

    #[test]
    fn replies_convert_to_resp2_values_and_errors_keep_their_text() {
        use redis::Value;
        let reply = Value::Array(vec![
            Value::Okay,
            Value::Int(-7),
            Value::BulkString(b"hello".to_vec()),
            Value::Nil,
            Value::SimpleString("QUEUED".into()),
        ]);
        assert_eq!(
            RespValue::try_from(reply),
            Ok(RespValue::Array(Some(vec![
                RespValue::Simple("OK".into()),
                RespValue::Integer(-7),
                RespValue::Bulk(Some(b"hello".to_vec())),
                RespValue::Bulk(None),
                RespValue::Simple("QUEUED".into()),
            ])))
        );
        for line in [
            "MOVED 12182 127.0.0.1:7001",
            "NOAUTH Authentication required.",
            "ERR unknown command 'NOPE'",
            "BUSYKEY",
        ] {
            let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
            assert_eq!(
                RespValue::try_from(value),
                Ok(RespValue::Error(line.into()))
            );
        }
        assert!(RespValue::try_from(Value::Double(1.5)).is_err());
    }

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
    async fn single_node_pause_resume_and_restart_loses_data() {
        let redis = require(RedisServer::start().await);
        assert_eq!(redis.url(), format!("redis://127.0.0.1:{}/", redis.port()));
        let pid = redis.pid().expect("running");
        assert_eq!(
            text(require(redis.command(&["SET", "k", "v1"]).await)).as_deref(),
            Some("OK")
        );
        assert_eq!(
            text(require(redis.command(&["GET", "k"]).await)).as_deref(),
            Some("v1")
        );
        // The server really runs with our options.
        let reply = require(redis.command(&["CONFIG", "GET", "bind"]).await);
        let RespValue::Array(Some(items)) = &reply else {
            panic!("{reply:?}")
        };
        assert_eq!(items[1].as_text().as_deref(), Some("127.0.0.1"));

        require(redis.pause());
        assert!(redis.is_paused() && redis.is_running());
        let err = redis
            .command_timeout(&["PING"], Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(matches!(err, HarnessError::Timeout { .. }), "{err}");
        require(redis.resume());
        assert_eq!(
            text(require(redis.command(&["PING"]).await)).as_deref(),
            Some("PONG")
        );

        require(redis.kill());
        assert!(!redis.is_running());
        assert!(redis.pid().is_none());
        assert!(redis.command(&["PING"]).await.is_err());
        require(redis.restart().await);
        assert_ne!(redis.pid(), Some(pid));
        assert_eq!(
            require(redis.command(&["GET", "k"]).await),
            RespValue::Bulk(None),
            "no persistence: the key is gone after a restart"
        );
    }

    #[tokio::test]
    async fn appendonly_survives_kill_and_restart() {
        let redis = require(RedisServer::builder().appendonly(true).start().await);
        require(redis.command(&["SET", "durable", "yes"]).await);
        require(redis.kill());
        require(redis.restart().await);
        assert_eq!(
            text(require(redis.command(&["GET", "durable"]).await)).as_deref(),
            Some("yes")
        );
    }

    #[tokio::test]
    async fn password_is_required() {
        let redis = require(
            RedisServer::builder()
                .password(Some("s3cret/pw"))
                .start()
                .await,
        );
        assert_eq!(
            redis.url(),
            format!("redis://:s3cret%2Fpw@127.0.0.1:{}/", redis.port())
        );
        let anonymous =
            require(resp_command(redis.addr(), None, &["GET", "x"], COMMAND_TIMEOUT).await);
        assert!(
            matches!(&anonymous, RespValue::Error(e) if e.starts_with("NOAUTH")),
            "{anonymous:?}"
        );
        let wrong = resp_command(redis.addr(), Some("nope"), &["PING"], COMMAND_TIMEOUT).await;
        assert!(
            matches!(wrong, Err(HarnessError::Protocol { .. })),
            "{wrong:?}"
        );
        assert_eq!(
            text(require(redis.command(&["PING"]).await)).as_deref(),
            Some("PONG")
        );
    }

    #[tokio::test]
    async fn a_replica_syncs_from_its_master_and_follows_writes() {
        let master = require(RedisServer::start().await);
        let replica = require(
            RedisServer::builder()
                .replica_of(master.addr())
                .start()
                .await,
        );
        let info = text(require(master.command(&["INFO", "replication"]).await)).unwrap();
        assert!(info.contains("connected_slaves:1"), "{info}");
        let info = text(require(replica.command(&["INFO", "replication"]).await)).unwrap();
        assert!(info.contains("role:slave"), "{info}");
        assert!(
            info.contains(&format!("master_port:{}", master.port())),
            "{info}"
        );
        require(master.command(&["SET", "replicated", "yes"]).await);
        // WAIT returns once the replica has the write: it must count one replica.
        assert_eq!(
            require(master.command(&["WAIT", "1", "5000"]).await),
            RespValue::Integer(1)
        );
        assert_eq!(
            text(require(replica.command(&["GET", "replicated"]).await)).as_deref(),
            Some("yes")
        );
        let readonly = require(replica.command(&["SET", "x", "1"]).await);
        assert!(
            matches!(&readonly, RespValue::Error(e) if e.starts_with("READONLY")),
            "{readonly:?}"
        );
    }

    #[tokio::test]
    async fn three_master_cluster_is_ok_and_routes_slots() {
        let cluster = require(RedisCluster::start().await);
        assert_eq!(cluster.nodes().len(), 3);
        assert_eq!(cluster.urls().len(), 3);
        for node in cluster.nodes() {
            let info = text(require(node.command(&["CLUSTER", "INFO"]).await)).unwrap();
            assert!(info.contains("cluster_state:ok"), "{info}");
            assert!(info.contains("cluster_known_nodes:3"), "{info}");
        }
        let owner = require(cluster.node_for_key(b"foo").await);
        assert_eq!(
            text(require(owner.command(&["SET", "foo", "1"]).await)).as_deref(),
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
