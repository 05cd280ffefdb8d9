//! One `redis-server` ([`RedisServer`]): its URLs and ports, commands sent to it, and the
//! probe that tells it serves (and is the process the harness started).

use std::net::SocketAddr;
use std::time::Duration;

use super::resp::{COMMAND_TIMEOUT, RespValue, resp_command};
use super::user::{RedisUser, url_with_login};
use crate::error::HarnessError;
use crate::server::{Server, ServerKind};

/// `scheme://127.0.0.1:PORT/`, with the password percent-encoded as user info when given.
fn server_url(scheme: &str, port: u16, password: Option<&str>) -> String {
    url_with_login(&format!("{scheme}://127.0.0.1:{port}/"), None, password)
}

/// A `redis-server` process on 127.0.0.1 with its own temp dir; killed and removed on drop.
///
/// [`kill`](Server::kill) leaves no shutdown save; [`restart`](Server::restart) starts it
/// on the same port with the same directory and options and returns once it answers
/// `PING`: data survives only with [`RedisServerBuilder::appendonly`](super::RedisServerBuilder::appendonly) (and a cluster node
/// keeps its identity and slots in `nodes.conf`).
pub type RedisServer = Server<Redis>;

/// What a `redis-server` adds to [`Server`]: its ports, its password, its ACL users, and
/// whether it is a replica.
#[derive(Debug)]
pub struct Redis {
    pub(super) port: u16,
    pub(super) tls_port: Option<u16>,
    pub(super) password: Option<String>,
    pub(super) users: Vec<RedisUser>,
    pub(super) replica: bool,
}

impl ServerKind for Redis {
    const READY_TIMEOUT: Duration = Duration::from_secs(15);
    const PROBE_INTERVAL: Duration = Duration::from_millis(20);

    fn client_port(&self) -> u16 {
        self.port
    }

    async fn probe(server: &RedisServer) -> Result<(), String> {
        let (addr, password) = (server.addr(), server.password());
        match resp_command(addr, password, &["PING"], Duration::from_secs(2)).await {
            Ok(RespValue::Simple(s)) if s == "PONG" => {}
            Ok(other) => return Err(format!("PING answered {other:?}")),
            Err(e) => return Err(e.to_string()),
        }
        // Make sure the server on the port is ours, not another process's that took the
        // port first (ours then exits: the next probe reports it).
        let info = resp_command(addr, password, &["INFO", "server"], Duration::from_secs(2))
            .await
            .map(|reply| reply.as_text().unwrap_or_default());
        let ours = server.pid().map(|pid| format!("process_id:{pid}\r\n"));
        match (info, ours) {
            (Ok(info), Some(ours)) if info.contains(&ours) => {
                if server.kind().replica {
                    replica_synced(addr, password).await
                } else {
                    Ok(())
                }
            }
            (Ok(_), _) => Err(format!(
                "another process answers on {addr} (process_id is not ours)"
            )),
            (Err(e), _) => Err(e.to_string()),
        }
    }
}

impl RedisServer {
    /// `redis://127.0.0.1:PORT/`, or `redis://:PASSWORD@127.0.0.1:PORT/` with a password.
    pub fn url(&self) -> String {
        server_url("redis", self.port(), self.password())
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.kind().port
    }

    /// The TLS port, when started with [`RedisServerBuilder::tls`](super::RedisServerBuilder::tls).
    pub fn tls_port(&self) -> Option<u16> {
        self.kind().tls_port
    }

    /// `rediss://127.0.0.1:TLS_PORT/` (with the password, like [`url`](Self::url)), when
    /// started with [`RedisServerBuilder::tls`](super::RedisServerBuilder::tls). Clients must trust
    /// [`RedisTls::ca_pem`](super::RedisTls::ca_pem).
    pub fn tls_url(&self) -> Option<String> {
        let tls_port = self.tls_port()?;
        Some(server_url("rediss", tls_port, self.password()))
    }

    /// `redis://NAME:PASSWORD@127.0.0.1:PORT/` for the ACL user `name` the server was
    /// started with ([`RedisServerBuilder::user`](super::RedisServerBuilder::user)); `None` if it has no such user.
    pub fn url_as(&self, name: &str) -> Option<String> {
        Some(self.user(name)?.url(self.addr()))
    }

    /// The ACL user `name` the server was started with, if any.
    pub fn user(&self, name: &str) -> Option<&RedisUser> {
        self.kind().users.iter().find(|u| u.name() == name)
    }

    /// `ACL LOG`: one `(reason, object)` per refusal since the server started, newest
    /// first, e.g. `("command", "set")` or `("channel", "distlock:{}")`; empty when no
    /// user was refused anything.
    pub async fn acl_refusals(&self) -> Result<Vec<(String, String)>, HarnessError> {
        let protocol = |detail: String| HarnessError::Protocol {
            what: format!("ACL LOG on {}", self.what()),
            detail,
        };
        let RespValue::Array(Some(entries)) = self.command(&["ACL", "LOG"]).await? else {
            return Err(protocol("not an array".into()));
        };
        entries
            .iter()
            .map(|entry| {
                let RespValue::Array(Some(fields)) = entry else {
                    return Err(protocol(format!("an entry is not an array: {entry:?}")));
                };
                let fields: Vec<String> = fields.iter().filter_map(RespValue::as_text).collect();
                let field = |name: &str| {
                    fields
                        .iter()
                        .position(|f| f == name)
                        .and_then(|i| fields.get(i + 1).cloned())
                        .ok_or_else(|| protocol(format!("an entry has no {name}: {fields:?}")))
                };
                Ok((field("reason")?, field("object")?))
            })
            .collect()
    }

