//! What the nemesis did to a run, and when: the workers' processes it paused, resumed,
//! killed and started again, and the restarts of a store the run started itself. The
//! checker takes the deaths from it (a killed process holds nothing from its death on),
//! and a violation's report shows the actions on the workers involved beside their
//! events, so that a reader sees, say, a kill against a release.

use super::check::Deaths;

/// One action, at `at` (ns of the monotonic clock, as the workers' events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub at: u64,
    pub kind: FaultKind,
}

/// What was done; a worker's process is its place (`worker`) and which of the processes
/// started there (`incarnation`, 0 for the first), as in its events' records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The process was stopped (SIGSTOP).
    Pause { worker: u32, incarnation: u32 },
    /// A stopped process was let go on (SIGCONT).
    Resume { worker: u32, incarnation: u32 },
    /// The process was killed (SIGKILL), whatever it held.
    Kill { worker: u32, incarnation: u32 },
    /// The process was killed at the run's end: told to stop, it did not exit in time.
    KillAtEnd { worker: u32, incarnation: u32 },
    /// A new process was started in a killed one's place.
    Restart { worker: u32, incarnation: u32 },
    /// The store the run started was killed (SIGKILL) and started again; it answered
    /// again at `up`.
    StoreRestart { up: u64 },
}

impl FaultKind {
    /// The worker process the action was done to; `None` for the store.
    pub fn process(&self) -> Option<(u32, u32)> {
        match *self {
            FaultKind::Pause {
                worker,
                incarnation,
            }
            | FaultKind::Resume {
                worker,
                incarnation,
            }
            | FaultKind::Kill {
                worker,
                incarnation,
            }
            | FaultKind::KillAtEnd {
                worker,
                incarnation,
            }
            | FaultKind::Restart {
                worker,
                incarnation,
            } => Some((worker, incarnation)),
            FaultKind::StoreRestart { .. } => None,
        }
    }

    /// Whether the action ended the process.
    pub fn is_death(&self) -> bool {
        matches!(self, FaultKind::Kill { .. } | FaultKind::KillAtEnd { .. })
    }
}

/// When each killed process died, for the checker.
pub fn deaths(faults: &[Fault]) -> Deaths {
    faults
        .iter()
        .filter(|f| f.kind.is_death())
        .filter_map(|f| f.kind.process().map(|p| (p, f.at)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deaths_are_the_kills_and_nothing_else() {
        let faults = [
            Fault {
                at: 1,
                kind: FaultKind::Pause {
                    worker: 0,
                    incarnation: 0,
                },
            },
            Fault {
                at: 2,
                kind: FaultKind::Kill {
                    worker: 1,
                    incarnation: 0,
                },
            },
            Fault {
                at: 3,
                kind: FaultKind::Restart {
                    worker: 1,
                    incarnation: 1,
                },
            },
            Fault {
                at: 4,
                kind: FaultKind::StoreRestart { up: 5 },
            },
            Fault {
                at: 6,
                kind: FaultKind::KillAtEnd {
                    worker: 1,
                    incarnation: 1,
                },
            },
        ];
        assert_eq!(deaths(&faults), Deaths::from([((1, 0), 2), ((1, 1), 6)]));
    }
}
