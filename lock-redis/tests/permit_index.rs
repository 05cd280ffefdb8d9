//! A semaphore's permit index (`scripts/permits.lua`): an attempt on a semaphore's slots
//! reads the index, not every slot key, and the index never makes the backend grant a held
//! slot, nor refuse a free one for longer than the lease it missed would have run.

mod common;

use std::time::Duration;

use common::RedisFactory;
use distlock_core::{Lease, LockBackend, LockKey};
use harness::redis::RespValue;
use lock_redis::RedisBackend;

const TTL: Duration = Duration::from_secs(30);

/// The scripts as the backend sends them.
const ACQUIRE_PERMIT: &str = concat!(
    include_str!("../src/scripts/token.lua"),
    include_str!("../src/scripts/permits.lua"),
    include_str!("../src/scripts/acquire_permit.lua")
);
const ABANDON_PERMIT: &str = concat!(
    include_str!("../src/scripts/permits.lua"),
    include_str!("../src/scripts/abandon_permit.lua")
);

fn slots(name: &str, n: u32) -> Vec<LockKey> {
    (0..n)
        .map(|i| LockKey::new(format!("{name}:permit:{i}")).unwrap())
        .collect()
}

/// Takes `n` permits of `slots` one by one, as a semaphore does.
async fn fill(redis: &RedisBackend, slots: &[LockKey], n: usize, ttl: Duration) -> Vec<Lease> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(
            redis
                .acquire_any(slots, ttl)
                .await
                .unwrap()
                .expect("a free slot"),
        );
    }
    held
}

async fn reset(f: &RedisFactory) {
    harness::require(f.server.command(&["CONFIG", "RESETSTAT"]).await);
}

/// `acquire_permit.lua` run as a call sent again (flagged `R`) on semaphore `name`, with
/// one attempt per `(owner, last)`: each over slots `0..=last`, for 30 s, marking nothing
/// it did not find held.
async fn sent_again(f: &RedisFactory, name: &str, attempts: &[(&str, u32)]) -> RespValue {
    let mut args: Vec<String> = vec![
        "EVAL".into(),
        ACQUIRE_PERMIT.into(),
        "4".into(),
        format!("distlock:{{{name}}}:permits"),
        format!("distlock:{{{name}}}:permits:due"),
        format!("distlock:{{{name}}}:permits:waited"),
        "distlock:tokens".into(),
        format!("distlock:{{{name}}}:permit:"),
    ];
    for (owner, last) in attempts {
        args.extend([
            owner.to_string(),
            "30000".into(),
            "0".into(),
            "0".into(),
            last.to_string(),
            "-1".into(),
        ]);
    }
    args.push("R".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    harness::require(f.server.command(&args).await)
}

/// A refusal of a full semaphore of 256 permits reads no slot key: the server runs no
/// `GET`, `SET NX` or `PTTL` per slot (it did 256 `SET NX` and 256 `GET` before the index),
/// only the index's bitmap and the waiters' flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_semaphores_refusal_reads_no_slot_key() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("wide", 256);
    let held = fill(&redis, &slots, 256, TTL).await;
    reset(&f).await;
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    // One SET: the waiters' flag, not a slot.
    let refusal = [
        ("evalsha", 1),
        ("get", 0),
        ("pttl", 0),
        ("append", 0),
        ("set", 1),
        ("bitpos", 1),
        ("getbit", 0),
    ];
    f.assert_calls(&refusal, "in a refusal").await;
    // The waiters' flag is set, and the slot keys hold their leases unmarked.
    let index = harness::require(
        f.server
            .command(&["EXISTS", "distlock:{wide}:permits:waited"])
            .await,
    );
    assert_eq!(index, RespValue::Integer(1));
    redis.release_many(&held).await.unwrap();
    // Each release freed its slot in the index, and the idle semaphore keeps none; the
    // first release, heard by the flag, cleared it.
    assert_eq!(
        harness::require(
            f.server
                .command(&["EXISTS", "distlock:{wide}:permits"])
                .await
        ),
        RespValue::Integer(0)
    );
    assert_eq!(
        harness::require(
            f.server
                .command(&["EXISTS", "distlock:{wide}:permits:waited"])
                .await
        ),
        RespValue::Integer(0)
    );
}

