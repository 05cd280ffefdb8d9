//! Finding the binaries the harness runs ([`find_binary`], PostgreSQL's in [`pg_bin_dir`]),
//! the Debian package that provides each ([`apt_package_for`]), and their versions
//! ([`binary_version`]).

use std::path::{Path, PathBuf};

use crate::error::HarnessError;

/// The directory holding `postgres`, `initdb` and `psql`: `$DISTLOCK_PG_BINDIR` if set,
/// else the newest `/usr/lib/postgresql/N/bin` that contains `postgres`.
pub fn pg_bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DISTLOCK_PG_BINDIR") {
        return Some(PathBuf::from(dir));
    }
    let entries = std::fs::read_dir("/usr/lib/postgresql").ok()?;
    entries
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .max_by_key(|(version, _)| *version)
        .map(|(_, bin)| bin)
}

/// The first line of `<binary> --version` for the binary the harness would start (found
/// as [`find_binary`] finds it, PostgreSQL's in [`pg_bin_dir`]), for reports of
/// where something was measured: `not installed` or `unknown` when it cannot be told.
pub fn binary_version(binary: &str) -> String {
    let pg_bin: Vec<PathBuf> = pg_bin_dir().into_iter().collect();
    let Ok(path) = find_binary(binary, &pg_bin) else {
        return "not installed".into();
    };
    std::process::Command::new(path)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_owned())
        })
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The Debian package that provides `binary`, used in [`HarnessError::MissingBinary`].
pub fn apt_package_for(binary: &str) -> &'static str {
    match binary {
        "redis-server" => "redis-server",
        "redis-sentinel" => "redis-sentinel",
        "redis-cli" => "redis-tools",
        "etcd" => "etcd-server",
        "etcdctl" => "etcd-client",
        "psql" | "pg_isready" => "postgresql-client-15",
        "postgres" | "initdb" | "pg_ctl" => "postgresql-15",
        "protoc" => "protobuf-compiler",
        "pgbouncer" => "pgbouncer",
        _ => "the package providing it",
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Finds an executable named `name`, first in `extra_dirs` (in order), then on `PATH`.
///
/// Returns [`HarnessError::MissingBinary`] with the Debian package name as the hint when it
/// is found nowhere.
pub fn find_binary(name: &str, extra_dirs: &[PathBuf]) -> Result<PathBuf, HarnessError> {
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    extra_dirs
        .iter()
        .chain(path_dirs.iter())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| HarnessError::MissingBinary {
            name: name.to_string(),
            hint: apt_package_for(name).to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp::temp_dir;

    #[test]
    fn missing_binary_names_the_package() {
        let err = find_binary("redis-cli-does-not-exist", &[]).unwrap_err();
        assert!(matches!(err, HarnessError::MissingBinary { .. }));
        let err = HarnessError::MissingBinary {
            name: "etcd".into(),
            hint: apt_package_for("etcd").into(),
        };
        assert!(err.to_string().contains("etcd-server"), "{err}");
        assert_eq!(apt_package_for("redis-cli"), "redis-tools");
        assert!(find_binary("sh", &[]).is_ok());
        // extra dirs come first
        let dir = temp_dir("distlock-find-").unwrap();
        let fake = dir.path().join("sh");
        std::fs::write(&fake, "#!/bin/sh\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            find_binary("sh", &[dir.path().to_path_buf()]).unwrap(),
            fake
        );
    }
}
