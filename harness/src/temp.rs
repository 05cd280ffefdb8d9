//! Temporary directories for servers and clock shims: [`temp_dir`], under `/tmp` so that
//! every user (the `postgres` OS user too) can traverse them.

use crate::error::HarnessError;

/// Creates a temporary directory under `/tmp` (every user can traverse it) with `prefix`.
pub(crate) fn temp_dir(prefix: &str) -> Result<tempfile::TempDir, HarnessError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .map_err(|e| HarnessError::io(format!("creating a temp dir {prefix}* under /tmp"), e))
}
