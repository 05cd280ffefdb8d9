//! The measurements the full report and the single-measurement modes both run: the
//! semaphore permit cycles, a full semaphore, and the releases with a waiter on every key.

use benchmarks::BenchError;
use benchmarks::plan::Plan;
use benchmarks::server_cost::RedisCommandStats;
use std::sync::Arc;

use benchmarks::subjects::{self, Servers, Store, Subject, SubjectId};
use capacity::full_semaphore::{CommandStats, FullSemaphore};
use capacity::permits::PermitCycles;

/// Measures `id`'s permit cycles against its lock cycles at each of
/// `capacity::permits::TASKS`, then a full semaphore at each size against its lock
/// (`capacity::full_semaphore`), on one instance of the backend. Another instance holds
/// the full semaphore's ballast, as other processes would, but on the in-memory backend,
/// whose store is its instance.
pub(crate) async fn permits(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<(Vec<PermitCycles>, FullSemaphore), BenchError> {
    let worker = subjects::open(id, servers).await?;
    let other = if id == SubjectId::Memory {
        None
    } else {
        match subjects::open(id, servers).await {
            Ok(other) => Some(other),
            Err(e) => {
                worker.close().await;
                return Err(e);
            }
        }
    };
    let measured = permits_on(&worker, other.as_ref().unwrap_or(&worker), servers, plan).await;
    worker.close().await;
    if let Some(other) = other {
        other.close().await;
    }
    measured
}

/// [`permits`] on `worker`, the ballast held through `other`.
async fn permits_on(
    worker: &Arc<dyn Subject>,
    other: &Arc<dyn Subject>,
    servers: &Servers,
    plan: &Plan,
) -> Result<(Vec<PermitCycles>, FullSemaphore), BenchError> {
    let id = worker.id();
    let server = servers.pid(id.store());
    let mut rows = Vec::new();
    for tasks in capacity::permits::TASKS {
        rows.push(capacity::permits::permit_cycles(worker.clone(), tasks, plan, server).await?);
    }
    let (Some(backend), Some(ballast)) = (worker.backend(), other.backend()) else {
        return Err(BenchError::Unexpected {
            subject: id.slug(),
            detail: "not a distlock backend: it has no semaphore".into(),
        });
    };
    let stats = RedisCommandStats(servers);
    let stats = (id.store() == Store::Redis).then_some(&stats as &dyn CommandStats);
    let full =
        capacity::full_semaphore::full_semaphore(id, backend, ballast, plan, server, stats).await?;
    Ok((rows, full))
}

/// Measures releases with a waiter on every key against releases nobody waits for, on
/// `id`, if it is a backend that wakes waiters. The waiters watch through another instance
/// of the backend (its own connections and listener, as another process's workers would),
/// but on the in-memory backend, whose store is its instance.
pub(crate) async fn waited_releases(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<Option<capacity::waited::WaitedReleases>, BenchError> {
    if !capacity::waited::watching_waits(id) {
        return Ok(None);
    }
    let worker = subjects::open(id, servers).await?;
    let Some(backend) = worker.backend().filter(|b| b.capabilities().wakes_waiters) else {
        worker.close().await;
        return Ok(None);
    };
    let other = if id == SubjectId::Memory {
        None
    } else {
        Some(subjects::open(id, servers).await?)
    };
    let waiters = other.as_ref().and_then(|o| o.backend()).unwrap_or(backend);
    let measured = capacity::waited::waited_releases(
        worker.clone(),
        waiters,
        capacity::waited::TASKS,
        plan,
        servers.pid(id.store()),
    )
    .await;
    worker.close().await;
    if let Some(other) = other {
        other.close().await;
    }
    measured.map(Some)
}
