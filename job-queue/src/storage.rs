//! The two apalis storages the strategy tests run on, behind one face, so that each
//! scenario is written once and run on both: apalis-redis with distlock's locks on the
//! same redis-server, and apalis-postgres (its migrations run) with the locks in the same
//! PostgreSQL's lease table, each server started on a free loopback port.
//!
//! Both storages acknowledge a task by the status its context carries, which
//! [`ApalisLockLayer`] sets on a delivery it sends back; they differ in when a task sent
//! back comes again (apalis-redis by its own schedule, apalis-postgres at its next
//! fetch) and in where the tasks it will not deliver again are kept (a dead set, rows
//! marked `Killed`), which [`Queue::dead`] reads.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use apalis::layers::WorkerBuilderExt;
use apalis_core::backend::{BackendConfig, TaskSink};
use apalis_core::error::BoxDynError;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_core::worker::context::WorkerContext;
use apalis_core::worker::event::Event;
use apalis_core::worker::ext::event_listener::EventListenerExt;
use apalis_postgres::PostgresStorage;
use apalis_redis::RedisStorage;
use distlock::Locker;
use distlock::apalis::{ApalisLockLayer, JobLease, job_error};
use distlock::tower::JobError;
use harness::postgres::PostgresServer;
use harness::redis::{RedisServer, RespValue};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinHandle;

use crate::heartbeat::Heartbeats;
use crate::{BoxError, queue_config};

/// Which apalis storage a scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Storage {
    /// apalis-redis; the locks on the same redis-server.
    Redis,
    /// apalis-postgres; the locks in the same PostgreSQL (the lease table).
    Postgres,
}

impl fmt::Display for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Storage::Redis => "apalis-redis",
            Storage::Postgres => "apalis-postgres",
        })
    }
}

/// A server of one storage, started for a scenario; stopped when dropped.
pub struct Server {
    kind: Storage,
    running: Running,
}

enum Running {
    Redis(RedisServer),
    Postgres(PostgresServer),
}

impl Server {
    /// Starts the storage's server on a free loopback port; for PostgreSQL, runs
    /// apalis-postgres's migrations (as the superuser: they create a schema and the
    /// `hstore` extension) and creates distlock's lease table.
    pub async fn start(kind: Storage) -> Result<Self, BoxError> {
        let running = match kind {
            Storage::Redis => Running::Redis(RedisServer::start().await?),
            Storage::Postgres => {
                let server = PostgresServer::start().await?;
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect(&server.superuser_url())
                    .await?;
                PostgresStorage::setup(&pool).await?;
                pool.close().await;
                distlock::setup(&server.superuser_url()).await?;
                Running::Postgres(server)
            }
        };
        Ok(Self { kind, running })
    }

    /// Which storage this is.
    pub fn kind(&self) -> Storage {
        self.kind
    }

    /// The URL of the server, for [`distlock::connect`] and the storage's client.
    pub fn url(&self) -> String {
        match &self.running {
            Running::Redis(server) => server.url(),
            Running::Postgres(server) => server.superuser_url(),
        }
    }

    /// The server's TCP port on 127.0.0.1: the one of [`Self::url`].
    pub fn port(&self) -> u16 {
        match &self.running {
            Running::Redis(server) => server.port(),
            Running::Postgres(server) => server.port(),
        }
    }

    /// A locker on this server, with leases of `ttl`.
    pub async fn locker(&self, ttl: Duration) -> Result<Locker, BoxError> {
        Ok(Locker::builder(distlock::connect(&self.url()).await?)
            .ttl(ttl)
            .build()?)
    }

    /// The queue `name` on this server; see [`Queue::open`].
    pub async fn queue<Args>(&self, name: &str) -> Result<Queue<Args>, BoxError> {
        Queue::open(self.kind, &self.url(), name).await
    }
}

/// How a task the storage will not deliver again ended.
#[derive(Clone, Copy)]
enum Ended {
    Done,
    Killed,
}

/// One apalis queue of jobs `Args`, on either storage.
pub struct Queue<Args> {
    storage: Queues<Args>,
}

