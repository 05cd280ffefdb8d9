//! What the Redis server spends per call of distlock's scripts and of the raw commands
//! they replace, read from `INFO commandstats` of the server the run started.

use std::sync::Arc;

use capacity::scenarios::{RedisServerCost, usec_per_call};
use lock_api::LockKey;

use crate::BenchError;
use crate::subjects::{BenchKey, Servers, Subject, TTL};

/// Measures [`RedisServerCost`] with `calls` sequential calls of each kind, resetting the
/// server's statistics between kinds so that each number is for one command alone.
pub async fn redis_server_cost(
    servers: &Servers,
    redis: &Arc<dyn Subject>,
    raw_set_nx: &Arc<dyn Subject>,
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
    Ok(RedisServerCost {
        calls,
        acquire_script_us,
        release_script_us,
        set_nx_us: usec_per_call(&info, "set").ok_or_else(|| missing("set"))?,
        del_us: usec_per_call(&info, "del").ok_or_else(|| missing("del"))?,
    })
}