    /// The password, if the server requires one.
    pub fn password(&self) -> Option<&str> {
        self.kind().password.as_deref()
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
        resp_command(self.addr(), self.password(), args, timeout).await
    }
}

/// Ready once a replica reports its link to the master up (the initial sync is done).
async fn replica_synced(addr: SocketAddr, password: Option<&str>) -> Result<(), String> {
    let reply = resp_command(
        addr,
        password,
        &["INFO", "replication"],
        Duration::from_secs(2),
    )
    .await
    .map_err(|e| e.to_string())?;
    let info = reply.as_text().unwrap_or_default();
    if info.contains("master_link_status:up") {
        Ok(())
    } else {
        Err(format!(
            "replica not synced yet: {}",
            info.lines()
                .find(|l| l.starts_with("master_link_status"))
                .unwrap_or("no master_link_status")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;

    fn text(v: RespValue) -> Option<String> {
        v.as_text()
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
    async fn snapshots_aof_everysec_and_an_acl_user_survive_kill_and_restart() {
        let user = RedisUser::new(
            "worker",
            "w0rker/pw",
            ["~jobs:*", "resetchannels", "-@all", "+get", "+set"],
        )
        .unwrap();
        let redis = require(
            RedisServer::builder()
                .appendfsync(crate::redis::AppendFsync::EverySec)
                .snapshots(&[(1, 1), (60, 5)])
                .user(user)
                .start()
                .await,
        );
        let config = |name: &'static str| {
            let redis = &redis;
            async move {
                match require(redis.command(&["CONFIG", "GET", name]).await) {
                    RespValue::Array(Some(items)) => items[1].as_text().unwrap(),
                    other => panic!("{other:?}"),
                }
            }
        };
        assert_eq!(config("save").await, "1 1 60 5");
        assert_eq!(config("appendonly").await, "yes");
        assert_eq!(config("appendfsync").await, "everysec");
        let url = redis.url_as("worker").expect("the user exists");
        assert_eq!(
            url,
            format!("redis://worker:w0rker%2Fpw@127.0.0.1:{}/", redis.port())
        );
        assert!(redis.url_as("nobody").is_none());
        let as_worker = |args: &'static [&'static str]| {
            let addr = redis.addr();
            let url = url.clone();
            async move {
                let client = ::redis::Client::open(url).unwrap();
                let mut conn = tokio::time::timeout(
                    COMMAND_TIMEOUT,
                    client.get_multiplexed_async_connection(),
                )
                .await
                .unwrap_or_else(|_| panic!("{addr} did not answer"))
                .unwrap();
                let mut cmd = ::redis::cmd(args[0]);
                for arg in &args[1..] {
                    cmd.arg(*arg);
                }
                cmd.query_async::<::redis::Value>(&mut conn).await
            }
        };
        assert!(as_worker(&["SET", "jobs:1", "v"]).await.is_ok());
        let refused = as_worker(&["SET", "other:1", "v"]).await.unwrap_err();
        assert!(
            refused.to_string().to_uppercase().contains("NOPERM"),
            "{refused}"
        );
        let refusal = [("key".to_owned(), "other:1".to_owned())];
        assert_eq!(require(redis.acl_refusals().await), refusal);

        require(redis.kill());
        require(redis.restart().await);
        assert_eq!(
            text(require(redis.command(&["GET", "jobs:1"]).await)).as_deref(),
            Some("v"),
            "the AOF kept the write"
        );
        assert!(
            as_worker(&["GET", "jobs:1"]).await.is_ok(),
            "the user exists again"
        );
        assert_eq!(
            require(redis.acl_refusals().await),
            [],
            "the refusal before the restart went with the old process"
        );
        let refused = as_worker(&["GET", "other:1"]).await.unwrap_err();
        assert!(
            refused.to_string().to_uppercase().contains("NOPERM"),
            "{refused}"
        );
        assert_eq!(require(redis.acl_refusals().await), refusal);
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
        // WAIT counts the replica's acknowledged offset, which may run a moment ahead of
        // the write being readable there: read until it shows, for a bounded time.
        let seen = require(
            crate::probe::wait_until_ready(
                "the write on the replica",
                Duration::from_secs(5),
                Duration::from_millis(10),
                || async {
                    let reply = replica.command(&["GET", "replicated"]).await;
                    text(reply.map_err(|e| e.to_string())?).ok_or_else(|| "not there yet".into())
                },
            )
            .await,
        );
        assert_eq!(seen, "yes");
        let readonly = require(replica.command(&["SET", "x", "1"]).await);
        assert!(
            matches!(&readonly, RespValue::Error(e) if e.starts_with("READONLY")),
            "{readonly:?}"
        );
    }
}
