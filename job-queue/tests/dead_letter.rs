//! `distlock::apalis` on apalis's Redis storage, in process: a job whose key another
//! worker keeps held is sent back, delivery after delivery, and after
//! `dead_letter_after` of them lands in the storage's dead set, its handler never run.
//! apalis counts attempts and sets statuses only where it calls the handler, so this
//! is the layer's own doing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use apalis_core::backend::TaskSink;
use apalis_core::error::BoxDynError;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_redis::RedisStorage;
use distlock::apalis::ApalisLockLayer;
use distlock::{LockKey, Locker};
use harness::redis::{RedisServer, RespValue};
use harness::require;
use job_queue::{Payout, queue_config};
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_key_stays_held_is_dead_lettered_without_running() {
    let redis = require(RedisServer::start().await);
    let config = queue_config("dead-letter");
    let dead_set = config.dead_jobs_set();
    let conn = apalis_redis::connect(redis.url().as_str()).await.unwrap();
    let mut storage = RedisStorage::<Payout>::new(conn).with_config(config);
    let locker = Locker::builder(distlock::connect(&redis.url()).await.unwrap())
        .ttl(Duration::from_secs(30))
        .build()
        .unwrap();
    let key = |job: &Payout| LockKey::new(format!("payout:{}", job.id));
    // Another worker holds the job's key for the whole test.
    let _holder = locker
        .try_lock(&key(&Payout { id: 1, work_ms: 0 }).unwrap())
        .await
        .unwrap()
        .expect("a free key");
    storage.push(Payout { id: 1, work_ms: 0 }).await.unwrap();

    let ran = Arc::new(AtomicU32::new(0));
    let counted = ran.clone();
    let handler = move |_: Payout| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxDynError>(()) }
    };
    let lock = ApalisLockLayer::new(locker.clone(), key).dead_letter_after(3);
    let worker = WorkerBuilder::new("dead-letter")
        .backend(storage)
        .layer(lock)
        .build(handler);
    let running = tokio::spawn(worker.run());

    // A delivery sent back is scheduled again by apalis-redis at once (the task has run
    // no attempt), so three take a few of its polls; 30 s without the job in the dead
    // set means it never gets there.
    let started = Instant::now();
    loop {
        let dead = require(redis.command(&["SCARD", &dead_set]).await);
        if dead == RespValue::Integer(1) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the job is not in the dead set {:?} after it was pushed ({dead:?})",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.abort();
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the handler ran without the job's lock"
    );
}
