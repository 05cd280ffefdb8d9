//! PostgreSQL for tests: a cluster `initdb` made once, copied into a temp dir, and
//! `postgres` on a free 127.0.0.1 port,
//! run as the `postgres` OS user when the tests run as root. Creates the login role
//! [`USER`] with password [`PASSWORD`] (SCRAM over TCP, so wrong-password tests work).
//!
//! [`PostgresServer::start`] runs the server with `fsync=off`: **tests only**. Data still
//! survives [`PostgresServer::kill`] + [`PostgresServer::restart`] (the OS page cache keeps
//! it), but not a machine crash. [`PostgresServer::start_durable`] runs it as deployed
//! (`fsync=on`, `synchronous_commit=on`: every commit waits for its flush), for
//! measurements.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::binary::find_binary;
use crate::clock::ShiftedClock;
use crate::command::run;
use crate::error::HarnessError;
use crate::ports::{free_port, start_on_free_ports};
use crate::process::Spec;
use crate::server::{Server, ServerKind};
use crate::temp::temp_dir;

pub use crate::binary::pg_bin_dir;

/// The non-superuser login role that [`PostgresServer::url`] uses.
pub const USER: &str = "distlock";
/// The password of [`USER`].
pub const PASSWORD: &str = "distlock-test-pw";
/// The bootstrap superuser.
pub const SUPERUSER: &str = "postgres";
/// The TCP password of [`SUPERUSER`] (the Unix socket uses `trust`).
pub const SUPERUSER_PASSWORD: &str = "distlock-superuser-test-pw";

/// Time limit for one `psql` run.
const PSQL_TIMEOUT: Duration = Duration::from_secs(30);

/// uid/gid of the `postgres` OS user when running as root (PostgreSQL refuses to run as
/// root), `None` otherwise.
pub(crate) fn run_as() -> Result<Option<(u32, u32)>, HarnessError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let user = nix::unistd::User::from_name("postgres")
        .map_err(|e| HarnessError::Setup(format!("looking up the `postgres` OS user: {e}")))?
        .ok_or_else(|| {
            HarnessError::Setup(
                "running as root, PostgreSQL must run as the `postgres` OS user, which does \
                 not exist (install the Debian package postgresql-15, which creates it)"
                    .into(),
            )
        })?;
    Ok(Some((user.uid.as_raw(), user.gid.as_raw())))
}

/// Removes the single trailing newline psql prints.
pub(crate) fn trim_output(mut s: String) -> String {
    while s.ends_with('\n') || s.ends_with('\r') {
        s.pop();
    }
    s
}

/// A PostgreSQL server on 127.0.0.1 with its own cluster directory; killed and removed on
/// drop.
///
/// [`pause`](Server::pause) freezes the postmaster and every backend (the whole process
/// tree, also the backends in sessions of their own): open connections hang, new ones are
/// not accepted. [`kill`](Server::kill) ends every session, and so every session-level
/// advisory lock. [`restart`](Server::restart) starts it on the same port and data dir
/// (crash recovery runs) and returns once `select 1` works.
pub type PostgresServer = Server<Postgres>;

/// What a PostgreSQL server adds to [`Server`]: its port and the `psql` that drives it.
#[derive(Debug)]
pub struct Postgres {
    port: u16,
    psql: PathBuf,
}

impl ServerKind for Postgres {
    const READY_TIMEOUT: Duration = Duration::from_secs(60);
    const PROBE_INTERVAL: Duration = Duration::from_millis(50);

    fn client_port(&self) -> u16 {
        self.port
    }

    async fn probe(server: &PostgresServer) -> Result<(), String> {
        probe_select_one(server.addr(), server.psql("select 1")).await
    }