enum Queues<Args> {
    Redis(RedisStorage<Args>),
    Postgres(PostgresStorage<Args>),
}

impl<Args> Queue<Args> {
    /// The queue `name` of the `storage` at `url` (set up already: see [`Server::start`]):
    /// heartbeats every second, a worker that missed two taken for dead and its tasks
    /// given to the others, tasks fetched two at a time.
    pub async fn open(storage: Storage, url: &str, name: &str) -> Result<Self, BoxError> {
        let storage = match storage {
            Storage::Redis => {
                let conn = apalis_redis::connect(url).await?;
                Queues::Redis(RedisStorage::new(conn).with_config(queue_config(name)))
            }
            Storage::Postgres => {
                // A worker stopped inside one of apalis-postgres's transactions keeps the
                // rows it locked, and the others' search for orphaned tasks skips locked
                // rows: its tasks would wait for its resume. The server ends such a
                // session once idle that long in its transaction, as a deployment would.
                let options = url
                    .parse::<sqlx::postgres::PgConnectOptions>()?
                    .options([("idle_in_transaction_session_timeout", "2s")]);
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect_with(options)
                    .await?;
                let config = apalis_postgres::Config::default()
                    .queue(format!("payouts-{name}"))
                    .heartbeat_interval(Duration::from_secs(1))
                    .missed_heartbeats(2)
                    .batch_size(2);
                Queues::Postgres(PostgresStorage::new(&pool).with_config(config))
            }
        };
        Ok(Queue { storage })
    }

    /// A queue on apalis-redis `storage`, configured by the caller (its connection's
    /// timeouts, its heartbeats).
    pub fn on_redis(storage: RedisStorage<Args>) -> Self {
        Queue {
            storage: Queues::Redis(storage),
        }
    }
}

