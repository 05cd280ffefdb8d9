//! Where each task of a run's apalis Redis queue stands, read straight from the queue's
//! keys: for the report of a run that did not finish, so that a job that went missing
//! says whether it waits, runs, was given up on, or sits in the in-flight set of a worker
//! that will never finish it.

use std::fmt::Write as _;

use redis::AsyncCommands;
use redis::aio::ConnectionManager;

use crate::BoxError;

/// One line per place a task of the queue `config` names can stand: the active list, the
/// scheduled set (with the time each is due), each worker's heartbeat and in-flight set,
/// the done and dead sets; then each task's payload and what its metadata says.
pub async fn describe(
    conn: &mut ConnectionManager,
    config: &apalis_redis::Config,
) -> Result<String, BoxError> {
    let mut out = String::new();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    writeln!(out, "queue state (client clock {now_ms} ms):")?;
    let active: Vec<String> = conn.lrange(config.active_jobs_list(), 0, -1).await?;
    writeln!(out, "  active list: {active:?}")?;
    let scheduled: Vec<(String, f64)> = conn
        .zrange_withscores(config.scheduled_jobs_set(), 0, -1)
        .await?;
    writeln!(out, "  scheduled (task, due): {scheduled:?}")?;
    let workers: Vec<(String, f64)> = conn.zrange_withscores(config.workers_set(), 0, -1).await?;
    writeln!(out, "  workers (name, last heartbeat): {workers:?}")?;
    let inflight_prefix = config.inflight_jobs_set();
    let sets: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{inflight_prefix}:*"))
        .query_async(conn)
        .await?;
    for set in sets {
        let members: Vec<String> = conn.smembers(&set).await?;
        let worker = set
            .strip_prefix(&format!("{inflight_prefix}:"))
            .unwrap_or(&set);
        writeln!(out, "  in flight at {worker}: {members:?}")?;
    }
    let done: Vec<String> = conn.smembers(config.done_jobs_set()).await?;
    writeln!(out, "  done: {done:?}")?;
    let dead: Vec<String> = conn.smembers(config.dead_jobs_set()).await?;
    writeln!(out, "  dead: {dead:?}")?;
    let data: Vec<(String, Vec<u8>)> = conn.hgetall(config.job_data_hash()).await?;
    for (task, payload) in data {
        let meta: Vec<(String, String)> = conn
            .hgetall(format!("{}:{task}", config.job_meta_hash()))
            .await?;
        writeln!(
            out,
            "  task {task}: {} meta {meta:?}",
            String::from_utf8_lossy(&payload)
        )?;
    }
    Ok(out)
}
