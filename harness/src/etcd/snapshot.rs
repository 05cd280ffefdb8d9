//! Backing a member up and bringing it back from the backup, with `etcdctl` as operators
//! do: `etcdctl snapshot save`, then (the member stopped) `etcdctl snapshot restore` into a
//! fresh data dir and a start from it. Everything written after the snapshot is gone,
//! and the cluster's revision goes back to the snapshot's.

use std::path::Path;
use std::time::Duration;

use super::member::EtcdServer;
use crate::binary::find_binary;
use crate::command::run;
use crate::error::HarnessError;

/// Time limit for one `etcdctl snapshot` command.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(60);

impl EtcdServer {
    /// Saves a snapshot of the member's keyspace to `path` with `etcdctl snapshot save`.
    pub async fn save_snapshot(&self, path: &Path) -> Result<(), HarnessError> {
        let mut cmd = etcdctl()?;
        cmd.arg(format!("--endpoints={}", self.endpoint()))
            .arg("snapshot")
            .arg("save")
            .arg(path);
        run(
            cmd,
            format!("etcdctl snapshot save against {}", self.endpoint()),
            SNAPSHOT_TIMEOUT,
        )
        .await
        .map(drop)
    }

    /// Kills the member, replaces its data dir with one `etcdctl snapshot restore` makes
    /// from `path`, and starts it again on the same ports; returns once it serves. A
    /// single-member cluster only: the restored cluster has this member alone.
    pub async fn restore_snapshot(&self, path: &Path) -> Result<(), HarnessError> {
        self.kill()?;
        let data_dir = self.data_dir();
        std::fs::remove_dir_all(&data_dir)
            .map_err(|e| HarnessError::io(format!("removing {}", data_dir.display()), e))?;
        let peer_url = self.kind().peer_url();
        let mut cmd = etcdctl()?;
        cmd.arg("snapshot")
            .arg("restore")
            .arg(path)
            .arg(format!("--name={}", self.name()))
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--initial-cluster={}={peer_url}", self.name()))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"));
        run(
            cmd,
            format!("etcdctl snapshot restore into {}", data_dir.display()),
            SNAPSHOT_TIMEOUT,
        )
        .await?;
        self.restart().await
    }
}

fn etcdctl() -> Result<tokio::process::Command, HarnessError> {
    let mut cmd = tokio::process::Command::new(find_binary("etcdctl", &[])?);
    cmd.env("ETCDCTL_API", "3");
    Ok(cmd)
}
