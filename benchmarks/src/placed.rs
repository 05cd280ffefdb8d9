//! The Redis pairs shared and pinned ([`capacity::placement`]) on the servers of a run.

use std::sync::Arc;

use crate::BenchError;
use crate::subjects::{self, Servers, Store};
use capacity::placement::{self, Open, PlacedPairs};
use capacity::plan::Plan;

/// Opens distlock, rslock, the two-step design and raw `SET NX` + `DEL` on the run's
/// redis-server and measures them at 16 and 64 tasks, shared and pinned (a pinned round
/// opens each again on the client's own runtime).
pub async fn redis_placed_pairs(
    servers: &Servers,
    plan: &Plan,
    progress: impl FnMut(&str),
) -> Result<PlacedPairs, BenchError> {
    let mut opened = Vec::with_capacity(placement::SUBJECTS.len());
    for id in placement::SUBJECTS {
        opened.push(subjects::open(id, servers).await?);
    }
    let open = open_on_redis(servers.redis_url()?);
    let pid = servers.pid(Store::Redis);
    let measured = placement::run(&opened, &open, pid, plan, progress).await;
    for subject in &opened {
        subject.close().await;
    }
    measured
}

/// Opens a Redis subject on the server at `url`, on the runtime that calls it.
pub fn open_on_redis(url: String) -> Open {
    Arc::new(move |id| {
        let url = url.clone();
        Box::pin(async move { subjects::open_redis(id, &url).await })
    })
}
