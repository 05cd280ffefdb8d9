//! Pinning a server and this process to CPUs of their own (Linux `sched_setaffinity`), as
//! they run when deployed: redis-server on one core, the client's runtime on another,
//! instead of both fighting for the same cores.
//!
//! Every thread of both processes is pinned (`/proc/<pid>/task`); threads this process
//! starts while pinned inherit its CPU. [`Pinned`] puts back the CPUs each thread was
//! allowed before, when dropped.

/// The two CPUs of a pinned run: the first two this process may run on, the server on the
/// first, the client on the second; or why there are none (fewer than two CPUs, not Linux).
pub fn pick() -> Result<(usize, usize), String> {
    imp::pick()
}

/// Pins every thread of `server` to `server_cpu` and every thread of this process to
/// `client_cpu` until the returned guard is dropped.
pub fn pin(server: u32, server_cpu: usize, client_cpu: usize) -> Result<Pinned, String> {
    imp::pin(server, server_cpu, client_cpu)
}

/// Pins every thread of `server` to `server_cpu`, this process's first tokio worker
/// thread (`tokio-rt-worker`) beside it, and every other thread of this process to
/// `client_cpu`: one of the places a scheduler may put three busy threads on two cores,
/// held still, to measure what it costs a client (docs/DESIGN.md, "Shared, 64 tasks").
pub fn pin_beside(server: u32, server_cpu: usize, client_cpu: usize) -> Result<Pinned, String> {
    imp::pin_beside(server, server_cpu, client_cpu)
}

/// Pinned threads and the CPUs each was allowed before; dropping it restores them.
#[derive(Debug)]
pub struct Pinned {
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    before: Vec<imp::Saved>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        imp::restore(&self.before);
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    use nix::unistd::Pid;

    use super::Pinned;

    /// One process's threads and the CPUs they were allowed before pinning; `main` is the
    /// process's own set, given to threads it started while pinned.
    #[derive(Debug)]
    pub struct Saved {
        pid: u32,
        main: CpuSet,
        threads: Vec<(i32, CpuSet)>,
    }

    pub fn pick() -> Result<(usize, usize), String> {
        let set =
            sched_getaffinity(Pid::from_raw(0)).map_err(|e| format!("sched_getaffinity: {e}"))?;
        let allowed: Vec<usize> = (0..CpuSet::count())
            .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
            .collect();
        match allowed[..] {
            [server, client, ..] => Ok((server, client)),
            _ => Err(format!(
                "this process may run on {} CPU(s); pinning the server and the client apart \
                 needs 2",
                allowed.len()
            )),
        }
    }

    /// The threads of `pid` that are tokio runtime workers (named `tokio-rt-worker`).
    pub(super) fn runtime_workers(pid: u32) -> Vec<i32> {
        threads(pid)
            .into_iter()
            .filter(|tid| {
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                    .is_ok_and(|name| name.trim_end() == "tokio-rt-worker")
            })
            .collect()
    }

