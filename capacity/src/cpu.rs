//! CPU time of this process and of a server's process tree, from `/proc` (Linux; elsewhere
//! nothing is read; the time each thread ran, from its `schedstat`): what a measurement
//! costs the machine, which a busy machine changes far less than it changes throughput.
//! Beside it, what the scheduler made each side wait (the time ready to run, on a run
//! queue) and how many requests each of the server's reads found.

use std::collections::HashMap;
use std::time::Duration;

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on Linux).
const TICKS_PER_SEC: u64 = 100;

/// CPU time read at one moment: this process's, and each process of a server's tree.
#[derive(Clone, Debug, Default)]
pub struct CpuReading {
    client: Option<Duration>,
    /// How many times this process's threads were put on a CPU (the third field of each
    /// thread's `schedstat`): each time one slept and was woken, or was preempted.
    client_switches: Option<u64>,
    /// How long this process's threads waited on a CPU's run queue, ready to run (the
    /// second field of each thread's `schedstat`).
    client_waited: Option<Duration>,
    server: HashMap<u32, Duration>,
    /// How long the server's main thread waited on a run queue, ready to run, and how many
    /// `read`-family calls its process made (`syscr` of `/proc/<pid>/io`): a server that
    /// reads each request alone makes a call per request, one reading a pipeline of them
    /// makes one.
    server_waited: Option<Duration>,
    server_reads: Option<u64>,
}

impl CpuReading {
    /// Reads this process and, with `server`, the process `server` and all its
    /// descendants (a PostgreSQL postmaster and its backends).
    pub fn now(server: Option<u32>) -> Self {
        Self {
            client: cpu_of("self"),
            client_switches: switches_of("self"),
            client_waited: schedstat_sum("self", 1).map(Duration::from_nanos),
            server: server.map(tree_cpu).unwrap_or_default(),
            server_waited: server.and_then(main_thread_waited),
            server_reads: server.and_then(reads_of),
        }
    }

    /// How long this process's threads waited, ready to run, since `before`.
    pub fn client_waited_since(&self, before: &CpuReading) -> Option<Duration> {
        Some(self.client_waited?.saturating_sub(before.client_waited?))
    }

    /// How long the server's main thread waited, ready to run, since `before`.
    pub fn server_waited_since(&self, before: &CpuReading) -> Option<Duration> {
        Some(self.server_waited?.saturating_sub(before.server_waited?))
    }

    /// How many `read`-family calls the server's process made since `before`.
    pub fn server_reads_since(&self, before: &CpuReading) -> Option<u64> {
        Some(self.server_reads?.saturating_sub(before.server_reads?))
    }

    /// CPU this process used since `before`.
    pub fn client_since(&self, before: &CpuReading) -> Option<Duration> {
        Some(self.client?.saturating_sub(before.client?))
    }

    /// How many times this process's threads were put on a CPU since `before`.
    pub fn client_switches_since(&self, before: &CpuReading) -> Option<u64> {
        Some(
            self.client_switches?
                .saturating_sub(before.client_switches?),
        )
    }

    /// CPU the server's processes used since `before`: per process alive now, what it used
    /// since then (all of it, for a process started since). Processes that ended in
    /// between are not counted.
    pub fn server_since(&self, before: &CpuReading) -> Option<Duration> {
        if self.server.is_empty() {
            return None;
        }
        Some(
            self.server
                .iter()
                .map(|(pid, now)| {
                    now.saturating_sub(before.server.get(pid).copied().unwrap_or_default())
                })
                .sum(),
        )
    }
}

/// The time `pid`'s threads ran: the first field of each `/proc/<pid>/task/*/schedstat`
/// (nanoseconds), or else user + system time of `/proc/<pid>/stat` (whole clock ticks,
/// too coarse for a short window of a process that runs little).
fn cpu_of(pid: &str) -> Option<Duration> {
    schedstat_of(pid).or_else(|| stat_of(pid))
}

fn schedstat_of(pid: &str) -> Option<Duration> {
    schedstat_sum(pid, 0).map(Duration::from_nanos)
}

/// How many times `pid`'s threads were put on a CPU: the third field of each
/// `/proc/<pid>/task/*/schedstat`.
fn switches_of(pid: &str) -> Option<u64> {
    schedstat_sum(pid, 2)
}

/// Field `field` of each `/proc/<pid>/task/*/schedstat`, summed over the threads.
fn schedstat_sum(pid: &str, field: usize) -> Option<u64> {
    let mut sum = 0u64;
    let mut read = false;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        if let Some(value) = text
            .split_whitespace()
            .nth(field)
            .and_then(|n| n.parse::<u64>().ok())
        {
            sum += value;
            read = true;
        }
    }
    read.then_some(sum)
}

/// The second field of `/proc/<pid>/task/<pid>/schedstat`: how long the process's main
/// thread waited on a run queue.
fn main_thread_waited(pid: u32) -> Option<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/schedstat")).ok()?;
    let ns = text.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(Duration::from_nanos(ns))
}

/// `syscr` of `/proc/<pid>/io`: the `read`-family calls of every thread of the process.
fn reads_of(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|line| line.strip_prefix("syscr:"))
        .and_then(|n| n.trim().parse().ok())
}

/// User + system time of `/proc/<pid>/stat`.
fn stat_of(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = fields_after_comm(&stat)?;
    // Fields 14 and 15 of stat(5): utime, stime; the 12th and 13th after the comm.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis(
        (utime + stime) * 1_000 / TICKS_PER_SEC,
    ))
}

/// The fields after `(comm)`, which may hold spaces and parentheses.
fn fields_after_comm(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

/// The CPU time of `root` and each of its descendants.
fn tree_cpu(root: u32) -> HashMap<u32, Duration> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    let mut parents = HashMap::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 of stat(5): the parent's pid, the second after the comm.
        if let Some(ppid) =
            fields_after_comm(&stat).and_then(|f| f.get(1).and_then(|p| p.parse::<u32>().ok()))
        {
            parents.insert(pid, ppid);
        }
    }
    let mut tree = HashMap::new();
    for &pid in parents.keys() {
        let mut at = pid;
        let mut depth = 0;
        while at != root && depth < 64 {
            match parents.get(&at) {
                Some(&parent) if parent != 0 => at = parent,
                _ => break,
            }
            depth += 1;
        }
        if at == root {
            if let Some(cpu) = cpu_of(&pid.to_string()) {
                tree.insert(pid, cpu);
            }
        }
    }
    tree
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fields_after_a_comm_with_spaces_and_parentheses_are_found() {
        let stat = "42 (tokio-rt (x) y) S 7 42 42 0 -1 0 0 0 0 0 250 30 0 0";
        let fields = fields_after_comm(stat).unwrap();
        assert_eq!(fields[0], "S");
        assert_eq!(fields[1], "7");
        assert_eq!(fields[11], "250");
        assert_eq!(fields[12], "30");
    }

    #[test]
    fn this_process_and_its_own_tree_are_read_on_linux() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let reading = CpuReading::now(Some(std::process::id()));
        assert!(reading.client.is_some());
        assert!(reading.server.contains_key(&std::process::id()));
        assert_eq!(
            reading.client_since(&reading),
            Some(Duration::ZERO),
            "no time passes between a reading and itself"
        );
        assert!(reading.client_waited.is_some());
        assert!(reading.server_waited.is_some());
        std::fs::read("/proc/self/stat").unwrap();
        let later = CpuReading::now(Some(std::process::id()));
        assert!(
            later.server_reads_since(&reading).is_some_and(|n| n >= 1),
            "a read made between two readings is counted"
        );
    }
}