impl<Args> Queue<Args>
where
    Args: Serialize + DeserializeOwned + Send + Sync + Unpin + 'static,
{
    /// Pushes a job.
    pub async fn push(&mut self, args: Args) -> Result<(), BoxError> {
        match &mut self.storage {
            Queues::Redis(storage) => storage.push(args).await?,
            Queues::Postgres(storage) => storage.push(args).await?,
        }
        Ok(())
    }

    /// Pushes a job due `delay` from now: no worker takes it before.
    pub async fn push_after(&mut self, args: Args, delay: Duration) -> Result<(), BoxError> {
        let task = TaskBuilder::new(args).run_after(delay).build();
        match &mut self.storage {
            Queues::Redis(storage) => storage.push_task(task).await?,
            Queues::Postgres(storage) => storage.push_task(task).await?,
        }
        Ok(())
    }

    /// Tasks of this queue the storage will not deliver again as failed (killed:
    /// dead-lettered).
    pub async fn dead(&self, server: &Server) -> Result<u64, BoxError> {
        self.count(server, Ended::Killed).await
    }

    /// Tasks of this queue the storage has recorded done.
    pub async fn done(&self, server: &Server) -> Result<u64, BoxError> {
        self.count(server, Ended::Done).await
    }

    /// Where each task of this queue stands, for the message of a test that waited in
    /// vain: on Redis, [`crate::queue_state::describe`]; on PostgreSQL, each task's row
    /// (status, attempts, when it may run, which worker locked it and when, its last
    /// result) and each worker's last heartbeat.
    pub async fn state(&self, server: &Server) -> Result<String, BoxError> {
        match (&self.storage, &server.running) {
            (Queues::Redis(storage), Running::Redis(redis)) => {
                let mut conn = apalis_redis::connect(redis.url()).await?;
                crate::queue_state::describe(&mut conn, storage.get_config()).await
            }
            (Queues::Postgres(storage), Running::Postgres(_)) => {
                let rows: Vec<(String,)> = sqlx::query_as(
                    "(SELECT format('  task %s: %s, attempts %s of %s, run_at %s, locked by %s \
                     at %s, done_at %s, last result %s', id, status, attempts, max_attempts, \
                     run_at, lock_by, lock_at, done_at, last_result) \
                     FROM apalis.jobs WHERE job_type = $1 ORDER BY run_at) \
                     UNION ALL \
                     (SELECT format('  worker %s: last seen %s', id, last_seen) \
                     FROM apalis.workers WHERE worker_type = $1)",
                )
                .bind(storage.config().queue.to_string())
                .fetch_all(storage.pool())
                .await?;
                let now: (String,) = sqlx::query_as("SELECT now()::text")
                    .fetch_one(storage.pool())
                    .await?;
                let lines: Vec<String> = rows.into_iter().map(|(line,)| line).collect();
                Ok(format!(
                    "queue state (server clock {}):\n{}",
                    now.0,
                    lines.join("\n")
                ))
            }
            _ => Err("the queue is not on this server".into()),
        }
    }

    async fn count(&self, server: &Server, ended: Ended) -> Result<u64, BoxError> {
        match (&self.storage, &server.running) {
            (Queues::Redis(storage), Running::Redis(redis)) => {
                let config = storage.get_config();
                let set = match ended {
                    Ended::Done => config.done_jobs_set(),
                    Ended::Killed => config.dead_jobs_set(),
                };
                match redis.command(&["SCARD", &set]).await? {
                    RespValue::Integer(n) => Ok(u64::try_from(n)?),
                    other => Err(format!("SCARD {set} answered {other:?}").into()),
                }
            }
            (Queues::Postgres(storage), Running::Postgres(_)) => {
                let status = match ended {
                    Ended::Done => "Done",
                    Ended::Killed => "Killed",
                };
                let count: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM apalis.jobs WHERE job_type = $1 AND status = $2",
                )
                .bind(storage.config().queue.to_string())
                .bind(status)
                .fetch_one(storage.pool())
                .await?;
                Ok(u64::try_from(count)?)
            }
            _ => Err("the queue is not on this server".into()),
        }
    }

    /// Starts a worker `name` on this queue, in a task of its own: at most `concurrency`
    /// jobs at a time, each under `lock`, run by `handler`; each delivery that found its
    /// key held printed as `missed <key>`. Abort the handle to stop it.
    pub fn work<H, Fut>(
        &self,
        name: &str,
        concurrency: usize,
        lock: ApalisLockLayer<Args>,
        handler: H,
    ) -> JoinHandle<()>
    where
        H: Fn(Args, JobLease) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxDynError>> + Send + 'static,
    {
        let name = name.to_owned();
        // The same worker on either storage; the builder's type differs with it.
        macro_rules! spawn_on {
            ($storage:expr) => {{
                // See `Heartbeats`: apalis alone can leave an idle worker waiting for ever.
                let interval = BackendConfig::config($storage).heartbeat_interval;
                let worker = WorkerBuilder::new(name.as_str())
                    .backend(Heartbeats::new($storage.clone(), interval))
                    .on_event(say_misses)
                    .concurrency(concurrency)
                    .layer(lock)
                    .build(handler);
                tokio::spawn(async move {
                    if let Err(e) = worker.run().await {
                        eprintln!("worker {name} stopped: {e}");
                    }
                })
            }};
        }
        match &self.storage {
            Queues::Redis(storage) => spawn_on!(storage),
            Queues::Postgres(storage) => spawn_on!(storage),
        }
    }
}

/// Prints `missed <key>` for a delivery the lock layer sent back because its key was held.
fn say_misses(_: &WorkerContext, event: &Event) {
    if let Event::Error(e) = event
        && let Some(JobError::Busy { key }) = job_error(&***e)
    {
        println!("missed {}", key.as_str());
    }
}

/// Stamps one test per storage for a scenario `async fn name(storage: Storage)`: a
/// module `name` with the tests `on_apalis_redis` and `on_apalis_postgres`.
#[macro_export]
macro_rules! on_each_storage {
    ($($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_apalis_redis() {
                super::$scenario($crate::storage::Storage::Redis).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_apalis_postgres() {
                super::$scenario($crate::storage::Storage::Postgres).await;
            }
        }
    )+};
}
