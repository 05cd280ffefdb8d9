//! A storage whose idle worker keeps its heartbeat.
//!
//! apalis-core 1.0 drives the storages of apalis-redis and apalis-postgres (its
//! `Persisted`) from the worker's own task: a timer for the heartbeat, a fetch when the
//! worker can take a job. It looks at the heartbeat timer only while no fetch is in
//! flight. A timer that comes due during a fetch wakes the worker for a poll that does not
//! look at it, and when that fetch brings nothing, the worker waits with nothing left to
//! wake it: it neither heartbeats nor fetches again until a job it runs ends, which on an
//! idle worker is never. The storage then takes the worker for dead and gives its jobs
//! to others, and the jobs it would fetch (a retry due later, a job pushed meanwhile) wait
//! for another worker. It takes a fetch in flight at the moment the heartbeat comes due:
//! a fetch slower than the heartbeat interval, or a job that ends (the worker fetches at
//! once) just before a heartbeat, which a loaded machine makes likely. A job stopped for
//! its lost lease ends one lease time after it started, close to the first heartbeat
//! after it when the two are equal: `tests/lost_lease.rs` failed this way in about one
//! loaded workspace run in ten, and in one of 33 runs of it alone beside two CPU-bound
//! processes.
//!
//! [`Heartbeats`] wraps such a storage and wakes its worker again half a heartbeat interval
//! after each time the storage left it waiting, so the storage's timer is looked at within
//! half an interval of coming due: a heartbeat is at most that late, and the worker fetches
//! at least that often while idle (each wake-up fetches). `tests/idle_worker.rs` shows a
//! worker kept alive by it that apalis alone leaves waiting.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::backend::{Backend, BackendConfig, WireFormatBackend};
use apalis_core::worker::context::WorkerContext;
use tokio::time::{Instant, Sleep};

/// A storage `B` whose worker is woken within half a heartbeat interval whenever the
/// storage leaves it waiting; see the module docs.
#[derive(Debug)]
pub struct Heartbeats<B> {
    inner: B,
    /// Half the storage's heartbeat interval.
    period: Duration,
    /// When the waiting worker is woken next; made on the first wait.
    wake: Option<Pin<Box<Sleep>>>,
}

impl<B> Heartbeats<B> {
    /// `storage`, whose heartbeat interval is `heartbeat_interval`.
    pub fn new(storage: B, heartbeat_interval: Duration) -> Self {
        Self {
            inner: storage,
            period: heartbeat_interval / 2,
            wake: None,
        }
    }

    /// Has the task polling now woken once the period from now (or from the last such
    /// wake-up still to come) has passed.
    fn wake_later(&mut self, cx: &mut Context<'_>) {
        let period = self.period;
        let wake = self
            .wake
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(period)));
        if wake.as_mut().poll(cx).is_ready() {
            wake.as_mut().reset(Instant::now() + period);
            // Pending: it registers this task's waker.
            let _ = wake.as_mut().poll(cx);
        }
    }
}

impl<B: Clone> Clone for Heartbeats<B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            period: self.period,
            wake: None,
        }
    }
}

impl<B: Backend> Backend for Heartbeats<B> {
    type Task = B::Task;
    type Error = B::Error;

    fn poll_ready(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx, worker)
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Option<Result<Self::Task, Self::Error>>> {
        let next = self.inner.poll_next(cx, worker);
        if next.is_pending() {
            self.wake_later(cx);
        }
        next
    }

    fn poll_close(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_close(cx, worker)
    }
}

impl<B: BackendConfig> BackendConfig for Heartbeats<B> {
    type Args = B::Args;
    type Id = B::Id;
    type Kind = B::Kind;
    type Config = B::Config;
    type Layer = B::Layer;

    fn config(&self) -> &Self::Config {
        self.inner.config()
    }

    fn middleware(&mut self, worker: &mut WorkerContext) -> Self::Layer {
        self.inner.middleware(worker)
    }
}

impl<B: WireFormatBackend> WireFormatBackend for Heartbeats<B> {
    type Codec = B::Codec;
    type Compact = B::Compact;

    fn codec(&self) -> &Self::Codec {
        self.inner.codec()
    }
}
