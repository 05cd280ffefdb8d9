//! The lock layer in a real apalis worker (its Redis storage, against a redis-server the
//! test starts) whose job runs one at a time: a concurrency limit inside the layer. While
//! that one job runs, the worker fetches no other, so no lease is held for a job it cannot
//! run, and the next job goes to another worker instead of waiting behind the first.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis::layers::WorkerBuilderExt;
use apalis_core::backend::TaskSink;
use apalis_core::task::Task;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_redis::RedisStorage;
use distlock::tower::{LockLayer, Locked};
use distlock::{LockError, LockKey, Locker};
use harness::redis::RedisServer;
use harness::require;
use tokio::sync::{Semaphore, mpsc};
use tower::limit::ConcurrencyLimit;
use tower_layer::Layer;
use tower_service::Service;

/// What the test sees of a worker, by the worker's name.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// The worker asked for readiness and had to wait: it fetched nothing.
    Waited(&'static str),
    /// The worker fetched job `id` and called the layer with it.
    Took(&'static str, u32),
    /// Job `id` ran under its lock.
    Ran(&'static str, u32),
}

/// The job: says it runs, then waits for the gate.
#[derive(Clone)]
struct Job {
    worker: &'static str,
    seen: mpsc::UnboundedSender<Seen>,
    gate: Arc<Semaphore>,
}

impl Service<Locked<Task<u32>>> for Job {
    type Response = u32;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<u32, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, locked: Locked<Task<u32>>) -> Self::Future {
        let (id, job) = (locked.request.args, self.clone());
        Box::pin(async move {
            job.seen.send(Seen::Ran(job.worker, id)).unwrap();
            drop(job.gate.acquire().await);
            Ok(id)
        })
    }
}

/// Between apalis and the layer: reports each wait for readiness and each job taken.
#[derive(Clone)]
struct Probe<S> {
    inner: S,
    worker: &'static str,
    seen: mpsc::UnboundedSender<Seen>,
    waiting: bool,
}

impl<S: Service<Task<u32>>> Service<Task<u32>> for Probe<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        let ready = self.inner.poll_ready(cx);
        if ready.is_pending() && !self.waiting {
            self.seen.send(Seen::Waited(self.worker)).unwrap();
        }
        self.waiting = ready.is_pending();
        ready
    }

    fn call(&mut self, task: Task<u32>) -> Self::Future {
        self.seen.send(Seen::Took(self.worker, task.args)).unwrap();
        self.inner.call(task)
    }
}

fn key_of(task: &Task<u32>) -> Result<LockKey, LockError> {
    LockKey::new(format!("capacity:{}", task.args))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_at_capacity_takes_no_job_and_no_lock_and_another_worker_runs_it() {
    let redis = require(RedisServer::start().await);
    // One task per fetch, so a fetch is one job taken.
    let config = apalis_redis::Config::default()
        .queue("capacity")
        .batch_size(1);
    let conn = apalis_redis::connect(redis.url().as_str()).await.unwrap();
    let mut storage = RedisStorage::<u32>::new(conn).with_config(config);
    storage.push(1).await.unwrap();
    storage.push(2).await.unwrap();
    let locker = Locker::builder(distlock::connect(&redis.url()).await.unwrap())
        .ttl(Duration::from_secs(10))
        .build()
        .unwrap();
    let layer = LockLayer::new(locker.clone(), key_of);
    let (seen, mut events) = mpsc::unbounded_channel();

    // Worker a: two jobs at a time for apalis, one at a time inside the layer.
    let gate = Arc::new(Semaphore::new(0));
    let job = Job {
        worker: "a",
        seen: seen.clone(),
        gate: gate.clone(),
    };
    let a = Probe {
        inner: layer.layer(ConcurrencyLimit::new(job, 1)),
        worker: "a",
        seen: seen.clone(),
        waiting: false,
    };
    let worker_a = tokio::spawn(
        WorkerBuilder::new("a")
            .backend(storage.clone())
            .concurrency(2)
            .build(a)
            .run(),
    );
    let Some(Seen::Took("a", first)) = events.recv().await else {
        panic!("worker a took no job first");
    };
    let second = 3 - first;
    let mut next = vec![events.recv().await.unwrap(), events.recv().await.unwrap()];
    next.sort_by_key(|seen| format!("{seen:?}"));
    assert_eq!(
        next,
        [Seen::Ran("a", first), Seen::Waited("a")],
        "while job {first} runs, worker a waits instead of taking job {second}"
    );
    let info = locker
        .backend()
        .inspect(&LockKey::new(format!("capacity:{second}")).unwrap())
        .await
        .unwrap();
    assert_eq!(
        info.owner, None,
        "job {second}'s key is free while job {first} runs"
    );
    assert_eq!(locker.held(), 1, "one lease renewed: job {first}'s");

    // Worker b, free: it runs job `second` while job `first` still runs on worker a.
    let b = Probe {
        inner: layer.layer(Job {
            worker: "b",
            seen: seen.clone(),
            gate: Arc::new(Semaphore::new(Semaphore::MAX_PERMITS)),
        }),
        worker: "b",
        seen,
        waiting: false,
    };
    let worker_b = tokio::spawn(WorkerBuilder::new("b").backend(storage).build(b).run());
    let mut on_b = Vec::new();
    while on_b.len() < 2 {
        let event = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .unwrap_or_else(|_| panic!("job {second} did not run on worker b within 30 s"))
            .unwrap();
        assert_ne!(event, Seen::Took("a", second), "worker a took job {second}");
        if matches!(event, Seen::Took("b", _) | Seen::Ran("b", _)) {
            on_b.push(event);
        }
    }
    assert_eq!(on_b, [Seen::Took("b", second), Seen::Ran("b", second)]);
    let info = locker
        .backend()
        .inspect(&LockKey::new(format!("capacity:{first}")).unwrap())
        .await
        .unwrap();
    assert!(info.owner.is_some(), "job {first} still runs on worker a");

    gate.add_permits(1);
    worker_a.abort();
    worker_b.abort();
}