/// A released slot is free at once, though its lease would have run for 30 s more: the
/// release frees it in the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_slot_is_granted_again_at_once() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("released", 4);
    let mut held = fill(&redis, &slots, 4, TTL).await;
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    let freed = held.remove(2);
    assert_eq!(
        redis.release(&freed).await.unwrap(),
        distlock_core::Release::Released
    );
    let again = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("the released slot");
    assert_eq!(again.key(), freed.key());
    assert!(again.token() > freed.token());
    held.push(again);
    // The batch release frees slots in the index too.
    let batch: Vec<Lease> = held.drain(..2).collect();
    redis.release_many(&batch).await.unwrap();
    let a = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("freed");
    let b = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("freed");
    let mut got = vec![a.key().clone(), b.key().clone()];
    got.sort();
    let mut want = vec![batch[0].key().clone(), batch[1].key().clone()];
    want.sort();
    assert_eq!(got, want);
    held.extend([a, b]);
    redis.release_many(&held).await.unwrap();
}

/// A slot whose lease ran out (its holder gone, nothing released) is granted again once
/// its due time has passed: the index looks at the slot key then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_lease_ran_out_is_granted_again() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("lapsed", 3);
    let short = Duration::from_millis(300);
    let lapsing = fill(&redis, &slots, 1, short).await;
    assert_eq!(lapsing[0].key(), &slots[0]);
    let held = fill(&redis, &slots, 2, TTL).await;
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let again = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("the lapsed slot");
    assert_eq!(again.key(), &slots[0]);
    redis.release_many(&held).await.unwrap();
    redis.release(&again).await.unwrap();
}

/// The index is a guide, the slot keys the truth: slots taken without it (as plain locks)
/// and an index lost altogether never make it grant a held slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_never_grants_a_slot_it_did_not_see_taken() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("unseen", 4);
    let plain = [
        redis.acquire(&slots[0], TTL).await.unwrap().unwrap(),
        redis.acquire(&slots[2], TTL).await.unwrap().unwrap(),
    ];
    let held = fill(&redis, &slots, 2, TTL).await;
    let mut got: Vec<&LockKey> = held.iter().map(Lease::key).collect();
    got.sort();
    assert_eq!(got, [&slots[1], &slots[3]]);
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    // The index lost (a restart without persistence of it, a FLUSH of those keys).
    harness::require(
        f.server
            .command(&[
                "DEL",
                "distlock:{unseen}:permits",
                "distlock:{unseen}:permits:due",
            ])
            .await,
    );
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    for (slot, holder) in slots.iter().zip([&plain[0], &held[0], &plain[1], &held[1]]) {
        assert_eq!(holder.key(), slot);
        assert_eq!(
            redis.inspect(slot).await.unwrap().owner,
            Some(holder.owner()),
            "{slot}"
        );
    }
    redis.release_many(&plain).await.unwrap();
    redis.release_many(&held).await.unwrap();
}

/// An attempt sent again (flagged `R`) returns the slot it took, even with a slot before
/// it freed meanwhile; its abandon gives that slot back and frees it in the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_sent_again_returns_its_slot_and_its_abandon_gives_it_back() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("again", 3);
    let first = redis.acquire_any(&slots, TTL).await.unwrap().unwrap();
    assert_eq!(first.key(), &slots[0]);
    let lease = redis.acquire_any(&slots, TTL).await.unwrap().unwrap();
    assert_eq!(lease.key(), &slots[1]);
    redis.release(&first).await.unwrap();

    let owner = lease.owner().to_string();
    let index = [
        "distlock:{again}:permits",
        "distlock:{again}:permits:due",
        "distlock:{again}:permits:waited",
    ];
    let again = sent_again(&f, "again", &[(owner.as_str(), 2)]).await;
    assert_eq!(
        again,
        RespValue::Array(Some(vec![RespValue::Array(Some(vec![
            RespValue::Integer(1),
            RespValue::Bulk(Some(lease.token().get().to_string().into_bytes())),
        ]))]))
    );
    // Slot 0 stayed free: the resent attempt took nothing more.
    assert_eq!(redis.inspect(&slots[0]).await.unwrap().owner, None);

    let mut args = vec!["EVAL", ABANDON_PERMIT, "3"];
    args.extend(index);
    args.extend([owner.as_str(), "distlock:{again}:permit:", "-"]);
    assert_eq!(
        harness::require(f.server.command(&args).await),
        RespValue::Integer(1)
    );
    assert_eq!(redis.inspect(&slots[1]).await.unwrap().owner, None);
    // Freed in the index: all three slots are granted again.
    let all = fill(&redis, &slots, 3, TTL).await;
    redis.release_many(&all).await.unwrap();
    // Another owner's abandon gives back nothing.
    let mut args = vec!["EVAL", ABANDON_PERMIT, "3"];
    args.extend(index);
    args.extend(["00ff", "distlock:{again}:permit:", "-"]);
    assert_eq!(
        harness::require(f.server.command(&args).await),
        RespValue::Integer(0)
    );
}

