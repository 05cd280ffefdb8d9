//! What the Redis server spends per call of distlock's scripts and of the raw commands
//! they replace, read from `INFO commandstats` of the server the run started.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use capacity::full_semaphore::CommandStats;
use capacity::load::{self, Keys};
use capacity::scenarios::{
    FenceRetentionMemory, LoadedCycleCost, RedisServerCost, calls_of_all, usec_of, usec_per_call,
    used_cpu,
};
use distlock_core::{LockBackend, LockKey};
use tokio::time::Instant;

use crate::BenchError;
use crate::subjects::{BenchKey, Servers, Subject, TTL};

/// The command statistics of the Redis server a run started.
pub struct RedisCommandStats<'a>(pub &'a Servers);

#[async_trait]
impl CommandStats for RedisCommandStats<'_> {
    async fn reset(&self) -> Result<(), BenchError> {
        self.0
            .redis_command(&["CONFIG", "RESETSTAT"])
            .await
            .map(drop)
    }

    async fn read(&self) -> Result<String, BenchError> {
        self.0.redis_command(&["INFO", "commandstats"]).await
    }
}

/// Rounds of the fresh-key cycle measurement, the subjects alternating within each.
const CYCLE_ROUNDS: usize = 5;

/// Measures [`RedisServerCost`] with `calls` sequential calls of each kind, resetting the
/// server's statistics between kinds so that each number is for one command alone.
pub async fn redis_server_cost(
    servers: &Servers,
    redis: &Arc<dyn Subject>,
    raw_set_nx: &Arc<dyn Subject>,
    rslock: &Arc<dyn Subject>,
    calls: usize,
) -> Result<RedisServerCost, BenchError> {
    let backend = redis.backend().ok_or_else(|| BenchError::Unexpected {
        subject: "redis",
        detail: "the Redis subject has no backend".into(),
    })?;
    let lock_err = |source| BenchError::Lock {
        subject: "redis",
        source,
    };
    let missing = |what: &str| BenchError::Unexpected {
        subject: "redis",
        detail: format!("INFO commandstats has no {what}"),
    };
    let keys = (0..calls)
        .map(|i| LockKey::new(format!("bench:redis:server-cost:{i}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(lock_err)?;

    servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
    let mut leases = Vec::with_capacity(calls);
    for key in &keys {
        leases.extend(backend.acquire(key, TTL).await.map_err(lock_err)?);
    }
    let info = servers.redis_command(&["INFO", "commandstats"]).await?;
    let acquire_script_us = usec_per_call(&info, "evalsha").ok_or_else(|| missing("evalsha"))?;

    servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
    for lease in &leases {
        backend.release(lease).await.map_err(lock_err)?;
    }
    let info = servers.redis_command(&["INFO", "commandstats"]).await?;
    let release_script_us = usec_per_call(&info, "evalsha").ok_or_else(|| missing("evalsha"))?;

    let key = BenchKey::new("bench:redis:server-cost:raw")?;
    servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
    for _ in 0..calls {
        raw_set_nx.cycle(&key).await?;
    }
    let info = servers.redis_command(&["INFO", "commandstats"]).await?;
    let set_nx_us = usec_per_call(&info, "set").ok_or_else(|| missing("set"))?;
    let del_us = usec_per_call(&info, "del").ok_or_else(|| missing("del"))?;

    // Whole cycles on fresh keys, each subject counted by the commands it sends itself,
    // in alternation over several rounds (the order turning each round).
    let subjects = [
        (redis, &["evalsha"][..]),
        (rslock, &["set", "evalsha", "eval"][..]),
        (raw_set_nx, &["set", "del"][..]),
    ];
    let mut cycle_rounds = Vec::with_capacity(CYCLE_ROUNDS);
    for round in 0..CYCLE_ROUNDS {
        let mut measured = Vec::with_capacity(subjects.len());
        for i in 0..subjects.len() {
            let (subject, sent) = subjects[(round + i) % subjects.len()];
            let name = subject.id().slug();
            let keys = (0..calls)
                .map(|i| BenchKey::new(format!("bench:redis:cycle-cost:{name}:{round}:{i}")))
                .collect::<Result<Vec<_>, _>>()?;
            servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
            for key in &keys {
                subject.cycle(key).await?;
            }
            let info = servers.redis_command(&["INFO", "commandstats"]).await?;
            measured.push((subject.id(), usec_of(&info, sent) / calls as f64));
        }
        cycle_rounds.push(measured);
    }
    let cycle_us = subjects
        .iter()
        .map(|(subject, _)| {
            let mut us: Vec<f64> = cycle_rounds
                .iter()
                .flatten()
                .filter(|(s, _)| *s == subject.id())
                .map(|(_, us)| *us)
                .collect();
            us.sort_by(f64::total_cmp);
            (subject.id(), us[us.len() / 2])
        })
        .collect();

    Ok(RedisServerCost {
        calls,
        acquire_script_us,
        release_script_us,
        set_nx_us,
        del_us,
        cycle_us,
        cycle_rounds,
        loaded: Vec::new(),
        retention: None,
    })
}

/// Runs `a` and `b` in alternation, `rounds` times each, with `concurrency` tasks on
/// per-task keys for `duration` a run, and measures what the server spent per cycle.
pub async fn loaded_cycle_costs(
    servers: &Servers,
    a: &Arc<dyn Subject>,
    b: &Arc<dyn Subject>,
    concurrency: usize,
    rounds: usize,
    duration: Duration,
) -> Result<Vec<LoadedCycleCost>, BenchError> {
    let mut out = Vec::with_capacity(2 * rounds);
    for round in 0..rounds.max(1) {
        let order = if round % 2 == 0 { [a, b] } else { [b, a] };
        for subject in order {
            out.push(loaded_cycle_cost(servers, subject, concurrency, duration).await?);
        }
    }
    Ok(out)
}

/// One closed-loop run of `subject` (no warm-up: every cycle the server saw is counted),
/// with the server's CPU time and commands per cycle.
pub async fn loaded_cycle_cost(
    servers: &Servers,
    subject: &Arc<dyn Subject>,
    concurrency: usize,
    duration: Duration,
) -> Result<LoadedCycleCost, BenchError> {
    let missing = || BenchError::Unexpected {
        subject: "redis",
        detail: "INFO cpu has no used_cpu_user / used_cpu_sys".into(),
    };
    servers.redis_command(&["CONFIG", "RESETSTAT"]).await?;
    let before = used_cpu(&servers.redis_command(&["INFO", "cpu"]).await?).ok_or_else(missing)?;
    let sample = load::closed_loop(
        subject.clone(),
        concurrency,
        Keys::PerTask,
        Duration::ZERO,
        duration,
    )
    .await?;
    let after = used_cpu(&servers.redis_command(&["INFO", "cpu"]).await?).ok_or_else(missing)?;
    let commands = calls_of_all(&servers.redis_command(&["INFO", "commandstats"]).await?);
    // The INFO call that read `before` is counted too: one command, negligible.
    let cycles = sample.ops.max(1) as f64;
    Ok(LoadedCycleCost {
        subject: subject.id(),
        concurrency,
        cycles_per_sec: sample.ops_per_sec(),
        cpu_us_per_cycle: (after - before) * 1e6 / cycles,
        commands_per_cycle: commands / cycles,
    })
}

/// `used_memory` of the Redis server, in bytes.
async fn used_memory(servers: &Servers) -> Result<u64, BenchError> {
    let info = servers.redis_command(&["INFO", "memory"]).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| BenchError::Unexpected {
            subject: "redis",
            detail: "INFO memory has no used_memory".into(),
        })
}

/// Locks and releases `keys` distinct keys once each (1,000 a batch), then waits
/// `RETENTION`: `used_memory` should come back to where it started. The backend keeps
/// nothing per key after a release (tokens count from one high-water key, not a counter
/// per key), so nothing should be left at once; the wait stays so the report compares with runs of older versions,
/// which kept a counter per key until its retention ran out. Gives up waiting after two
/// minutes and reports what is left.
pub async fn fence_retention_memory(
    servers: &Servers,
    keys: usize,
) -> Result<FenceRetentionMemory, BenchError> {
    const RETENTION: Duration = Duration::from_secs(2);
    const LEASE: Duration = Duration::from_secs(1);
    const WITHIN: u64 = 1 << 20;
    let lock_err = |source| BenchError::Lock {
        subject: "redis",
        source,
    };
    let backend = lock_redis::RedisBackend::builder()
        .url(servers.redis_url()?)
        .build()
        .await
        .map_err(lock_err)?;
    let before = used_memory(servers).await?;
    for start in (0..keys).step_by(1_000) {
        let batch = (start..(start + 1_000).min(keys))
            .map(|i| LockKey::new(format!("bench:retention:{i}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(lock_err)?;
        let held: Vec<_> = backend
            .acquire_many(&batch, LEASE)
            .await
            .map_err(lock_err)?
            .into_iter()
            .flatten()
            .collect();
        backend.release_many(&held).await.map_err(lock_err)?;
    }
    let after_release = used_memory(servers).await?;
    let released = Instant::now();
    tokio::time::sleep(RETENTION).await;
    let mut after_retention = used_memory(servers).await?;
    while after_retention > before + WITHIN && released.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after_retention = used_memory(servers).await?;
    }
    Ok(FenceRetentionMemory {
        keys,
        retention: RETENTION,
        before,
        after_release,
        after_retention,
        expired_within: released.elapsed().saturating_sub(RETENTION),
    })
}
