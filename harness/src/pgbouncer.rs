//! PgBouncer for tests: a real `pgbouncer` process on a free 127.0.0.1 port in front of a
//! [`PostgresServer`], in `session` or `transaction` pooling mode, with its ini file and
//! user list in a temp dir of its own. PgBouncer refuses to run as root, so when the tests
//! run as root it runs as the `postgres` OS user, as the server does.
//!
//! Clients log in as [`USER`] with its password (SCRAM), and
//! PgBouncer logs in to the server with the same: [`PgBouncerServer::url`] is the server's
//! URL with PgBouncer's port.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::binary::{find_binary, pg_bin_dir};
use crate::error::HarnessError;
use crate::ports::{free_port, start_on_free_ports};
use crate::postgres::{PASSWORD, PostgresServer, USER, probe_select_one, psql_over_tcp, run_as};
use crate::process::Spec;
use crate::server::{Server, ServerKind};
use crate::temp::temp_dir;

/// How PgBouncer hands server sessions to clients (its `pool_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// A client keeps one server session from login to logout (`pool_mode = session`);
    /// the session is reset with `DISCARD ALL` before the next client gets it.
    Session,
    /// A client has a server session only for the length of one transaction
    /// (`pool_mode = transaction`); between transactions it may get any other.
    Transaction,
}

impl PoolMode {
    /// The ini file's value.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// Server sessions PgBouncer opens per (database, user) pair in transaction mode: few, so
/// that clients share them.
pub const SERVER_POOL_SIZE: u32 = 4;

/// The same in session mode, where every client connection keeps one server session and
/// a client beyond the pool waits: as many as the test server accepts, less a few.
pub const SESSION_POOL_SIZE: u32 = 150;

/// A PgBouncer process on 127.0.0.1 with its own directory; killed (by its pid) and
/// removed on drop. [`kill`](Server::kill) ends every client's connection; the server
/// sessions behind it end when the server sees their sockets close.
pub type PgBouncerServer = Server<PgBouncer>;

/// What a PgBouncer adds to [`Server`]: its port, pooling mode and the `psql` the probe
/// uses.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    mode: PoolMode,
    psql: PathBuf,
}

impl ServerKind for PgBouncer {
    const READY_TIMEOUT: Duration = Duration::from_secs(30);
    const PROBE_INTERVAL: Duration = Duration::from_millis(50);

    fn client_port(&self) -> u16 {
        self.port
    }

    async fn probe(server: &PgBouncerServer) -> Result<(), String> {
        probe_select_one(server.addr(), server.psql("select 1")).await
    }
}

impl PgBouncerServer {
    /// Starts `pgbouncer` on a free 127.0.0.1 port in `mode` in front of `upstream`'s
    /// database `postgres`, at most [`SESSION_POOL_SIZE`] or [`SERVER_POOL_SIZE`] server
    /// sessions for [`USER`], and waits until a `select 1` through it works. There is no
    /// `ignore_startup_parameters` line, as in PgBouncer's shipped configuration: a client
    /// that sends a startup parameter PgBouncer does not track (`extra_float_digits`,
    /// `options`) is refused, as in most deployments.
    pub async fn start(upstream: &PostgresServer, mode: PoolMode) -> Result<Self, HarnessError> {
        Self::start_with(upstream, mode, &[]).await
    }

    /// [`start`](Self::start) with `settings` (name and value) added to the ini file's
    /// `[pgbouncer]` section, such as `("query_wait_timeout", "1")`.
    pub async fn start_with(
        upstream: &PostgresServer,
        mode: PoolMode,
        settings: &[(&str, &str)],
    ) -> Result<Self, HarnessError> {
        start_on_free_ports(|| Self::start_once(upstream, mode, settings)).await
    }