/// A purge of a slot takes the semaphore's index with it (`lockctl check` purges what it
/// used and leaves nothing behind); the slots still held are found held by the next
/// attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_slot_takes_the_index_with_it() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("purged", 3);
    let held = fill(&redis, &slots, 3, TTL).await;
    redis.purge(&slots[0]).await.unwrap();
    let left = harness::require(
        f.server
            .command(&[
                "EXISTS",
                "distlock:{purged}:permits",
                "distlock:{purged}:permits:due",
            ])
            .await,
    );
    assert_eq!(left, RespValue::Integer(0));
    let again = redis
        .acquire_any(&slots, TTL)
        .await
        .unwrap()
        .expect("slot 0");
    assert_eq!(again.key(), &slots[0]);
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    redis.release_many(&held[1..]).await.unwrap();
    redis.release(&again).await.unwrap();
}

/// A permit attempt whose reply is lost (it ran: the link is slower than the request
/// timeout) gives back the slot it took, found by its owner id, long before the slot's
/// 30 s lease would run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_attempt_whose_reply_is_lost_gives_its_slot_back() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("lost", 3);
    let held = fill(&redis, &slots, 2, TTL).await;
    // Each way slower than half the 300 ms request timeout: the attempt reaches the server
    // and takes slot 2, its reply comes too late.
    f.proxy.delay(Duration::from_millis(200));
    let outcome = redis.acquire_any(&slots, TTL).await;
    assert!(
        matches!(
            outcome,
            Err(distlock_core::LockError::OutcomeUnknown { .. })
        ),
        "{outcome:?}"
    );
    f.proxy.delay(Duration::ZERO);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let back = loop {
        if let Some(lease) = redis.acquire_any(&slots, TTL).await.unwrap() {
            break lease;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "slot 2 still held 5 s after the lost reply (its lease is 30 s)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(back.key(), &slots[2]);
    redis.release_many(&held).await.unwrap();
    redis.release(&back).await.unwrap();
}

/// From every slot a semaphore may start at, the index grants the first slot free in the
/// order asked (onwards, then from 0), wherever the free slots lie in the bitmap's bytes:
/// before the start in the start's own byte, after it, in a later byte, or only before
/// the start (found by the run from 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_start_gets_the_first_free_slot_in_the_order_asked() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let n = 20;
    let slots = slots("ordered", n);
    let ring: Vec<LockKey> = slots.iter().chain(&slots).cloned().collect();
    let free = [3, 9, 10, 17];
    let mut held = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        if !free.contains(&i) {
            held.push(redis.acquire(slot, TTL).await.unwrap().expect("free"));
        }
    }
    // The index learns of the plain locks as attempts find them held.
    for _ in 0..2 {
        let probe = redis.acquire_any(&slots, TTL).await.unwrap().expect("free");
        redis.release(&probe).await.unwrap();
    }
    for start in 0..n as usize {
        let want = (0..n as usize)
            .map(|i| (start + i) % n as usize)
            .find(|i| free.contains(i))
            .unwrap();
        let order = &ring[start..start + n as usize];
        let lease = redis.acquire_any(order, TTL).await.unwrap().expect("free");
        assert_eq!(lease.key(), &slots[want], "from slot {start}");
        redis.release(&lease).await.unwrap();
    }
    redis.release_many(&held).await.unwrap();
}

