//! The Redis pairs shared and pinned ([`capacity::placement`]) on the servers of a run.

use crate::BenchError;
use crate::subjects::{self, Servers, Store};
use capacity::placement::{self, PlacedPairs};
use capacity::scenarios::Plan;

/// Opens distlock, rslock, the two-step design and raw `SET NX` + `DEL` on the run's
/// redis-server and measures them at 16 and 64 tasks, shared and pinned.
pub async fn redis_placed_pairs(
    servers: &Servers,
    plan: &Plan,
    progress: impl FnMut(&str),
) -> Result<PlacedPairs, BenchError> {
    let mut opened = Vec::with_capacity(placement::SUBJECTS.len());
    for id in placement::SUBJECTS {
        opened.push(subjects::open(id, servers).await?);
    }
    let measured = placement::run(&opened, servers.pid(Store::Redis), plan, progress).await;
    for subject in &opened {
        subject.close().await;
    }
    measured
}
