//! The machine a report was measured on — cores, memory, kernel, CPU, server versions —
//! and the date, printed at the top of the report so its numbers can be put in context.

use std::path::PathBuf;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// What a report says about where it ran.
#[derive(Clone, Debug)]
pub struct Machine {
    /// Cores this process may use (`std::thread::available_parallelism`).
    pub cores: usize,
    /// Total memory from `/proc/meminfo`, in MiB.
    pub ram_mib: Option<u64>,
    /// The kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// The CPU model (`/proc/cpuinfo`).
    pub cpu: String,
    /// `redis-server --version`, first line.
    pub redis: String,
    /// `postgres --version`.
    pub postgres: String,
    /// `etcd --version`, first line.
    pub etcd: String,
    /// The UTC date and time the run started, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
}

impl Machine {
    /// Looks at this machine; a part that cannot be read is reported as `unknown`.
    pub fn detect() -> Self {
        let pg_bin: Vec<PathBuf> = pg_bin_dir().into_iter().collect();
        Self {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ram_mib: mem_total_mib(),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            cpu: cpu_model(),
            redis: version("redis-server", &[]),
            postgres: version("postgres", &pg_bin),
            etcd: version("etcd", &[]),
            date: utc_now(),
        }
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

fn mem_total_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The directory the test harness takes PostgreSQL from (`harness::postgres::pg_bin_dir`,
/// not a dependency here so that `lockctl bench` builds without the harness):
/// `$DISTLOCK_PG_BINDIR` if set, else the newest `/usr/lib/postgresql/N/bin` holding
/// `postgres`.
fn pg_bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DISTLOCK_PG_BINDIR") {
        return Some(PathBuf::from(dir));
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").is_file().then_some((version, bin))
        })
        .max_by_key(|(version, _)| *version)
        .map(|(_, bin)| bin)
}

/// The first executable file named `binary` in `extra_dirs`, then on `PATH`.
fn find_binary(binary: &str, extra_dirs: &[PathBuf]) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    extra_dirs
        .iter()
        .cloned()
        .chain(std::env::split_paths(&path))
        .map(|dir| dir.join(binary))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The first line of `<binary> --version`, or `not installed`.
fn version(binary: &str, extra_dirs: &[PathBuf]) -> String {
    let Some(path) = find_binary(binary, extra_dirs) else {
        return "not installed".into();
    };
    Command::new(path)
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

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`, without a date-time dependency.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days(i64::try_from(secs / 86_400).unwrap_or(0));
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3_600,
        rem % 3_600 / 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day) — Howard Hinnant's
/// `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::civil_from_days;

    #[test]
    fn days_map_to_the_right_calendar_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    }
}
