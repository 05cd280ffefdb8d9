//! A permit's fence on a real PostgreSQL: permits of the lease table, writes through
//! `PgFencedResource`. A permit's token under the semaphore's name refuses a valid holder
//! of another slot; under each permit's fence both slots' holders are admitted and a
//! holder whose slot went to another is refused.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Kind, backend, builder, shared_server};
use distlock_core::{
    Admission, EnforcementMode, FencedResource, FencedResourceExt, LockKey, Locker, Semaphore,
};
use harness::postgres::PostgresServer;
use lock_postgres::PgFencedResource;
use lock_postgres::sqlx::PgPool;

/// A semaphore `name` of 2 permits on the shared server's lease table, a fenced ledger in
/// its database, the pool the ledger writes through, and the server (it stops when the
/// last test holding it drops it).
async fn semaphore_and_ledger(
    name: &str,
) -> (Semaphore, PgFencedResource, PgPool, Arc<PostgresServer>) {
    let server = shared_server().await;
    let locker = Locker::builder(backend(&server, Kind::Lease).await)
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let semaphore = locker.semaphore(&LockKey::new(name).unwrap(), 2).unwrap();
    let pool = builder(&server)
        .build_lease_backend()
        .unwrap()
        .pool()
        .clone();
    let ledger = PgFencedResource::new(pool.clone(), "distlock", EnforcementMode::Enforce).unwrap();
    (semaphore, ledger, pool, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_its_fence_each_slots_holder_is_admitted_and_one_that_lost_its_slot_is_refused() {
    let (semaphore, ledger, _, _server) = semaphore_and_ledger("permit-fence:exports").await;

    // Both slots held, the later on a slot granted again, with the higher token.
    let first = semaphore.try_acquire().await.unwrap().unwrap();
    let earlier = semaphore.try_acquire().await.unwrap().unwrap();
    first.release().await.unwrap();
    let later = semaphore.try_acquire().await.unwrap().unwrap();
    assert_ne!(later.slot(), earlier.slot());
    assert!(later.token() > earlier.token(), "{later:?}, {earlier:?}");

    // The trap: under the semaphore's name the valid earlier holder is refused.
    let name = semaphore.name().as_str();
    let written = ledger.write(name, later.token(), b"later").await.unwrap();
    assert_eq!(written, Admission::Admitted);
    let refused = ledger
        .write(name, earlier.token(), b"earlier")
        .await
        .unwrap();
    assert_eq!(
        refused,
        Admission::Stale {
            latest: later.token()
        }
    );

    // Under each permit's fence, both are admitted.
    let later_fence = later.fence();
    let written = ledger.write_under(&later_fence, b"later").await.unwrap();
    assert_eq!(written, Admission::Admitted);
    let written = ledger
        .write_under(&earlier.fence(), b"earlier")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);

    // The later holder's slot goes to another; the fence it kept is refused after the
    // new holder wrote, and the value stays the new holder's.
    later.release().await.unwrap();
    let successor = semaphore.try_acquire().await.unwrap().unwrap();
    assert_eq!(successor.key(), later_fence.key());
    let written = ledger
        .write_under(&successor.fence(), b"new")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);
    let late = ledger.write_under(&later_fence, b"late").await.unwrap();
    assert_eq!(
        late,
        Admission::Stale {
            latest: successor.token()
        }
    );
    let read = ledger.read_under(&later_fence).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"new"[..]));

    earlier.release().await.unwrap();
    successor.release().await.unwrap();
}

/// `admit_under` admits a write inside the application's own transaction under a permit's
/// fence: the holders of two slots are both admitted, whatever their tokens' order, and a
/// holder whose slot went to another is refused once the new holder's write committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_transaction_each_slots_holder_is_admitted_under_its_fence() {
    let (semaphore, ledger, pool, _server) = semaphore_and_ledger("permit-fence:tx-exports").await;
    let admit = async |fence| {
        let mut tx = pool.begin().await.unwrap();
        let admission = ledger.admit_under(&mut tx, &fence).await.unwrap();
        tx.commit().await.unwrap();
        admission
    };

    // Slot 1's holder has the higher token; slot 0's earlier holder is still valid.
    let first = semaphore.try_acquire().await.unwrap().unwrap();
    let earlier = semaphore.try_acquire().await.unwrap().unwrap();
    first.release().await.unwrap();
    let later = semaphore.try_acquire().await.unwrap().unwrap();
    assert!(later.token() > earlier.token(), "{later:?}, {earlier:?}");
    assert_eq!(admit(later.fence()).await, Admission::Admitted);
    assert_eq!(admit(earlier.fence()).await, Admission::Admitted);

    // The later holder's slot goes to another, who writes first.
    let kept = later.fence();
    later.release().await.unwrap();
    let successor = semaphore.try_acquire().await.unwrap().unwrap();
    assert_eq!(successor.key(), kept.key());
    assert_eq!(admit(successor.fence()).await, Admission::Admitted);
    assert_eq!(
        admit(kept).await,
        Admission::Stale {
            latest: successor.token()
        }
    );

    earlier.release().await.unwrap();
    successor.release().await.unwrap();
}
