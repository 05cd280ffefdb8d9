//! Closed-loop load: `concurrency` tasks run cycles of one subject back to back, each on
//! its own key (uncontended) or all on one key (contended), and every cycle's latency goes
//! into an HDR histogram.
//!
//! Closed loop means a task sends its next request only when the previous one answered,
//! as a worker pool does, so throughput at concurrency `c` is what `c` workers get.

use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use crate::error::BenchError;
use crate::subject::{BenchKey, Subject, SubjectId};

/// Which keys the tasks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    /// One key per task: no acquire is ever refused (a refusal is an error).
    PerTask,
    /// One key for all tasks: they contend, and refusals are counted.
    Shared,
}

/// The result of one load run.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The subject measured.
    pub subject: SubjectId,
    /// Tasks running at once.
    pub concurrency: usize,
    /// Cycles completed in the measured window.
    pub ops: u64,
    /// Cycles whose acquire took the key.
    pub acquired: u64,
    /// From the start of the measured window to the end of the last cycle.
    pub elapsed: Duration,
    /// Whole-cycle latency, in nanoseconds.
    pub cycle: Histogram<u64>,
    /// Acquire-step latency, in nanoseconds.
    pub acquire: Histogram<u64>,
}

impl Sample {
    /// Cycles per second.
    pub fn ops_per_sec(&self) -> f64 {
        per_sec(self.ops, self.elapsed)
    }

    /// Successful acquires per second.
    pub fn acquired_per_sec(&self) -> f64 {
        per_sec(self.acquired, self.elapsed)
    }

    /// The cycle latency at quantile `q` (0..=1), in microseconds.
    pub fn cycle_us(&self, q: f64) -> f64 {
        self.cycle.value_at_quantile(q) as f64 / 1_000.0
    }

    /// The acquire latency at quantile `q` (0..=1), in microseconds.
    pub fn acquire_us(&self, q: f64) -> f64 {
        self.acquire.value_at_quantile(q) as f64 / 1_000.0
    }
}

fn per_sec(count: u64, elapsed: Duration) -> f64 {
    if elapsed.is_zero() {
        0.0
    } else {
        count as f64 / elapsed.as_secs_f64()
    }
}

/// A histogram from 1 ns to one minute with 3 significant digits.
pub fn new_histogram() -> Result<Histogram<u64>, BenchError> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| BenchError::Unexpected {
        subject: "histogram",
        detail: e.to_string(),
    })
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// The keys of a run: `bench:<subject>:<tag>:<task>` per task, or one shared key.
pub fn keys_for(
    subject: SubjectId,
    tag: &str,
    concurrency: usize,
    keys: Keys,
) -> Result<Vec<BenchKey>, BenchError> {
    (0..concurrency)
        .map(|task| match keys {
            Keys::PerTask => BenchKey::new(format!("bench:{}:{tag}:{task}", subject.slug())),
            Keys::Shared => BenchKey::new(format!("bench:{}:{tag}:shared", subject.slug())),
        })
        .collect()
}

struct TaskResult {
    ops: u64,
    acquired: u64,
    cycle: Histogram<u64>,
    acquire: Histogram<u64>,
    finished: Instant,
}

/// Runs `concurrency` tasks for `warmup` (not recorded), then for `duration`, and returns
/// what the measured window saw. Cycles that start inside the window are counted; the
/// window ends when the last of them finishes. Every task measures at least one cycle: a
/// task whose cycles outlast the window (a store stalled on a slow disk) keeps going until
/// one started after the warm-up has finished, so the level reports its rate over the
/// longer window instead of no progress at all.
pub async fn closed_loop(
    subject: Arc<dyn Subject>,
    concurrency: usize,
    keys: Keys,
    warmup: Duration,
    duration: Duration,
) -> Result<Sample, BenchError> {
    let task_keys = keys_for(subject.id(), &format!("c{concurrency}"), concurrency, keys)?;
    closed_loop_on(subject, task_keys, keys, warmup, duration).await
}