/// A grant of the first slot asked for reads the server's clock once (for the due times
/// and the token alike), passes over no slot, so it looks at no due slot (no
/// `ZRANGEBYSCORE`), and finds that slot, inside a byte of the bitmap, with one `BITPOS`,
/// not a `GETBIT` per bit up to the byte's end; its release leaves the slot in the due set
/// (no `ZREM`), and the last release of an idle semaphore deletes the due set with the
/// bitmap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_of_the_first_slot_asked_and_its_release_send_only_what_they_need() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("lean", 64);
    let ring: Vec<LockKey> = slots.iter().chain(&slots).cloned().collect();
    // Slots 0 to 9 held: the index has a bitmap, and slot 10 is inside its second byte.
    let held = fill(&redis, &slots, 10, TTL).await;
    reset(&f).await;
    let lease = redis
        .acquire_any(&ring[10..10 + 64], TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(lease.key(), &slots[10]);
    let grant = [
        ("evalsha", 1),
        ("time", 1),
        ("getbit", 0),
        ("zrangebyscore", 0),
        ("bitpos", 1),
        ("get", 1),
        ("setbit", 1),
        ("zadd", 1),
        ("set", 2),
    ];
    f.assert_calls(&grant, "in a grant").await;
    reset(&f).await;
    redis.release(&lease).await.unwrap();
    f.assert_calls(
        &[("zrem", 0), ("setbit", 1), ("bitcount", 1)],
        "in a release",
    )
    .await;
    redis.release_many(&held).await.unwrap();
    let left = harness::require(
        f.server
            .command(&[
                "EXISTS",
                "distlock:{lean}:permits",
                "distlock:{lean}:permits:due",
            ])
            .await,
    );
    assert_eq!(left, RespValue::Integer(0), "an idle semaphore's index");
}

/// A slot whose lease ran out is granted before a free slot after it in the order asked:
/// an attempt that would pass over a slot the index shows held first frees the due ones,
/// whether the index shows a later slot free, or shows the first slot free and its key is
/// found held (taken as a plain lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_slot_is_granted_before_a_free_one_after_it() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let short = Duration::from_millis(300);

    // Slot 0 lapsing, slot 1 released (shown free), slot 2 held.
    let slots = slots("skipped", 3);
    let lapsing = fill(&redis, &slots, 1, short).await;
    let mut held = fill(&redis, &slots, 2, TTL).await;
    assert_eq!((lapsing[0].key(), held[0].key()), (&slots[0], &slots[1]));
    redis.release(&held.remove(0)).await.unwrap();
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let lease = redis.acquire_any(&slots, TTL).await.unwrap().expect("free");
    assert_eq!(lease.key(), &slots[0], "the lapsed slot, first in order");
    held.push(lease);

    // Slot 0 shown free but held as a plain lock, slot 1 lapsing, slot 2 released.
    let slots = self::slots("found", 3);
    let first = fill(&redis, &slots, 1, TTL).await.remove(0);
    let lapsing = fill(&redis, &slots, 1, short).await;
    let third = fill(&redis, &slots, 1, TTL).await.remove(0);
    assert_eq!(
        (first.key(), lapsing[0].key(), third.key()),
        (&slots[0], &slots[1], &slots[2])
    );
    redis.release(&first).await.unwrap();
    let plain = redis.acquire(&slots[0], TTL).await.unwrap().expect("free");
    redis.release(&third).await.unwrap();
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let lease = redis.acquire_any(&slots, TTL).await.unwrap().expect("free");
    assert_eq!(
        lease.key(),
        &slots[1],
        "the lapsed slot, before the free slot 2"
    );
    redis.release(&plain).await.unwrap();
    redis.release(&lease).await.unwrap();
    redis.release_many(&held).await.unwrap();
}

