//! A store `lockctl torture --own` starts itself, so that its nemesis may restart it: a
//! `redis-server` on a free loopback port, persisting to an append-only file in a
//! directory of its own, killed (SIGKILL, as a crash) and started again on the same port
//! and files.

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// A store the run starts itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Own {
    /// `redis-server` from the PATH (or `--redis-server`), appendonly yes.
    Redis,
}

/// How often the store's append-only file is flushed to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fsync {
    /// After every write (`appendfsync always`): a kill loses nothing acknowledged.
    Always,
    /// Once a second (`appendfsync everysec`, Redis's default): a kill may lose the last
    /// second of writes, grants included.
    Everysec,
}

/// A running store and how to start it again.
pub struct OwnStore {
    binary: String,
    port: u16,
    dir: PathBuf,
    fsync: Fsync,
    child: Child,
}

/// How long a starting server has to answer PING.
const STARTUP: Duration = Duration::from_secs(10);

impl OwnStore {
    /// Starts `binary` (a `redis-server`) on a free loopback port.
    pub async fn start(binary: &str, fsync: Fsync) -> std::io::Result<Self> {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()?
            .port();
        let dir =
            std::env::temp_dir().join(format!("lockctl-torture-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir)?;
        let child = spawn(binary, port, &dir, fsync).await?;
        Ok(Self {
            binary: binary.to_owned(),
            port,
            dir,
            fsync,
            child,
        })
    }

    /// The store's URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and starts it again on the same port and files.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        self.child = spawn(&self.binary, self.port, &self.dir, self.fsync).await?;
        Ok(())
    }

    /// Stops the server and removes its files.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn spawn(
    binary: &str,
    port: u16,
    dir: &std::path::Path,
    fsync: Fsync,
) -> std::io::Result<Child> {
    let fsync = match fsync {
        Fsync::Always => "always",
        Fsync::Everysec => "everysec",
    };
    let mut child = Command::new(binary)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(dir)
        .args(["--appendonly", "yes", "--appendfsync", fsync, "--save", ""])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start {binary}: {e}")))?;
    let deadline = tokio::time::Instant::now() + STARTUP;
    loop {
        if answers_ping(port).await {
            return Ok(child);
        }
        if let Some(status) = child.try_wait()? {
            return Err(std::io::Error::other(format!(
                "{binary} exited at start: {status}"
            )));
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.start_kill();
            return Err(std::io::Error::other(format!(
                "{binary} did not answer PING within {STARTUP:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True when the server on `port` answers PING with PONG (not LOADING).
async fn answers_ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await else {
        return false;
    };
    if stream.write_all(b"PING\r\n").await.is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), stream.read_exact(&mut reply)).await,
        Ok(Ok(_)) if &reply == b"+PONG\r\n"
    )
}