    /// A postmaster killed with `SIGKILL` leaves its System V shared memory segment (the
    /// small one PostgreSQL keeps to tell whether old processes still use a data
    /// directory): only a restart on the same data directory takes it back. Left behind by
    /// every server a test run kills, they reach the kernel's limit (`kernel.shmmni`, 4096)
    /// and no PostgreSQL can start on the machine. The segment's id is on the seventh line
    /// of `postmaster.pid`.
    fn clean_up_after_kill(&self, dir: &Path) {
        let Ok(pid_file) = std::fs::read_to_string(dir.join("data").join("postmaster.pid")) else {
            return;
        };
        let Some(id) = pid_file
            .lines()
            .nth(6)
            .and_then(|line| line.split_whitespace().nth(1))
            .filter(|id| id.parse::<u64>().is_ok())
        else {
            return;
        };
        // Removed once its last process detached; `ipcrm` is in util-linux, on every host
        // that runs PostgreSQL.
        let _ = std::process::Command::new("ipcrm")
            .args(["-m", id])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The options every test cluster is made with.
const INITDB_ARGS: [&str; 8] = [
    "-U",
    SUPERUSER,
    "--auth-local=trust",
    "--auth-host=scram-sha-256",
    "-E",
    "UTF8",
    "--locale=C",
    "--no-sync",
];

/// The data directory of a cluster `initdb` made once with [`INITDB_ARGS`], which every
/// server copies instead of running `initdb` again: hundreds of tests start a server, and
/// a copy took 0.16 s of CPU here against initdb's 1 s. It lives under `/tmp`, named after the `initdb`
/// binary (path, size, modification time), the options and the OS user, so another
/// PostgreSQL or other options make another. Made in a directory of its own and renamed
/// into place, so a server never copies half of one; tests that start at once may each
/// make one, and the first rename wins.
async fn cluster_template(
    initdb: &Path,
    user: Option<(u32, u32)>,
) -> Result<PathBuf, HarnessError> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let meta = std::fs::metadata(initdb)
        .map_err(|e| HarnessError::io(format!("reading {}", initdb.display()), e))?;
    let mut hasher = DefaultHasher::new();
    (initdb, meta.len(), meta.modified().ok(), INITDB_ARGS, user).hash(&mut hasher);
    let template = PathBuf::from(format!(
        "/tmp/distlock-pg-template-{:016x}",
        hasher.finish()
    ));
    let data = template.join("data");
    if data.join("PG_VERSION").is_file() {
        return Ok(data);
    }
    let staging = owned_temp_dir("distlock-pg-template-making-", user)?;
    let mut cmd = tokio::process::Command::new(initdb);
    cmd.arg("-D")
        .arg(staging.path().join("data"))
        .args(INITDB_ARGS)
        .env("LC_ALL", "C")
        .current_dir(staging.path());
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
    run(
        cmd,
        format!("initdb -D {}", staging.path().join("data").display()),
        Duration::from_secs(120),
    )
    .await?;
    // Another test's rename may have won meanwhile: then this one fails and its
    // directory is removed on drop.
    if std::fs::rename(staging.path(), &template).is_ok() {
        let _ = staging.keep();
    }
    if data.join("PG_VERSION").is_file() {
        Ok(data)
    } else {
        Err(HarnessError::Setup(format!(
            "no cluster template at {} after initdb",
            data.display()
        )))
    }
}

/// A temp dir PostgreSQL, running as `user`, can write in.
fn owned_temp_dir(
    prefix: &str,
    user: Option<(u32, u32)>,
) -> Result<tempfile::TempDir, HarnessError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir(prefix)?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .map_err(|e| HarnessError::io(format!("chmod 755 {}", dir.path().display()), e))?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| {
            HarnessError::io(
                format!("chown {} to the postgres user", dir.path().display()),
                e,
            )
        })?;
    }
    Ok(dir)
}

/// Options for a [`PostgresServer`]; see [`PostgresServer::builder`].
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct PostgresServerBuilder {
    durable: bool,
    /// The environment of a [`ShiftedClock`]; empty for the real clock.
    clock: Vec<(OsString, OsString)>,
}

impl PostgresServerBuilder {
    /// The server's durability as deployed, as [`PostgresServer::start_durable`] runs it.
    pub fn durable(mut self, on: bool) -> Self {
        self.durable = on;
        self
    }

    /// Runs the server, and so every backend it forks, under `clock` (also after
    /// [`restart`](Server::restart)), which must outlive it: `now()`, `clock_timestamp()`
    /// and every other use of the wall clock read it. `pg_sleep` measures its time on the
    /// wall clock too: a step forward ends it early, a step back makes it longer, and it
    /// does not end while the clock is frozen.
    pub fn clock(mut self, clock: &ShiftedClock) -> Self {
        self.clock = clock.envs();
        self
    }

    /// Starts the server as [`PostgresServer::start`] describes.
    pub async fn start(self) -> Result<PostgresServer, HarnessError> {
        start_on_free_ports(|| self.clone().start_once()).await
    }

