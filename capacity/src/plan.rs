//! How much a capacity run measures: the concurrency levels, the durations, the sizes
//! and the rounds of each measurement, for the full report or a quick check.

use std::time::Duration;

/// How much a run measures.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The concurrency levels of the sweep.
    pub levels: Vec<usize>,
    /// Unrecorded time before each measurement.
    pub warmup: Duration,
    /// Recorded time of each measurement.
    pub duration: Duration,
    /// Tasks contending for one key (the contended sweep and the handoff measurement).
    pub contended_tasks: usize,
    /// Handoffs measured per backend, with release notifications and without.
    pub handoffs: u64,
    /// Keys per batch call.
    pub batch_sizes: Vec<usize>,
    /// Batch calls per size (the median is reported).
    pub batch_reps: usize,
    /// Alternating rounds of each target pair and of the Redis pairs shared and pinned
    /// (each round measures every side for a third of `duration`).
    pub pair_rounds: usize,
    /// The sizes of the full semaphore measured, in permits
    /// ([`crate::full_semaphore`]).
    pub full_permits: Vec<u32>,
    /// The tasks that wait on the full semaphore, or are refused.
    pub full_tasks: usize,
    /// Guards held for the memory measurement.
    pub guards: usize,
    /// The TTL of those guards (the watchdog renews at a third of it).
    pub guard_ttl: Duration,
}

impl Plan {
    /// The full report: about half an hour with every store on 2 cores (29 minutes on
    /// 2026-12-07: the pairs, the permit and full-semaphore rounds, a million one-off keys).
    pub fn full() -> Self {
        Self {
            levels: vec![1, 4, 16, 64],
            warmup: Duration::from_millis(500),
            duration: Duration::from_secs(3),
            contended_tasks: 16,
            handoffs: 300,
            batch_sizes: vec![100, 1_000],
            // A Redis batch of 1,000 takes about 2 ms, and single ones vary by ±20 % on a
            // shared machine: the median of 5 moved by as much as a change measured.
            batch_reps: 25,
            pair_rounds: 9,
            full_permits: vec![1, 64, 1024],
            full_tasks: 64,
            guards: 100_000,
            guard_ttl: Duration::from_secs(3),
        }
    }

    /// Tiny sizes that only prove the report still works (CI).
    pub fn quick() -> Self {
        Self {
            levels: vec![1, 4, 16, 64],
            warmup: Duration::from_millis(20),
            duration: Duration::from_millis(100),
            contended_tasks: 4,
            handoffs: 20,
            batch_sizes: vec![100],
            batch_reps: 1,
            pair_rounds: 2,
            // A full semaphore of 1024 is 1024 round trips per refusal where the store is
            // asked slot by slot: the quick run only checks that the rows are written.
            full_permits: vec![1, 16],
            full_tasks: 4,
            guards: 10_000,
            guard_ttl: Duration::from_millis(300),
        }
    }
}
