//! Tokens never repeat when the counter behind them loses its last increments (a commit
//! lost to `synchronous_commit = off` or to a failover onto a replica that lagged): each
//! token is at least the server's clock in microseconds, so it is past every token the
//! lost increments issued.

mod common;

use std::time::Duration;

use common::{Kind, backend, shared_server};
use distlock_core::{LockKey, Release};

const TTL: Duration = Duration::from_secs(30);

/// How the counter behind a key loses state, done behind the backend's back.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// The last increment never became durable: the counter is one lower.
    LastIncrement,
    /// The row itself was lost.
    Row,
}

fn counter_table(kind: Kind) -> &'static str {
    match kind {
        Kind::Lease => "distlock.distlock_leases",
        Kind::Advisory => "distlock.distlock_advisory_tokens",
    }
}

async fn a_lost_increment_never_reissues_a_token(kind: Kind) {
    let server = shared_server().await;
    let client = backend(&server, kind).await;
    for loss in [Loss::LastIncrement, Loss::Row] {
        let k = LockKey::new(format!("tokens:{kind:?}:{loss:?}")).unwrap();
        let first = client.acquire(&k, TTL).await.unwrap().expect("free");
        assert_eq!(client.release(&first).await.unwrap(), Release::Released);

        let table = counter_table(kind);
        let name = k.as_str();
        let lose = match loss {
            Loss::LastIncrement => {
                format!("UPDATE {table} SET token = token - 1 WHERE name = '{name}'")
            }
            Loss::Row => format!("DELETE FROM {table} WHERE name = '{name}'"),
        };
        server.psql(&lose).await.unwrap();

        let next = client.acquire(&k, TTL).await.unwrap().expect("free");
        assert!(
            next.token() > first.token(),
            "{kind:?}, {loss:?}: token {} after {}",
            next.token(),
            first.token()
        );
        assert_eq!(client.release(&next).await.unwrap(), Release::Released);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_tokens_stay_higher_when_the_counter_loses_increments() {
    a_lost_increment_never_reissues_a_token(Kind::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_tokens_stay_higher_when_the_counter_loses_increments() {
    a_lost_increment_never_reissues_a_token(Kind::Advisory).await;
}