    async fn start_once(self) -> Result<PostgresServer, HarnessError> {
        let bin_dir: Vec<PathBuf> = pg_bin_dir().into_iter().collect();
        let initdb = find_binary("initdb", &bin_dir)?;
        let postgres = find_binary("postgres", &bin_dir)?;
        let psql = find_binary("psql", &bin_dir)?;
        let user = run_as()?;

        let dir = owned_temp_dir("distlock-pg-", user)?;
        let data = dir.path().join("data");
        let template = cluster_template(&initdb, user).await?;
        let mut cp = tokio::process::Command::new("cp");
        cp.arg("-a").arg(&template).arg(&data);
        run(
            cp,
            format!("cp -a {} {}", template.display(), data.display()),
            Duration::from_secs(120),
        )
        .await?;

        let port = free_port()?;
        let args: Vec<String> = vec![
            "-D".into(),
            data.display().to_string(),
            "-p".into(),
            port.to_string(),
            "-k".into(),
            dir.path().display().to_string(),
            "-c".into(),
            "listen_addresses=127.0.0.1".into(),
            // `fsync=off` is for tests only: a machine crash could corrupt the cluster.
            "-c".into(),
            if self.durable {
                "fsync=on"
            } else {
                "fsync=off"
            }
            .into(),
            "-c".into(),
            "synchronous_commit=on".into(),
            "-c".into(),
            "max_connections=200".into(),
        ];
        let spec = Spec {
            what: format!("postgres on 127.0.0.1:{port}"),
            program: postgres,
            args: args.into_iter().map(Into::into).collect(),
            envs: [("LC_ALL".into(), "C".into())]
                .into_iter()
                .chain(self.clock)
                .collect(),
            cwd: dir.path().to_path_buf(),
            user,
            log: dir.path().join("postgres.log"),
        };
        let server = Server::spawn(spec, Postgres { port, psql }, dir)?;
        server.wait_ready().await?;
        server
            .psql(&format!(
                "CREATE ROLE {USER} LOGIN CREATEDB PASSWORD '{PASSWORD}'; \
                 GRANT ALL ON SCHEMA public TO {USER}; \
                 ALTER ROLE {SUPERUSER} PASSWORD '{SUPERUSER_PASSWORD}';"
            ))
            .await?;
        Ok(server)
    }
}

impl PostgresServer {
    /// Copies a cluster `initdb` made (UTF-8, C locale, `--auth-local=trust
    /// --auth-host=scram-sha-256`, made once and copied), starts `postgres -c listen_addresses=127.0.0.1 -c fsync=off` (tests only) with its
    /// Unix socket in the temp dir, waits until `select 1` works, then creates the role
    /// [`USER`] (LOGIN, CREATEDB, may create tables in schema `public` of database
    /// `postgres`) and gives [`SUPERUSER`] its TCP password.
    pub async fn start() -> Result<Self, HarnessError> {
        Self::builder().start().await
    }

    /// [`start`](Self::start) with the server's durability as deployed: `fsync=on` and
    /// `synchronous_commit=on`, so every commit that writes waits for its WAL flush.
    pub async fn start_durable() -> Result<Self, HarnessError> {
        Self::builder().durable(true).start().await
    }

    /// Options: durability, the wall clock.
    pub fn builder() -> PostgresServerBuilder {
        PostgresServerBuilder::default()
    }