    async fn start_once(
        upstream: &PostgresServer,
        mode: PoolMode,
        settings: &[(&str, &str)],
    ) -> Result<Self, HarnessError> {
        let program = find_binary("pgbouncer", &[PathBuf::from("/usr/sbin")])?;
        let bin_dir: Vec<PathBuf> = pg_bin_dir().into_iter().collect();
        let psql = find_binary("psql", &bin_dir)?;
        let user = run_as()?;
        let dir = temp_dir("distlock-pgbouncer-")?;
        let port = free_port()?;

        let ini = dir.path().join("pgbouncer.ini");
        let users = dir.path().join("userlist.txt");
        write_private(
            &ini,
            &format!(
                "[databases]\n\
                 postgres = host=127.0.0.1 port={upstream_port} dbname=postgres\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = scram-sha-256\n\
                 auth_file = {users}\n\
                 pool_mode = {mode}\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 500\n\
                 log_connections = 0\n\
                 log_disconnections = 0\n\
                 {extra}",
                upstream_port = upstream.port(),
                extra = settings
                    .iter()
                    .map(|(name, value)| format!("{name} = {value}\n"))
                    .collect::<String>(),
                users = users.display(),
                mode = mode.as_str(),
                pool_size = match mode {
                    PoolMode::Session => SESSION_POOL_SIZE,
                    PoolMode::Transaction => SERVER_POOL_SIZE,
                },
            ),
            user,
        )?;
        write_private(&users, &format!("\"{USER}\" \"{PASSWORD}\"\n"), user)?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| {
                HarnessError::io(
                    format!("chown {} to the postgres user", dir.path().display()),
                    e,
                )
            })?;
        }
        let spec = Spec {
            what: format!("pgbouncer ({}) on 127.0.0.1:{port}", mode.as_str()),
            program,
            args: vec![ini.into_os_string()],
            envs: Vec::new(),
            cwd: dir.path().to_path_buf(),
            user,
            log: dir.path().join("pgbouncer.log"),
        };
        let server = Server::spawn(spec, PgBouncer { port, mode, psql }, dir)?;
        server.wait_ready().await?;
        Ok(server)
    }

    /// `postgres://distlock:distlock-test-pw@127.0.0.1:PORT/postgres` with PgBouncer's port.
    pub fn url(&self) -> String {
        format!(
            "postgres://{USER}:{PASSWORD}@127.0.0.1:{}/postgres",
            self.port()
        )
    }

    /// The TCP port clients connect to.
    pub fn port(&self) -> u16 {
        self.kind().port
    }

    /// The pooling mode it runs in.
    pub fn pool_mode(&self) -> PoolMode {
        self.kind().mode
    }

    /// Runs `sql` with `psql` through PgBouncer as [`USER`] (SCRAM), stopping at the first
    /// error, and returns the unaligned, tuples-only output.
    pub async fn psql(&self, sql: &str) -> Result<String, HarnessError> {
        psql_over_tcp(&self.kind().psql, self.port(), USER, PASSWORD, sql).await
    }
}

/// Writes `text` to a new file readable only by its owner (`user` when given).
fn write_private(path: &Path, text: &str, user: Option<(u32, u32)>) -> Result<(), HarnessError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| HarnessError::io(format!("creating {}", path.display()), e))?;
    file.write_all(text.as_bytes())
        .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| HarnessError::io(format!("chown {}", path.display()), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;

    /// Session mode keeps a client on one server session; transaction mode hands the
    /// session that ran a client's transaction to the next client that asks.
    #[tokio::test]
    async fn pools_server_sessions_per_client_or_per_transaction() {
        let pg = require(PostgresServer::start().await);
        for mode in [PoolMode::Session, PoolMode::Transaction] {
            let bouncer = require(PgBouncerServer::start(&pg, mode).await);
            assert_eq!(bouncer.pool_mode(), mode);
            // One psql run, two transactions: a session setting made in the first is seen
            // by the second only when the client keeps its server session, and (the pool
            // being idle, and PgBouncer reusing the last server session first) in
            // transaction mode the session keeps it for the next client.
            let seen = require(
                bouncer
                    .psql(
                        "select set_config('distlock.probe', 'set', false); \
                         select current_setting('distlock.probe', true)",
                    )
                    .await,
            );
            assert_eq!(seen, "set\nset");
            let next_client = require(
                bouncer
                    .psql("select coalesce(current_setting('distlock.probe', true), '')")
                    .await,
            );
            let expected = match mode {
                PoolMode::Session => "",
                PoolMode::Transaction => "set",
            };
            assert_eq!(next_client, expected, "{mode:?}");
            let pid = bouncer.pid().expect("running");
            drop(bouncer);
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "pgbouncer {pid} still runs after drop"
            );
        }
    }
}
