//! A helper command (`psql`, `etcdctl`, …) run to completion with a time limit: what the
//! servers' set-up and snapshots run beside the server processes they own.

use std::process::Stdio;
use std::time::Duration;

use crate::error::HarnessError;

/// Runs a helper command to completion with a time limit, returning its stdout.
pub(crate) async fn run(
    mut cmd: tokio::process::Command,
    command_line: String,
    timeout: Duration,
) -> Result<String, HarnessError> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let output = tokio::time::timeout(timeout, cmd.output())
        .await
        .map_err(|_| HarnessError::Timeout {
            what: command_line.clone(),
            after: timeout,
        })?
        .map_err(|e| HarnessError::io(format!("running {command_line}"), e))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        Ok(stdout)
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        Err(HarnessError::CommandFailed {
            command: command_line,
            status: output.status.to_string(),
            stderr: if stderr.trim().is_empty() {
                stdout
            } else {
                stderr
            },
        })
    }
}