    /// `postgres://distlock:distlock-test-pw@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!(
            "postgres://{USER}:{PASSWORD}@127.0.0.1:{}/postgres",
            self.port()
        )
    }

    /// The same for the superuser [`SUPERUSER`] (over TCP, with [`SUPERUSER_PASSWORD`]).
    pub fn superuser_url(&self) -> String {
        format!(
            "postgres://{SUPERUSER}:{SUPERUSER_PASSWORD}@127.0.0.1:{}/postgres",
            self.port()
        )
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.kind().port
    }

    /// The directory holding the Unix socket (`.s.PGSQL.PORT`).
    pub fn socket_dir(&self) -> &Path {
        self.dir()
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    /// Ends every session of `user` with `pg_terminate_backend`, as an administrator
    /// would (the server keeps running); returns how many were ended.
    pub async fn terminate_sessions(&self, user: &str) -> Result<u64, HarnessError> {
        let user = user.replace('\'', "''");
        let ended = self
            .psql(&format!(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE usename = '{user}'"
            ))
            .await?;
        ended.trim().parse().map_err(|_| HarnessError::Protocol {
            what: "pg_terminate_backend".into(),
            detail: format!("not a count: {ended:?}"),
        })
    }

    /// Polls `pg_stat_activity` every `every` until no session but the asking one matches
    /// `condition` (SQL on its columns), for at most `within`. `Ok` with the sessions the
    /// first poll found (each as `<backend type>: <query>`, `; `-separated; empty when none
    /// matched), what the caller waited for; `Err` with those still matching when it gave
    /// up.
    pub async fn until_no_session(
        &self,
        condition: &str,
        every: Duration,
        within: Duration,
    ) -> Result<Result<String, String>, HarnessError> {
        let deadline = tokio::time::Instant::now() + within;
        let sql = format!(
            "SELECT coalesce(string_agg(backend_type || ': ' || coalesce(query, ''), '; '), '') \
               FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND ({condition})"
        );
        let first = self.psql(&sql).await?;
        let mut seen = first.clone();
        while !seen.is_empty() {
            if tokio::time::Instant::now() >= deadline {
                return Ok(Err(seen));
            }
            tokio::time::sleep(every).await;
            seen = self.psql(&sql).await?;
        }
        Ok(Ok(first))
    }

    /// Runs `sql` with `psql` as [`SUPERUSER`] over the Unix socket (trust) in database
    /// `postgres`, stopping at the first error, and returns the unaligned, tuples-only
    /// output (`|`-separated columns, one row per line). Gives up after 30 s; a statement
    /// that may take longer (seeding a million rows on a busy machine) uses
    /// [`psql_within`](Self::psql_within).
    pub async fn psql(&self, sql: &str) -> Result<String, HarnessError> {
        self.psql_within(sql, PSQL_TIMEOUT).await
    }

    /// [`psql`](Self::psql) with its own time limit, a hang guard for statements whose
    /// duration depends on the load of the machine rather than on the case.
    pub async fn psql_within(&self, sql: &str, limit: Duration) -> Result<String, HarnessError> {
        let mut cmd = tokio::process::Command::new(&self.kind().psql);
        cmd.arg("-h")
            .arg(self.dir())
            .args([
                "-p",
                &self.port().to_string(),
                "-U",
                SUPERUSER,
                "-d",
                "postgres",
            ])
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-w",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ]);
        run(cmd, format!("psql (socket) -c {sql:?}"), limit)
            .await
            .map(trim_output)
    }

    /// Runs `sql` with `psql` over TCP to 127.0.0.1 as `user` with `password` (SCRAM), for
    /// authentication tests. Output as in [`psql`](Self::psql).
    pub async fn psql_tcp(
        &self,
        user: &str,
        password: &str,
        sql: &str,
    ) -> Result<String, HarnessError> {
        psql_over_tcp(&self.kind().psql, self.port(), user, password, sql).await
    }
}

/// Runs `sql` with `psql` over TCP to 127.0.0.1:`port` as `user` with `password` (SCRAM),
/// stopping at the first error; returns the unaligned, tuples-only output.
pub(crate) async fn psql_over_tcp(
    psql: &Path,
    port: u16,
    user: &str,
    password: &str,
    sql: &str,
) -> Result<String, HarnessError> {
    let mut cmd = tokio::process::Command::new(psql);
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", user])
        .args(["-d", "postgres", "-X", "-q", "-A", "-t", "-w"])
        .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
        .env("PGPASSWORD", password)
        .env("PGCONNECT_TIMEOUT", "5");
    run(
        cmd,
        format!("psql (tcp port {port}, user {user}) -c {sql:?}"),
        PSQL_TIMEOUT,
    )
    .await
    .map(trim_output)
}