/// [`closed_loop`] on the keys given, one task per key (`task_keys` holds the same key
/// many times for [`Keys::Shared`]): for measurements that must know the keys, such as
/// the keys some other task waits for.
pub async fn closed_loop_on(
    subject: Arc<dyn Subject>,
    task_keys: Vec<BenchKey>,
    keys: Keys,
    warmup: Duration,
    duration: Duration,
) -> Result<Sample, BenchError> {
    let id = subject.id();
    let concurrency = task_keys.len();
    let measure_from = Instant::now() + warmup;
    let measure_until = measure_from + duration;
    let tasks: Vec<_> = task_keys
        .into_iter()
        .map(|key| {
            let subject = subject.clone();
            tokio::spawn(async move {
                let mut result = TaskResult {
                    ops: 0,
                    acquired: 0,
                    cycle: new_histogram()?,
                    acquire: new_histogram()?,
                    finished: Instant::now(),
                };
                loop {
                    let start = Instant::now();
                    if start >= measure_until && result.ops > 0 {
                        break;
                    }
                    let cycle = subject.cycle(&key).await?;
                    if keys == Keys::PerTask && !cycle.acquired {
                        return Err(BenchError::Unexpected {
                            subject: id.slug(),
                            detail: format!(
                                "an uncontended acquire of {} was refused",
                                key.as_str()
                            ),
                        });
                    }
                    if start >= measure_from {
                        let end = Instant::now();
                        result.ops += 1;
                        result.acquired += u64::from(cycle.acquired);
                        result.cycle.saturating_record(nanos(end - start));
                        result.acquire.saturating_record(nanos(cycle.acquire));
                        result.finished = end;
                    }
                    // A backend that never waits (memory) would otherwise keep its worker
                    // thread and starve the other tasks: the level would not run at the
                    // concurrency it reports.
                    tokio::task::consume_budget().await;
                }
                Ok::<_, BenchError>(result)
            })
        })
        .collect();

    let mut sample = Sample {
        subject: id,
        concurrency,
        ops: 0,
        acquired: 0,
        elapsed: Duration::ZERO,
        cycle: new_histogram()?,
        acquire: new_histogram()?,
    };
    let mut last = measure_from;
    let mut failure = None;
    for task in tasks {
        match task.await {
            Ok(Ok(r)) => {
                sample.ops += r.ops;
                sample.acquired += r.acquired;
                // Same bounds on both sides, so adding cannot fail.
                let _ = sample.cycle.add(&r.cycle);
                let _ = sample.acquire.add(&r.acquire);
                last = last.max(r.finished);
            }
            Ok(Err(e)) => failure = failure.or(Some(e)),
            Err(join) => {
                failure = failure.or(Some(BenchError::Unexpected {
                    subject: id.slug(),
                    detail: format!("a load task failed: {join}"),
                }))
            }
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    sample.elapsed = last.saturating_duration_since(measure_from);
    Ok(sample)
}

/// Runs `total` cycles split over `concurrency` tasks (each on its own key) and returns the
/// wall time: the shape criterion's `iter_custom` asks for.
pub async fn fixed_cycles(
    subject: Arc<dyn Subject>,
    concurrency: usize,
    keys: Keys,
    total: u64,
) -> Result<Duration, BenchError> {
    let id = subject.id();
    let task_keys = keys_for(id, &format!("fixed{concurrency}"), concurrency, keys)?;
    let tasks_n = concurrency.max(1) as u64;
    let start = Instant::now();
    let tasks: Vec<_> = task_keys
        .into_iter()
        .enumerate()
        .map(|(i, key)| {
            let subject = subject.clone();
            // Exactly `total` cycles in all: the first `total % tasks` tasks do one more.
            let mine = total / tasks_n + u64::from((i as u64) < total % tasks_n);
            tokio::spawn(async move {
                for _ in 0..mine {
                    subject.cycle(&key).await?;
                }
                Ok::<_, BenchError>(())
            })
        })
        .collect();
    for task in tasks {
        task.await.map_err(|join| BenchError::Unexpected {
            subject: id.slug(),
            detail: format!("a load task failed: {join}"),
        })??;
    }
    Ok(start.elapsed())
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::*;
    use crate::subject::Cycle;

    /// A subject whose every cycle takes `took`.
    struct Slow {
        took: Duration,
    }

    #[async_trait]
    impl Subject for Slow {
        fn id(&self) -> SubjectId {
            SubjectId::Memory
        }

        async fn cycle(&self, _key: &BenchKey) -> Result<Cycle, BenchError> {
            tokio::time::sleep(self.took).await;
            Ok(Cycle {
                acquire: self.took / 2,
                acquired: true,
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn cycles_longer_than_the_window_are_still_measured_once_per_task() {
        // Each task's first cycle spans the warm-up and the whole window; without the
        // at-least-one rule the next would start after the window and nothing be counted.
        let slow = Arc::new(Slow {
            took: Duration::from_millis(300),
        });
        let sample = closed_loop(
            slow,
            16,
            Keys::PerTask,
            Duration::from_millis(20),
            Duration::from_millis(100),
        )
        .await
        .unwrap();
        assert_eq!(sample.ops, 16, "cycles measured");
        assert_eq!(sample.acquired, 16);
        // The rate is over the window it took: 16 cycles ending 600 ms after the start,
        // 580 ms after the warm-up.
        assert_eq!(sample.elapsed, Duration::from_millis(580));
    }
}
