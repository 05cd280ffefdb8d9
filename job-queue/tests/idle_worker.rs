//! An idle apalis-redis worker whose every round trip to Redis outlasts its heartbeat
//! interval still fetches: a job pushed due later runs once it is due. Its first fetch is
//! in flight when the first heartbeat comes due and brings nothing (the job is not due
//! yet); apalis alone then leaves the worker waiting for ever, with nothing to wake it
//! (see `job_queue::heartbeat`). The queue's workers run behind `Heartbeats`, which wakes
//! them within half an interval.
//!
//! Only on apalis-redis: apalis-postgres, whose storage is driven the same way, ran such
//! a job without `Heartbeats` too (its fetch's round trips through the pool wake the
//! worker after the timer), so the case would show nothing there.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_redis::RedisStorage;
use distlock::LockKey;
use distlock::apalis::{ApalisLockLayer, JobLease};
use harness::proxy::FaultProxy;
use job_queue::storage::{Queue, Server, Storage};
use job_queue::{Payout, queue_config};
use redis::aio::ConnectionManagerConfig;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_due_later_runs_on_a_worker_whose_round_trips_outlast_its_heartbeat() {
    // The queue's heartbeats come every second (`job_queue::queue_config`; apalis-redis
    // counts them in whole seconds); each way 600 ms makes a round trip 1.2 s, within the
    // worker's connection's response timeout (5 s here; apalis-redis's own is 500 ms).
    const DELAY: Duration = Duration::from_millis(600);
    const TIMEOUT: Duration = Duration::from_secs(5);
    // Past the worker's connection, registration and first fetch through that link (about
    // five round trips, 6 s), so that the first fetch finds the job not due.
    const DUE: Duration = Duration::from_secs(12);
    let storage = Storage::Redis;
    let server = Server::start(storage).await.unwrap();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], server.port())))
        .await
        .unwrap();
    let slow_url = server.url().replace(
        &format!(":{}/", server.port()),
        &format!(":{}/", proxy.port()),
    );
    assert_ne!(slow_url, server.url(), "{storage}: the URL names the proxy");

    let mut queue = server.queue::<Payout>("idle").await.unwrap();
    queue
        .push_after(Payout { id: 1, work_ms: 0 }, DUE)
        .await
        .unwrap();
    let pushed = Instant::now();
    proxy.delay(DELAY);
    let conn = redis::Client::open(slow_url.as_str())
        .unwrap()
        .get_connection_manager_with_config(
            ConnectionManagerConfig::new()
                .set_connection_timeout(Some(TIMEOUT))
                .set_response_timeout(Some(TIMEOUT)),
        )
        .await
        .unwrap();
    // A heartbeat is three round trips (3.6 s, more on a loaded machine): apalis-redis
    // takes a worker whose last one is older than `missed_heartbeats` intervals for dead,
    // itself included (its search for the others' orphaned tasks does not leave it out),
    // so it must allow well more than that.
    let config = queue_config("idle").missed_heartbeats(10);
    let slow = Queue::on_redis(RedisStorage::new(conn).with_config(config));
    let locker = server.locker(Duration::from_secs(10)).await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = runs.clone();
        move |_: Payout, _: JobLease| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxDynError>(()) }
        }
    };
    let lock = ApalisLockLayer::new(locker, |job: &Payout| {
        LockKey::new(format!("idle:{}", job.id))
    });
    let worker = slow.work("idle", 1, lock, handler);

    // A hang guard, not a speed bound: once due, the job is fetched within half a
    // heartbeat interval and a heartbeat's and a fetch's round trips.
    while runs.load(Ordering::SeqCst) == 0 {
        if pushed.elapsed() >= DUE + Duration::from_secs(30) {
            let state = (queue.state(&server).await)
                .unwrap_or_else(|e| format!("(the queue's state unreadable: {e})"));
            panic!(
                "{storage}: the job due {DUE:?} after its push was not run {:?} after it\n{state}",
                pushed.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        pushed.elapsed() >= DUE,
        "{storage}: the job ran {:?} after its push, before it was due",
        pushed.elapsed()
    );
    worker.abort();
}
