//! Fencing a permit's writes, on the memory backend and the memory fenced resource: a
//! permit's token given with the semaphore's name refuses a holder whose permit is valid
//! (the trap `Permit::fence` exists for), and under each permit's fence the holders of
//! every slot are admitted while a holder that lost its slot to another is refused.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{
    Admission, EnforcementMode, FencedResource, FencedResourceExt, Layered, LockBackend, LockKey,
    Locker, MemoryFencedResource, Permit, Semaphore,
};

/// Long: no permit runs out in these tests unless its holder is cut off.
const TTL: Duration = Duration::from_secs(30);

/// The cut-off holder's TTL: its slot runs out this long after its last renewal.
const SHORT_TTL: Duration = Duration::from_millis(300);

/// How long a holder waits for a slot another's lapse frees (far above `SHORT_TTL`).
const WAIT: Duration = Duration::from_secs(20);

fn locker_on(backend: Arc<dyn LockBackend>, ttl: Duration) -> Locker {
    Locker::builder(backend)
        .ttl(ttl)
        .wait_timeout(Some(WAIT))
        .build()
        .unwrap()
}

fn exports(locker: &Locker, permits: u32) -> Semaphore {
    locker
        .semaphore(&LockKey::new("exports:tenant-7").unwrap(), permits)
        .unwrap()
}

/// Both permits of a semaphore of two, held: `(earlier, later)`, the later on a slot
/// granted again after a release, so its token is above the earlier's (tokens rise per
/// slot, from the same start on every slot).
async fn two_holders(semaphore: &Semaphore) -> (Permit, Permit) {
    let first = semaphore.try_acquire().await.unwrap().unwrap();
    let earlier = semaphore.try_acquire().await.unwrap().unwrap();
    first.release().await.unwrap();
    let later = semaphore.try_acquire().await.unwrap().unwrap();
    assert_ne!(later.slot(), earlier.slot());
    assert!(
        later.token() > earlier.token(),
        "the slot granted again has the higher token: {later:?}, {earlier:?}"
    );
    assert!(earlier.is_held() && later.is_held());
    (earlier, later)
}

#[tokio::test]
async fn a_permits_token_fenced_under_the_semaphores_name_refuses_a_valid_holder() {
    let locker = locker_on(Arc::new(MemoryBackend::new()), TTL);
    let semaphore = exports(&locker, 2);
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    let (earlier, later) = two_holders(&semaphore).await;
    let name = semaphore.name().as_str();

    let written = ledger.write(name, later.token(), b"later").await.unwrap();
    assert_eq!(written, Admission::Admitted);
    // The earlier holder still holds its permit, and is refused all the same.
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
    assert!(earlier.is_held());
}

#[tokio::test]
async fn under_their_fences_the_holders_of_every_slot_are_admitted() {
    let locker = locker_on(Arc::new(MemoryBackend::new()), TTL);
    let semaphore = exports(&locker, 2);
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    let (earlier, later) = two_holders(&semaphore).await;

    let (earlier_fence, later_fence) = (earlier.fence(), later.fence());
    let written = ledger.write_under(&later_fence, b"later").await.unwrap();
    assert_eq!(written, Admission::Admitted);
    let written = ledger
        .write_under(&earlier_fence, b"earlier")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);
    assert_eq!(
        ledger.check_only_under(&earlier_fence).await.unwrap(),
        Admission::Admitted
    );
    let mut sent = 0;
    assert!(
        ledger
            .admit_under(&earlier_fence, || sent += 1)
            .is_admitted()
    );
    assert_eq!(sent, 1);
    // Each wrote its own value: neither overwrote the other's.
    let read = ledger.read_under(&later_fence).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"later"[..]));
    let read = ledger.read_under(&earlier_fence).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"earlier"[..]));
    // Under the slot's key, with the permit's token.
    assert_eq!(earlier_fence.key(), earlier.key());
    assert_eq!(earlier_fence.token(), earlier.token());
}

#[tokio::test]
async fn permits_taken_together_are_each_admitted_under_their_own_fence() {
    let locker = locker_on(Arc::new(MemoryBackend::new()), TTL);
    let semaphore = exports(&locker, 3);
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    // One slot granted three times, the other two twice: its token is above theirs.
    let mut others = semaphore
        .try_acquire_many(3)
        .await
        .unwrap()
        .unwrap()
        .into_vec();
    let mut single = others.pop().unwrap();
    for _ in 0..2 {
        single.release().await.unwrap();
        single = semaphore.try_acquire().await.unwrap().unwrap();
    }
    for permit in others {
        permit.release().await.unwrap();
    }
    let both = semaphore.try_acquire_many(2).await.unwrap().unwrap();
    let written = ledger
        .write_under(&single.fence(), b"single")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);

    let fences = both.fences();
    assert_eq!(fences.len(), 2);
    for (fence, permit) in fences.iter().zip(both.iter()) {
        assert!(permit.token() < single.token(), "{permit:?} vs {single:?}");
        let written = ledger.write_under(fence, b"both").await.unwrap();
        assert_eq!(written, Admission::Admitted, "{fence:?}");
        assert_eq!(fence.key(), permit.key());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_its_fence_a_holder_that_lost_its_slot_to_another_is_refused() {
    let store = MemoryBackend::new();
    // A worker whose link to the store is cut: its renewals fail, its slot runs out.
    let cut = Arc::new(Faults::default());
    let paused = locker_on(
        Arc::new(Layered::new(Arc::new(store.client()), cut.clone())),
        SHORT_TTL,
    );
    let other = locker_on(Arc::new(store.client()), TTL);
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);

    let lapsing = exports(&paused, 2).try_acquire().await.unwrap().unwrap();
    let stale_fence = lapsing.fence();
    let neighbour = exports(&other, 2).try_acquire().await.unwrap().unwrap();
    cut.partition();
    // The one free slot is the cut-off worker's, once it has run out.
    let successor = exports(&other, 2).acquire().await.unwrap();
    assert_eq!(successor.key(), lapsing.key());
    assert!(successor.token() > lapsing.token());

    let written = ledger
        .write_under(&successor.fence(), b"new")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);
    // The cut-off worker wakes and writes under the fence it took with its permit.
    let late = ledger.write_under(&stale_fence, b"late").await.unwrap();
    assert_eq!(
        late,
        Admission::Stale {
            latest: successor.token()
        }
    );
    // The other slot's holder is not refused for it.
    let written = ledger
        .write_under(&neighbour.fence(), b"neighbour")
        .await
        .unwrap();
    assert_eq!(written, Admission::Admitted);
    let read = ledger.read_under(&stale_fence).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"new"[..]));
    cut.heal();
    drop(lapsing);
}
