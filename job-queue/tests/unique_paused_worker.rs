//! Until executed with worker processes of the `job-queue` binary, on apalis's Redis and
//! PostgreSQL storages, the worker running a report stopped (SIGSTOP) mid-run.
//!
//! Past its lock TTL: the queue gives the report to another worker, which runs it to the
//! end under a newer token while a duplicate is refused at the producer; the stopped
//! worker, resumed, does not finish its stale run (the layer drops it on the lost lease).
//! The report is built once, recorded done, and its key is free again afterwards.
//!
//! Killed (SIGKILL) mid-run: the report is given to another worker likewise, built once
//! and recorded done.
//!
//! Within its lock TTL, but past the queue's heartbeat timeout: the queue delivers the
//! report again, carrying the same claim, while the stopped run still holds it; that
//! delivery is a miss, not a second run under the same token. The report runs again, if
//! at all, only once the first run has ended, under a newer token, and is recorded done.

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::tower::run_key;
use distlock::{FencingToken, Locker};
use job_queue::on_each_storage;
use job_queue::storage::{Queue, Server, Storage};
use job_queue::strategy_worker::{QUEUE, Report, TTL, key};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::time::Instant;

/// A worker process and the lines it has printed.
struct Worker {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    fn spawn(storage: Storage, url: &str, name: &str, ttl: Duration) -> Worker {
        let storage = match storage {
            Storage::Redis => "redis",
            Storage::Postgres => "postgres",
        };
        let mut child = tokio::process::Command::new(Path::new(env!("CARGO_BIN_EXE_job-queue")))
            .args(["strategy-worker", "--storage", storage, "--url", url])
            .args(["--name", name])
            .args(["--ttl-ms", &ttl.as_millis().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let (printed, stdout) = (lines.clone(), child.stdout.take().unwrap());
        tokio::spawn(async move {
            let mut stdout = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = stdout.next_line().await {
                printed.lock().unwrap().push(line);
            }
        });
        Worker { child, lines }
    }

    /// The token of this worker's line `<what> <id> <token>` for report `id`, if printed.
    fn token(&self, what: &str, id: u32) -> Option<u64> {
        let prefix = format!("{what} {id} ");
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .find_map(|line| line.strip_prefix(&prefix)?.parse().ok())
    }

    /// The tokens of every line `<what> <id> <token>` this worker printed for report `id`.
    fn tokens(&self, what: &str, id: u32) -> Vec<u64> {
        let prefix = format!("{what} {id} ");
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter_map(|line| line.strip_prefix(&prefix)?.parse().ok())
            .collect()
    }

    fn printed(&self, line: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l == line)
    }