/// A batch release of several slots of one semaphore looks at its index once: one
/// `BITCOUNT` (is it idle?) and one `DEL` of its waiters' flag, whose release is the one
/// announced; the idle index is deleted with its due set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_release_of_one_semaphores_slots_looks_at_its_index_once() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("batched", 4);
    let held = fill(&redis, &slots, 4, TTL).await;
    // A refusal sets the waiters' flag.
    assert!(redis.acquire_any(&slots, TTL).await.unwrap().is_none());
    reset(&f).await;
    let released = redis.release_many(&held).await.unwrap();
    assert!(
        released
            .iter()
            .all(|r| *r == distlock_core::Release::Released)
    );
    // DEL: four slot keys, the flag, and the idle index with its due set in one.
    let batch = [
        ("evalsha", 1),
        ("setbit", 4),
        ("bitcount", 1),
        ("del", 6),
        ("publish", 1),
    ];
    f.assert_calls(&batch, "in a batch release").await;
    let left = harness::require(
        f.server
            .command(&[
                "EXISTS",
                "distlock:{batched}:permits",
                "distlock:{batched}:permits:due",
                "distlock:{batched}:permits:waited",
            ])
            .await,
    );
    assert_eq!(left, RespValue::Integer(0));
}

/// A call of several attempts sent again (flagged `R`) answers each attempt that took a
/// slot the first time with that slot and token, and tries the others afresh, reading the
/// semaphore's due set once for them all, not once per attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_sent_again_reads_the_due_set_once_for_all_its_attempts() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    let slots = slots("resent", 4);
    let held = fill(&redis, &slots, 3, TTL).await;
    let owners: Vec<String> = held.iter().map(|l| l.owner().to_string()).collect();
    reset(&f).await;
    // The first and the third holder, and an owner that took nothing the first time.
    let replies = sent_again(
        &f,
        "resent",
        &[
            (owners[0].as_str(), 3),
            (owners[2].as_str(), 3),
            ("00ff", 3),
        ],
    )
    .await;
    let RespValue::Array(Some(replies)) = replies else {
        panic!("{replies:?}");
    };
    let answer = |slot: i64, token: String| {
        RespValue::Array(Some(vec![
            RespValue::Integer(slot),
            RespValue::Bulk(Some(token.into_bytes())),
        ]))
    };
    assert_eq!(replies[0], answer(0, held[0].token().get().to_string()));
    assert_eq!(replies[1], answer(2, held[2].token().get().to_string()));
    // The third attempt took the free slot 3.
    let RespValue::Array(Some(third)) = &replies[2] else {
        panic!("{:?}", replies[2]);
    };
    assert_eq!(third[0], RespValue::Integer(3));
    f.assert_calls(&[("zrange", 1)], "in a call sent again")
        .await;
}

/// A semaphore asks the index from slot 0 (the backend declares `permit_index`): each grant
/// is the lowest free slot, found with one `BITPOS` and no bit read one by one, wherever
/// the holes are. From a random start it would take a later slot most of the time (here
/// 6 starts in 64 reach slot 5 first), and a start inside a byte reads bits one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_takes_the_lowest_free_slot_in_one_look() {
    let f = RedisFactory::start().await;
    let redis = f.redis().await;
    assert!(redis.capabilities().permit_index);
    let locker = distlock_core::Locker::builder(std::sync::Arc::new(redis.clone()))
        .ttl(TTL)
        .build()
        .unwrap();
    let semaphore = locker
        .semaphore(&LockKey::new("lowest").unwrap(), 64)
        .unwrap();
    // Slots 0 to 39 held, then 5 and 30 freed: holes at 5 and 30, 40 onwards free.
    let mut held = fill(&redis, semaphore.slots(), 40, TTL).await;
    for slot in [30, 5] {
        let lease = held.remove(slot);
        redis.release(&lease).await.unwrap();
    }
    for round in 0..3 {
        reset(&f).await;
        let permit = semaphore.try_acquire().await.unwrap().expect("free");
        assert_eq!(permit.slot(), 5, "round {round}: the lowest free slot");
        let grant = [("bitpos", 1), ("getbit", 0), ("evalsha", 1)];
        f.assert_calls(&grant, &format!("in round {round}")).await;
        permit.release().await.unwrap();
    }
    let two = semaphore.try_acquire_many(2).await.unwrap().expect("free");
    let mut taken: Vec<u32> = two.iter().map(|p| p.slot()).collect();
    taken.sort_unstable();
    assert_eq!(taken, [5, 30], "k permits: the lowest free ones");
    two.release().await.unwrap();
    redis.release_many(&held).await.unwrap();
}
