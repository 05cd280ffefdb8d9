//! The measurements the full report and the single-measurement modes both run: the
//! semaphore permit cycles, a full semaphore, and the releases with a waiter on every key.

use benchmarks::BenchError;
use benchmarks::plan::Plan;
use benchmarks::server_cost::RedisCommandStats;
use benchmarks::subjects::{self, Servers, Store, SubjectId};
use capacity::full_semaphore::{CommandStats, FullSemaphore};

/// Measures `id`'s permit cycles against its lock cycles at each of
/// `capacity::permits::TASKS`.
pub(crate) async fn permit_cycles(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<Vec<capacity::permits::PermitCycles>, BenchError> {
    let worker = subjects::open(id, servers).await?;
    let mut out = Vec::new();
    for tasks in capacity::permits::TASKS {
        let measured =
            capacity::permits::permit_cycles(worker.clone(), tasks, plan, servers.pid(id.store()))
                .await;
        match measured {
            Ok(p) => out.push(p),
            Err(e) => {
                worker.close().await;
                return Err(e);
            }
        }
    }
    worker.close().await;
    Ok(out)
}

/// Measures a full semaphore of `id` at each size against its lock
/// (`capacity::full_semaphore`). Another instance of the backend holds the ballast, as
/// other processes would, but on the in-memory backend, whose store is its instance.
pub(crate) async fn full_semaphore(
    id: SubjectId,
    servers: &Servers,
    plan: &Plan,
) -> Result<FullSemaphore, BenchError> {
    let worker = subjects::open(id, servers).await?;
    let other = if id == SubjectId::Memory {
        None
    } else {
        Some(subjects::open(id, servers).await?)
    };
    let stats = RedisCommandStats(servers);
    let stats = (id.store() == Store::Redis).then_some(&stats as &dyn CommandStats);
    let backends = worker
        .backend()
        .zip(other.as_ref().unwrap_or(&worker).backend());
    let measured = match backends {
        Some((backend, ballast)) => {
            let server = servers.pid(id.store());
            capacity::full_semaphore::full_semaphore(id, backend, ballast, plan, server, stats)
                .await
        }
        None => Err(BenchError::Unexpected {
            subject: id.slug(),
            detail: "not a distlock backend: it has no semaphore".into(),
        }),
    };
    worker.close().await;
    if let Some(other) = other {
        other.close().await;
    }
    measured
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
