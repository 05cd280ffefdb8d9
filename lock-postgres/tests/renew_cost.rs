//! The cost of renewing many advisory leases: one backend holds `DISTLOCK_RENEW_COST_LOCKS`
//! advisory locks (default 100; each pins a server session) and renews them all with
//! `renew_many`, as the watchdog does every TTL / 3. The test checks every lease is
//! renewed and prints the time per batch; it asserts no speed.
//!
//! `DISTLOCK_RENEW_COST_LOCKS=190 target/debug/deps/renew_cost-* --nocapture` (the test
//! server's `max_connections` is 200).

mod common;

use std::time::Duration;

use common::{builder, start_server};
use distlock_core::{LockBackend, LockKey, Renewal};
use tokio::time::Instant;

const ROUNDS: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_many_renews_every_held_advisory_lease_and_reports_its_time() {
    let locks: u32 = std::env::var("DISTLOCK_RENEW_COST_LOCKS")
        .ok()
        .map(|n| n.parse().expect("DISTLOCK_RENEW_COST_LOCKS is a number"))
        .unwrap_or(100);
    // The harness's server allows 200 connections: up to about 190 locks.
    let server = start_server().await;
    let backend = builder(&server)
        .pool_size(locks)
        .connect_timeout(Duration::from_secs(30))
        .build_advisory_backend()
        .unwrap();
    let ttl = Duration::from_secs(600);
    let keys: Vec<LockKey> = (0..locks)
        .map(|i| LockKey::new(format!("renew-cost:{i}")).unwrap())
        .collect();
    let leases: Vec<_> = backend
        .acquire_many(&keys, ttl)
        .await
        .unwrap()
        .into_iter()
        .map(|lease| lease.expect("a free key"))
        .collect();
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let renewals = backend.renew_many(&leases).await.unwrap();
        times.push(started.elapsed());
        assert!(
            renewals
                .iter()
                .all(|r| matches!(r, Renewal::Renewed { .. })),
            "{renewals:?}"
        );
    }
    times.sort();
    let median = times[ROUNDS / 2];
    println!(
        "renew_many of {locks} advisory leases: median {median:?} ({:?} per lease), \
         all rounds {times:?}",
        median / locks
    );
    backend.release_many(&leases).await.unwrap();
}