    fn signal(&self, signal: Signal) {
        let pid = self.child.id().expect("a running worker");
        kill(Pid::from_raw(pid as i32), signal).unwrap();
    }
}

/// What every worker printed, for a failure's message.
fn transcript(workers: &[Worker]) -> String {
    let mut all = String::new();
    for (i, worker) in workers.iter().enumerate() {
        let lines = worker.lines.lock().unwrap();
        all.push_str(&format!("\n  worker-{i}: {}", lines.join(" | ")));
    }
    all
}

async fn until<T>(what: &str, within: Duration, mut found: impl AsyncFnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(found) = found().await {
            return found;
        }
        assert!(started.elapsed() < within, "{what}: not after {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether a producer can claim report 1's key now (and so would enqueue a duplicate);
/// the claim taken, if any, is released at once.
async fn duplicate_claimed(producer: &Locker) -> bool {
    let claim = producer
        .claim(&key(1).unwrap(), Duration::from_secs(60))
        .await
        .unwrap();
    let Some(claim) = claim else {
        return false;
    };
    if let Some(guard) = producer.resume(&claim).await.unwrap() {
        guard.release().await.unwrap();
    }
    true
}

/// The server, report 1 pushed under its producer's claim (2 s of work), a producer's
/// locker, and three workers with leases of `ttl`.
async fn start(storage: Storage, ttl: Duration) -> (Server, Queue<Report>, Locker, Vec<Worker>) {
    let server = Server::start(storage).await.unwrap();
    let mut queue = server.queue::<Report>(QUEUE).await.unwrap();
    let producer = server.locker(TTL).await.unwrap();
    let claim = producer
        .claim(&key(1).unwrap(), Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a free key");
    queue
        .push(Report {
            id: 1,
            claim: Some(claim),
            work_ms: 2_000,
        })
        .await
        .unwrap();
    let workers: Vec<Worker> = (0..3)
        .map(|i| Worker::spawn(storage, &server.url(), &format!("worker-{i}"), ttl))
        .collect();

    (server, queue, producer, workers)
}

/// The worker that started report 1 first, and its run's token.
async fn first_run(workers: &[Worker]) -> (usize, u64) {
    until("report 1 started", Duration::from_secs(30), async || {
        workers
            .iter()
            .enumerate()
            .find_map(|(i, w)| Some((i, w.token("started", 1)?)))
    })
    .await
}

/// The earliest instant the store may free report 1's run key once the first run, under
/// `first_token`, was stopped or killed: its lease runs out a TTL after its grant or last
/// renewal, which may be before the stop, so not a TTL after the stop. A lower bound:
/// the remaining time the store states, counted from before it was asked (or now, when
/// the key is no longer the first run's).
async fn first_lease_ends_no_sooner_than(producer: &Locker, first_token: u64) -> Instant {
    let run_key = run_key(&key(1).unwrap()).unwrap();
    let asked = Instant::now();
    let info = producer.backend().inspect(&run_key).await.unwrap();
    match info.remaining {
        // Less a millisecond: stores round the time they state (Redis to the ms).
        Some(remaining) if info.token == Some(FencingToken(first_token)) => {
            asked + remaining.saturating_sub(Duration::from_millis(1))
        }
        _ => asked,
    }
}

/// Once worker `first`, whose run of report 1 under `first_token` was stopped or killed,
/// is taken for dead by the queue: the worker that runs report 1 next, and its token,
/// once that run has refused a duplicate and finished. The next run must start no sooner
/// than `lease_end` (see [`first_lease_ends_no_sooner_than`]).
async fn taken_over(
    storage: Storage,
    workers: &[Worker],
    first: usize,
    first_token: u64,
    lease_end: Instant,
) -> (usize, u64) {
    // The queue takes the worker for dead and gives the report to another.
    let (second, second_token) = until(
        "report 1 given to another worker",
        Duration::from_secs(30),
        async || {
            workers
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != first)
                .find_map(|(i, w)| Some((i, w.token("started", 1)?)))
        },
    )
    .await;
    assert!(
        Instant::now() >= lease_end,
        "{storage}: report 1 ran again {:?} before the stopped worker's lease could end:{}",
        lease_end - Instant::now(),
        transcript(workers)
    );
    assert!(
        second_token > first_token,
        "{storage}: the second run's token {second_token} is not newer than {first_token}:{}",
        transcript(workers)
    );

    // While it runs, a duplicate is refused at the producer (the run tries one itself),
    // and it runs to the end.
    let probed = until(
        "the second run's probe",
        Duration::from_secs(10),
        async || {
            let lines = workers[second].lines.lock().unwrap();
            lines
                .iter()
                .find_map(|line| line.strip_prefix("probed 1 ").map(str::to_owned))
        },
    )
    .await;
    assert_eq!(
        probed,
        "refused",
        "{storage}: a duplicate of report 1 was claimed while it ran:{}",
        transcript(workers)
    );
    until(
        "the second run finished",
        Duration::from_secs(30),
        async || workers[second].token("finished", 1),
    )
    .await;

    (second, second_token)
}

/// The end of a run taken over: report 1 recorded done once, and its key free again (the
/// next report 1 may be enqueued); then the workers are killed.
async fn done_once_and_free(
    server: &Server,
    queue: &Queue<Report>,
    producer: &Locker,
    workers: Vec<Worker>,
) {
    until(
        "report 1 recorded done",
        Duration::from_secs(10),
        async || (queue.done(server).await.unwrap() == 1).then_some(()),
    )
    .await;
    until("report 1's key free", Duration::from_secs(10), async || {
        duplicate_claimed(producer).await.then_some(())
    })
    .await;
    for mut worker in workers {
        let _ = worker.child.kill().await;
    }
}

on_each_storage!(
    until_executed_a_worker_stopped_past_its_ttl_neither_finishes_nor_loses_the_job,
    until_executed_a_worker_killed_mid_run_does_not_lose_the_job,
    until_executed_a_delivery_while_a_stopped_worker_holds_the_claim_waits_for_its_run
);

async fn until_executed_a_worker_stopped_past_its_ttl_neither_finishes_nor_loses_the_job(
    storage: Storage,
) {
    let (server, queue, producer, workers) = start(storage, TTL).await;

    // The first run is stopped as soon as it starts, its lease left to run out.
    let (first, first_token) = first_run(&workers).await;
    workers[first].signal(Signal::SIGSTOP);
    let lease_end = first_lease_ends_no_sooner_than(&producer, first_token).await;

    let (second, second_token) = taken_over(storage, &workers, first, first_token, lease_end).await;

    // The stopped worker, resumed, drops its stale run instead of finishing it.
    workers[first].signal(Signal::SIGCONT);
    let stale = &workers[first];
    let ended = until("the stale run ended", Duration::from_secs(10), async || {
        let finished = stale.token("finished", 1).map(|_| "finished");
        finished.or_else(|| stale.token("dropped", 1).map(|_| "dropped"))
    })
    .await;
    assert_eq!(
        ended,
        "dropped",
        "{storage}: the stopped worker, resumed, finished its stale run:{}",
        transcript(&workers)
    );
    for (i, worker) in workers.iter().enumerate() {
        assert_eq!(
            worker.token("finished", 1),
            (i == second).then_some(second_token),
            "{storage}: worker-{i}: report 1 finished elsewhere than in its second run:{}",
            transcript(&workers)
        );
    }
    done_once_and_free(&server, &queue, &producer, workers).await;
}

async fn until_executed_a_delivery_while_a_stopped_worker_holds_the_claim_waits_for_its_run(
    storage: Storage,
) {
    // Longer than the queue takes to give a stopped worker's tasks to the others.
    const LONG_TTL: Duration = Duration::from_secs(8);
    let (server, queue, _producer, workers) = start(storage, LONG_TTL).await;
    let (first, first_token) = first_run(&workers).await;
    workers[first].signal(Signal::SIGSTOP);
    let stopped = Instant::now();

    // The queue takes the stopped worker for dead and delivers the report again.
    until(
        "report 1 delivered again",
        Duration::from_secs(30),
        async || {
            let again = workers.iter().enumerate().any(|(i, w)| {
                i != first && (w.printed("missed report:1") || w.token("started", 1).is_some())
            });
            again.then_some(())
        },
    )
    .await;
    workers[first].signal(Signal::SIGCONT);
    assert!(
        stopped.elapsed() < LONG_TTL / 2,
        "{storage}: the report was delivered again {:?} after the stop, too late for this \
         case (the stopped run's lease must still be valid):{}",
        stopped.elapsed(),
        transcript(&workers)
    );

    // The stopped run ends; any other run of the report came after it, under a newer
    // token.
    until(
        "the stopped run ended",
        Duration::from_secs(30),
        async || {
            let stale = &workers[first];
            (stale.token("finished", 1).is_some() || stale.token("dropped", 1).is_some())
                .then_some(())
        },
    )
    .await;
    // Recorded done once: by the stopped run's worker, or by a later run of the report.
    until(
        "report 1 recorded done",
        Duration::from_secs(30),
        async || (queue.done(&server).await.unwrap() == 1).then_some(()),
    )
    .await;
    for (i, worker) in workers.iter().enumerate().filter(|&(i, _)| i != first) {
        for token in worker.tokens("started", 1) {
            assert!(
                token > first_token,
                "{storage}: worker-{i} ran report 1 under token {token} beside the stopped \
                 run's {first_token}:{}",
                transcript(&workers)
            );
        }
    }
    for mut worker in workers {
        let _ = worker.child.kill().await;
    }
}

async fn until_executed_a_worker_killed_mid_run_does_not_lose_the_job(storage: Storage) {
    let (server, queue, producer, workers) = start(storage, TTL).await;
    let (first, first_token) = first_run(&workers).await;
    workers[first].signal(Signal::SIGKILL);
    let lease_end = first_lease_ends_no_sooner_than(&producer, first_token).await;
    let (second, _) = taken_over(storage, &workers, first, first_token, lease_end).await;
    assert_ne!(second, first);
    assert_eq!(
        workers[first].token("finished", 1),
        None,
        "{storage}: the killed run finished:{}",
        transcript(&workers)
    );
    done_once_and_free(&server, &queue, &producer, workers).await;
}
