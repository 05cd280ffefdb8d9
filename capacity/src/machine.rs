//! The machine a report was measured on — cores, memory, kernel, CPU, and the versions of
//! the servers its caller started there — and the date, printed at the top of the report so its numbers can be put in context.

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
    /// The servers measured, as `(name, version)`, when they ran on this machine: the
    /// caller that started them says which ([`Machine::with_server`]).
    pub servers: Vec<(String, String)>,
    /// The UTC date and time the run started, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
}

impl Machine {
    /// Looks at this machine; a part that cannot be read is reported as `unknown`. No
    /// server is listed.
    pub fn detect() -> Self {
        Self {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ram_mib: mem_total_mib(),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            cpu: cpu_model(),
            servers: Vec::new(),
            date: utc_now(),
        }
    }

    /// This machine, with server `name` of `version` running on it.
    #[must_use]
    pub fn with_server(mut self, name: impl Into<String>, version: impl Into<String>) -> Self {
        self.servers.push((name.into(), version.into()));
        self
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