    pub(super) fn threads(pid: u32) -> Vec<i32> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
            .collect()
    }

    /// Pins each thread of `pid` to the CPU `cpu_of` picks for its id; every CPU is
    /// checked before the first thread is pinned.
    pub(super) fn pin_process(pid: u32, cpu_of: impl Fn(i32) -> usize) -> Result<Saved, String> {
        let main = sched_getaffinity(Pid::from_raw(pid as i32))
            .map_err(|e| format!("reading the CPUs of process {pid}: {e}"))?;
        let placed = threads(pid)
            .into_iter()
            .map(|tid| {
                let cpu = cpu_of(tid);
                let mut only = CpuSet::new();
                only.set(cpu).map_err(|e| format!("CPU {cpu}: {e}"))?;
                Ok((tid, cpu, only))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let mut saved = Saved {
            pid,
            main,
            threads: Vec::new(),
        };
        for (tid, cpu, only) in placed {
            // A thread that ended since the listing has nothing to pin.
            let Ok(before) = sched_getaffinity(Pid::from_raw(tid)) else {
                continue;
            };
            if let Err(e) = sched_setaffinity(Pid::from_raw(tid), &only) {
                restore(std::slice::from_ref(&saved));
                return Err(format!(
                    "pinning thread {tid} of process {pid} to CPU {cpu}: {e}"
                ));
            }
            saved.threads.push((tid, before));
        }
        Ok(saved)
    }

    pub fn pin(server: u32, server_cpu: usize, client_cpu: usize) -> Result<Pinned, String> {
        pin_both(server, server_cpu, |_| client_cpu)
    }

    pub fn pin_beside(server: u32, server_cpu: usize, client_cpu: usize) -> Result<Pinned, String> {
        let beside = runtime_workers(std::process::id())
            .into_iter()
            .min()
            .ok_or("this process has no tokio worker thread to put beside the server")?;
        pin_both(server, server_cpu, |tid| {
            if tid == beside {
                server_cpu
            } else {
                client_cpu
            }
        })
    }

    /// Pins `server` to `server_cpu` and this process's threads as `cpu_of` picks.
    fn pin_both(
        server: u32,
        server_cpu: usize,
        cpu_of: impl Fn(i32) -> usize,
    ) -> Result<Pinned, String> {
        let server = pin_process(server, |_| server_cpu)?;
        match pin_process(std::process::id(), cpu_of) {
            Ok(client) => Ok(Pinned {
                before: vec![server, client],
            }),
            Err(e) => {
                restore(&[server]);
                Err(e)
            }
        }
    }

    /// Restores in the reverse order of pinning, so a process pinned twice gets back
    /// what it had before the first.
    pub fn restore(before: &[Saved]) {
        for saved in before.iter().rev() {
            for tid in threads(saved.pid) {
                let set = saved
                    .threads
                    .iter()
                    .find(|(t, _)| *t == tid)
                    .map_or(&saved.main, |(_, set)| set);
                // A thread that ended in between needs nothing back.
                let _ = sched_setaffinity(Pid::from_raw(tid), set);
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::Pinned;

    #[derive(Debug)]
    pub struct Saved;

    pub fn pick() -> Result<(usize, usize), String> {
        Err("pinning to CPUs is implemented on Linux only".into())
    }

    pub fn pin(_: u32, _: usize, _: usize) -> Result<Pinned, String> {
        Err(pick().unwrap_err())
    }

    pub fn pin_beside(_: u32, _: usize, _: usize) -> Result<Pinned, String> {
        Err(pick().unwrap_err())
    }

    pub fn restore(_: &[Saved]) {}
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use nix::sched::{CpuSet, sched_getaffinity};
    use nix::unistd::Pid;

    #[test]
    fn pinning_this_process_to_itself_restores_every_thread() {
        let Ok((first, second)) = super::pick() else {
            return; // One CPU: nothing to pin apart.
        };
        let before = sched_getaffinity(Pid::from_raw(0)).unwrap();
        let me = std::process::id();
        {
            let _pinned = super::pin(me, first, second).unwrap();
            let now = sched_getaffinity(Pid::from_raw(0)).unwrap();
            assert!(now.is_set(second).unwrap());
            assert!(!now.is_set(first).unwrap());
        }
        assert_eq!(sched_getaffinity(Pid::from_raw(0)).unwrap(), before);
    }

    #[test]
    fn a_cpu_that_cannot_be_named_pins_no_thread() {
        let me = std::process::id();
        // Threads of its own, so that the thread given the bad CPU comes after others.
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || stopped.recv());
        let threads = super::imp::threads(me);
        assert!(threads.len() >= 2, "{threads:?}");
        let cpus = |tid: i32| sched_getaffinity(Pid::from_raw(tid)).unwrap();
        let before: Vec<_> = threads.iter().map(|&tid| cpus(tid)).collect();
        let last = *threads.last().unwrap();
        let first_cpu = super::pick().map_or(0, |(first, _)| first);
        let failed = super::imp::pin_process(me, |tid| {
            if tid == last {
                CpuSet::count()
            } else {
                first_cpu
            }
        });
        assert!(failed.is_err(), "CPU {} does not exist", CpuSet::count());
        let after: Vec<_> = threads.iter().map(|&tid| cpus(tid)).collect();
        assert_eq!(after, before, "no thread pinned by a call that failed");
        stop.send(()).unwrap();
        sleeper.join().unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn beside_the_server_is_the_first_worker_and_only_it() {
        let Ok((first, second)) = super::pick() else {
            return; // One CPU: nothing to pin apart.
        };
        let me = std::process::id();
        let workers = || super::imp::runtime_workers(me);
        // The runtime starts its workers' threads as it starts, not before it runs this.
        let started = std::time::Instant::now();
        while workers().len() < 2 && started.elapsed() < std::time::Duration::from_secs(10) {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let workers = workers();
        assert_eq!(workers.len(), 2, "{workers:?}");
        let cpus = |tid: i32| sched_getaffinity(Pid::from_raw(tid)).unwrap();
        let before: Vec<_> = workers.iter().map(|&tid| cpus(tid)).collect();
        let beside = *workers.iter().min().unwrap();
        {
            // This process as its own server: pinned to `first`, then its threads placed.
            let _pinned = super::pin_beside(me, first, second).unwrap();
            for &tid in &workers {
                let (on, off) = if tid == beside {
                    (first, second)
                } else {
                    (second, first)
                };
                assert!(cpus(tid).is_set(on).unwrap(), "thread {tid} on CPU {on}");
                assert!(
                    !cpus(tid).is_set(off).unwrap(),
                    "thread {tid} not on CPU {off}"
                );
            }
        }
        let after: Vec<_> = workers.iter().map(|&tid| cpus(tid)).collect();
        assert_eq!(after, before, "every worker's CPUs given back");
    }
}
