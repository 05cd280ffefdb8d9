//! A semaphore's attempt on etcd reads its slots in one range read: a full semaphore is
//! refused in one round trip whatever its number of permits (it was one per slot), and a
//! grant takes the first slot free in the order asked, past held ones, wrapping as the
//! semaphore asks.

mod common;

use std::time::Duration;

use common::EtcdFactory;
use distlock_core::{LockBackend, LockKey};
use tokio::time::Instant;

fn name() -> String {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    format!("etcd-permits:{random:016x}")
}

fn slots(name: &str, n: u32) -> Vec<LockKey> {
    (0..n)
        .map(|i| LockKey::new(format!("{name}:permit:{i}")).unwrap())
        .collect()
}

const ONE_WAY: Duration = Duration::from_millis(100);

/// What a call of one round trip takes less than: two round trips take at least four
/// one-way delays; the rest is room for a busy machine.
const FEWER_THAN_TWO_ROUND_TRIPS: Duration = Duration::from_millis(100 * 4);

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_semaphore_is_refused_in_one_round_trip_whatever_its_size() {
    let factory = EtcdFactory::single()
        .await
        .with_request_timeout(Duration::from_secs(10));
    let backend = factory.etcd().await;
    // The factory owns the link: kept while its backend is used.
    let holder_link = EtcdFactory::single().await;
    let holder = holder_link.etcd().await;
    for n in [8, 64] {
        let name = name();
        let slots = slots(&name, n);
        let held = holder.acquire_many(&slots, TTL).await.unwrap();
        assert!(held.iter().all(Option::is_some), "every slot taken");
        // A plain lock named like a slot with a leading zero is no slot of the run.
        let stray = LockKey::new(format!("{name}:permit:07")).unwrap();
        holder.acquire(&stray, TTL).await.unwrap().expect("free");

        backend.inspect(&slots[0]).await.unwrap();
        factory.proxies()[0].delay(ONE_WAY);
        for start in [0, n as usize / 2] {
            let order: Vec<LockKey> = slots[start..]
                .iter()
                .chain(&slots[..start])
                .cloned()
                .collect();
            let sent = Instant::now();
            let refused = backend.acquire_any(&order, TTL).await.unwrap();
            let took = sent.elapsed();
            assert!(refused.is_none(), "N = {n}: {refused:?}");
            assert!(
                took < FEWER_THAN_TWO_ROUND_TRIPS,
                "N = {n}: a refusal took {took:?}, more than one round trip"
            );
        }
        factory.proxies()[0].delay(Duration::ZERO);
        let leases: Vec<_> = held.into_iter().flatten().collect();
        holder.release_many(&leases).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_takes_the_first_free_slot_in_the_order_asked() {
    let (link, holder_link) = (EtcdFactory::single().await, EtcdFactory::single().await);
    let (backend, holder) = (link.etcd().await, holder_link.etcd().await);
    let name = name();
    let slots = slots(&name, 8);
    // Slots 1, 5, 6 and 7 held: from slot 5 onwards, wrapping to 0, slot 0 is the first
    // free one; from slot 2, slot 2.
    let mut held = Vec::new();
    for i in [1, 5, 6, 7] {
        held.push(holder.acquire(&slots[i], TTL).await.unwrap().expect("free"));
    }
    let from_five: Vec<LockKey> = slots[5..].iter().chain(&slots[..5]).cloned().collect();
    let lease = backend
        .acquire_any(&from_five, TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(lease.key(), &slots[0]);
    let next = backend
        .acquire_any(&slots[2..], TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(next.key(), &slots[2]);
    // Every slot held but 3 and 4: the next from slot 5 is slot 3.
    let third = backend
        .acquire_any(&from_five, TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(third.key(), &slots[3]);
    // Mixed names are asked key by key, and still take the first free.
    let other = LockKey::new(format!("{name}-other:permit:0")).unwrap();
    let mixed = [slots[1].clone(), other.clone(), slots[4].clone()];
    let taken = backend
        .acquire_any(&mixed, TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(taken.key(), &other);
    for lease in [lease, next, third, taken] {
        backend.release(&lease).await.unwrap();
    }
    holder.release_many(&held).await.unwrap();
}