/// The readiness probe of a server that speaks the PostgreSQL protocol on `addr`: a TCP
/// connect, then `select 1` through `psql`.
pub(crate) async fn probe_select_one<F>(
    addr: std::net::SocketAddr,
    select_one: F,
) -> Result<(), String>
where
    F: Future<Output = Result<String, HarnessError>>,
{
    if let Err(e) = tokio::net::TcpStream::connect(addr).await {
        return Err(format!("TCP connect: {e}"));
    }
    match select_one.await {
        Ok(out) if out == "1" => Ok(()),
        Ok(out) => Err(format!("select 1 returned {out:?}")),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;

    /// The System V shared memory segments of the machine, by id.
    fn shm_ids() -> Vec<String> {
        std::fs::read_to_string("/proc/sysvipc/shm")
            .expect("Linux lists its segments")
            .lines()
            .skip(1)
            .filter_map(|line| line.split_whitespace().nth(1).map(str::to_owned))
            .collect()
    }

    /// Killed (on drop, as every test server ends) and after a kill and a restart: the
    /// server leaves no shared memory segment behind.
    #[tokio::test]
    async fn a_dropped_server_leaves_no_shared_memory_segment() {
        let pg = require(PostgresServer::start().await);
        pg.kill().unwrap();
        pg.restart().await.unwrap();
        let pid_file = std::fs::read_to_string(pg.dir().join("data/postmaster.pid")).unwrap();
        let id = pid_file.lines().nth(6).unwrap().split_whitespace().nth(1);
        let id = id.expect("a segment id").to_owned();
        assert!(
            shm_ids().contains(&id),
            "segment {id} of the running server"
        );
        drop(pg);
        assert!(
            !shm_ids().contains(&id),
            "segment {id} of the dropped server is still there"
        );
    }

    #[tokio::test]
    async fn a_durable_server_flushes_every_commit_and_keeps_it_across_a_restart() {
        let pg = require(PostgresServer::start_durable().await);
        assert_eq!(
            require(pg.psql("show fsync; show synchronous_commit").await),
            "on\non"
        );
        require(
            pg.psql("CREATE TABLE kept (v int); INSERT INTO kept VALUES (7)")
                .await,
        );
        require(pg.restart().await);
        assert_eq!(
            require(pg.psql("show fsync; SELECT v FROM kept").await),
            "on\n7"
        );
    }

    #[tokio::test]
    async fn starts_authenticates_pauses_and_survives_restart() {
        let pg = require(PostgresServer::start().await);
        assert_eq!(require(pg.psql("select 1").await), "1");
        assert_eq!(
            pg.url(),
            format!(
                "postgres://distlock:distlock-test-pw@127.0.0.1:{}/postgres",
                pg.port()
            )
        );
        assert_eq!(
            require(pg.psql("show fsync; show listen_addresses").await),
            "off\n127.0.0.1"
        );

        // Password authentication over TCP: right password in, wrong password out.
        assert_eq!(
            require(pg.psql_tcp(USER, PASSWORD, "select current_user").await),
            USER
        );
        assert_eq!(
            require(
                pg.psql_tcp(SUPERUSER, SUPERUSER_PASSWORD, "select current_user")
                    .await
            ),
            SUPERUSER
        );
        match pg.psql_tcp(USER, "wrong-password", "select 1").await {
            Err(HarnessError::CommandFailed { stderr, .. }) => {
                assert!(
                    stderr.contains("password authentication failed"),
                    "{stderr}"
                )
            }
            other => panic!("a wrong password must be rejected, got {other:?}"),
        }
        // The test role can create tables in the default database.
        require(
            pg.psql_tcp(
                USER,
                PASSWORD,
                "create table t(x int); insert into t values (42)",
            )
            .await,
        );

        // A session that is already open freezes too: backends run in their own sessions
        // (setsid), so pausing must reach the whole process tree, not just the group.
        let started = std::time::Instant::now();
        let session = async {
            let out = pg.psql("select pg_sleep(1); select 'done'").await;
            (out, started.elapsed())
        };
        let freeze = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            require(pg.pause());
            tokio::time::sleep(Duration::from_millis(1500)).await;
            require(pg.resume());
        };
        let ((out, finished_after), ()) = tokio::join!(session, freeze);
        assert_eq!(require(out), "\ndone");
        assert!(
            finished_after >= Duration::from_millis(1900),
            "the open session kept running while paused: done after {finished_after:?}"
        );

        require(pg.pause());
        let paused = tokio::time::timeout(Duration::from_millis(500), pg.psql("select 1")).await;
        assert!(
            paused.is_err(),
            "a paused server must not answer: {paused:?}"
        );
        require(pg.resume());
        assert_eq!(require(pg.psql("select 1").await), "1");

        let pid = pg.pid();
        require(pg.kill());
        assert!(!pg.is_running());
        assert!(pg.psql("select 1").await.is_err());
        require(pg.restart().await);
        assert!(pg.pid().is_some() && pg.pid() != pid);
        assert_eq!(require(pg.psql("select x from t").await), "42");
    }
}
