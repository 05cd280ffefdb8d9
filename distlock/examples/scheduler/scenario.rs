//! The scenario of the `scheduler` example, shared with its test: three scheduler
//! processes elect one leader for a role; the leader enqueues a job every 100 ms into a
//! PostgreSQL table, each insert admitted by the fencing token in the same transaction.
//!
//! What goes wrong on purpose: the leader is stopped with SIGSTOP while it waits to fire
//! its next interval, past its lease's TTL. A standby takes over with a higher token. The
//! stopped process is resumed with SIGCONT; its timer fires at once and it tries to
//! enqueue the interval it had armed, with its old token. Its leadership check was made
//! before the pause, as every scheduler's is; the fence in the job table is what refuses
//! the write.
//!
//! The parent process runs [`run`]: it starts the children (the same executable, called
//! with `--child`, see [`child_main`]), reads what they print, stops and resumes the
//! leader, and audits the job table at the end.

use std::collections::HashMap;
use std::error::Error;
use std::fmt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use distlock::postgres::{PgBuilder, PgFencedResource};
use distlock::{Admission, Election, EnforcementMode, FencingToken, Locker};
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{Notify, mpsc};
use tokio::time::{Instant, sleep, timeout_at};

/// Any error of the scenario, boxed: it is an example, and every error ends the run.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// The leadership lease's TTL: short, so the stopped leader is replaced quickly.
const TTL: Duration = Duration::from_millis(500);
/// How often the leader enqueues a job.
const INTERVAL_MS: u64 = 100;
/// The schema of distlock's tables (leases, fencing).
const SCHEMA: &str = "distlock";
/// How many schedulers run.
const SCHEDULERS: u32 = 3;
/// How long any one step of the run may take before the run fails.
const STEP: Duration = Duration::from_secs(30);

/// The PostgreSQL lease backend on `url`, whose pool also carries the job table.
fn backend(url: &str) -> Result<distlock::postgres::PgLeaseBackend, BoxError> {
    Ok(PgBuilder::new(url)
        .schema(SCHEMA)
        .pool_size(4)
        .build_lease_backend()?)
}

/// The role the schedulers of run `run` elect a leader for.
fn role(run: &str) -> String {
    format!("scheduler-example:{run}")
}

/// The fenced resource every enqueue of run `run` is admitted by.
fn resource(run: &str) -> String {
    format!("scheduler-jobs:{run}")
}

/// The 100 ms interval `at` falls in, counted from the Unix epoch. All schedulers run on
/// one machine here, so they agree on it.
fn interval_at(at: SystemTime) -> i64 {
    let ms = at
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    i64::try_from(ms / u128::from(INTERVAL_MS)).unwrap_or(i64::MAX)
}

/// How long until interval `interval` starts (zero if it has).
fn until_interval(interval: i64) -> Duration {
    let start = UNIX_EPOCH
        + Duration::from_millis(
            u64::try_from(interval)
                .unwrap_or(0)
                .saturating_mul(INTERVAL_MS),
        );
    start
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

// ---------------------------------------------------------------------------------------
// The child: one scheduler process.

/// One scheduler process: campaigns for the role, and while it leads, arms the next
/// interval, waits for it, and enqueues it with its token. It prints one line per event
/// (`elected`, `armed`, `firing`, `triggered`, `rejected`, `lost`, `resigned`) for the
/// parent, and resigns and exits when its stdin closes.
pub async fn child_main(id: u32, postgres_url: &str, run: &str) -> Result<(), BoxError> {
    let backend = backend(postgres_url)?;
    let pool = backend.pool().clone();
    let fenced = PgFencedResource::new(pool.clone(), SCHEMA, EnforcementMode::Enforce)?;
    let locker = Locker::builder(Arc::new(backend)).ttl(TTL).build()?;
    let election = Election::new(locker, &role(run))?;

    let shutdown = Arc::new(Notify::new());
    let notify = shutdown.clone();
    // A thread, not a task: reading stdin blocks.
    std::thread::spawn(move || {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        notify.notify_one();
    });

    loop {
        let leadership = tokio::select! {
            elected = election.campaign() => elected?,
            () = shutdown.notified() => return Ok(()),
        };
        let token = leadership.token();
        println!("elected {token}");
        loop {
            // The check a scheduler makes before it arms its timer. A pause between here
            // and the write below makes it stale; the fence in the table decides then.
            if !leadership.is_leader() {
                println!("lost {token}");
                break;
            }
            let next = interval_at(SystemTime::now()) + 1;
            println!("armed {next}");
            tokio::select! {
                () = sleep(until_interval(next)) => {}
                () = shutdown.notified() => {
                    leadership.resign().await?;
                    println!("resigned {token}");
                    return Ok(());
                }
            }
            println!("firing {next}");
            match enqueue(&pool, &fenced, run, id, next, token).await? {
                Admission::Stale { latest } | Admission::ShadowStale { latest } => {
                    println!("rejected {next} {token} {latest}");
                }
                Admission::Admitted => println!("triggered {next} {token}"),
            }
        }
    }
}

/// Enqueues the job of `interval` for scheduler `id` with `token`, in one transaction with
/// the fencing check; nothing is written unless the token is admitted.
async fn enqueue(
    pool: &PgPool,
    fenced: &PgFencedResource,
    run: &str,
    id: u32,
    interval: i64,
    token: FencingToken,
) -> Result<Admission, BoxError> {
    let mut tx = pool.begin().await?;
    let admission = fenced.admit_in(&mut tx, &resource(run), token).await?;
    if admission != Admission::Admitted {
        return Ok(admission);
    }
    sqlx::query(
        "INSERT INTO scheduler_jobs (run, interval_no, scheduler, fencing_token) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(run)
    .bind(interval)
    .bind(i32::try_from(id)?)
    .bind(i64::try_from(token.get())?)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(admission)
}

// ---------------------------------------------------------------------------------------
// The parent: starts the schedulers, pauses the leader, audits the table.

/// What happened, from the children's lines and the job table.
#[derive(Debug, Default)]
pub struct Report {
    /// Triggers in the table per term: (scheduler, token, jobs, first and last interval).
    pub terms: Vec<(i32, i64, i64, i64, i64)>,
    /// The scheduler that was stopped, and its token.
    pub stopped: Option<(u32, FencingToken)>,
    /// The scheduler that took over from it, and its token.
    pub successor: Option<(u32, FencingToken)>,
    /// Triggers the fence refused (from the children's lines): (scheduler, interval, token).
    pub stale_rejected: Vec<(u32, i64, FencingToken)>,
    /// Jobs in the table enqueued after a job with a higher token (in insertion order,
    /// which the fence's row lock makes the admission order): a stale leader's trigger
    /// that was accepted. Must be zero.
    pub stale_accepted: i64,
    /// Intervals with more than one job. Must be empty.
    pub doubled: Vec<i64>,
    /// Intervals between the first and last job without one (the failover gap).
    pub missed: i64,
}

impl Report {
    /// True when a standby took over, the stopped leader's late trigger was refused, no
    /// stale trigger was accepted and no interval was triggered twice.
    pub fn is_correct(&self) -> bool {
        self.successor.is_some()
            && !self.stale_rejected.is_empty()
            && self.stale_accepted == 0
            && self.doubled.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "triggers per leader (from the job table):")?;
        for (scheduler, token, jobs, first, last) in &self.terms {
            writeln!(
                f,
                "  scheduler {scheduler}  token {token}: {jobs:>3} jobs, intervals {first}..={last}"
            )?;
        }
        if let (Some((stopped, old)), Some((next, new))) = (self.stopped, self.successor) {
            writeln!(
                f,
                "scheduler {stopped} (token {old}) was stopped past its TTL; scheduler {next} took over with token {new}"
            )?;
        }
        writeln!(
            f,
            "stale triggers refused by the fence:  {}",
            self.stale_rejected.len()
        )?;
        for (scheduler, interval, token) in &self.stale_rejected {
            writeln!(
                f,
                "  scheduler {scheduler} fired interval {interval} with token {token} after it resumed"
            )?;
        }
        writeln!(
            f,
            "stale triggers accepted:              {}",
            self.stale_accepted
        )?;
        writeln!(
            f,
            "intervals triggered twice:            {:?}",
            self.doubled
        )?;
        write!(f, "intervals missed during the failover: {}", self.missed)
    }
}

/// One line a child printed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    Elected(FencingToken),
    Armed(i64),
    Firing(i64),
    Triggered(i64),
    Rejected(i64, FencingToken),
    Other,
}

fn parse(line: &str) -> Event {
    let words: Vec<&str> = line.split_whitespace().collect();
    let num = |i: usize| words.get(i).and_then(|w| w.parse::<i64>().ok());
    let token = |i: usize| {
        words
            .get(i)
            .and_then(|w| w.parse::<u64>().ok())
            .map(FencingToken)
    };
    match (words.first().copied(), num(1)) {
        (Some("elected"), _) => token(1).map_or(Event::Other, Event::Elected),
        (Some("armed"), Some(n)) => Event::Armed(n),
        (Some("firing"), Some(n)) => Event::Firing(n),
        (Some("triggered"), Some(n)) => Event::Triggered(n),
        (Some("rejected"), Some(n)) => token(2).map_or(Event::Other, |t| Event::Rejected(n, t)),
        _ => Event::Other,
    }
}

/// The running children and what they print.
struct Schedulers {
    children: Vec<Child>,
    lines: mpsc::UnboundedReceiver<(u32, Event)>,
    rejected: Vec<(u32, i64, FencingToken)>,
    /// Each child's token of its latest election: a leader that lost its lease (a late
    /// renewal on a loaded machine) and was elected again holds a newer one.
    terms: HashMap<u32, FencingToken>,
}

impl Schedulers {
    /// Starts `SCHEDULERS` copies of this executable with `--child`.
    fn start(postgres_url: &str, run: &str) -> Result<Self, BoxError> {
        let exe = std::env::current_exe()?;
        let (sender, lines) = mpsc::unbounded_channel();
        let mut children = Vec::new();
        for id in 1..=SCHEDULERS {
            let mut child = Command::new(&exe)
                .args(["--child", &id.to_string(), "--run", run])
                // Not an argument: the URL may hold a password, and arguments are public.
                .env(POSTGRES_URL_VAR, postgres_url)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()?;
            let stdout = child.stdout.take().ok_or("the child has no stdout")?;
            let sender = sender.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let event = parse(&line);
                    if !matches!(event, Event::Armed(_) | Event::Firing(_)) {
                        println!("scheduler {id}: {line}");
                    }
                    if sender.send((id, event)).is_err() {
                        return;
                    }
                }
            });
            children.push(child);
        }
        Ok(Self {
            children,
            lines,
            rejected: Vec::new(),
            terms: HashMap::new(),
        })
    }

    /// The next line from any child, by `deadline`.
    async fn next(
        &mut self,
        deadline: Instant,
        waiting_for: &str,
    ) -> Result<(u32, Event), BoxError> {
        let line = timeout_at(deadline, self.lines.recv())
            .await
            .map_err(|_| format!("timed out waiting for {waiting_for}"))?
            .ok_or("every scheduler exited")?;
        match &line {
            (id, Event::Rejected(interval, token)) => self.rejected.push((*id, *interval, *token)),
            (id, Event::Elected(token)) => {
                self.terms.insert(*id, *token);
            }
            _ => {}
        }
        Ok(line)
    }

    /// Waits for a child other than `not` to be elected; returns it and its token.
    async fn elected(&mut self, not: Option<u32>) -> Result<(u32, FencingToken), BoxError> {
        let deadline = Instant::now() + STEP;
        loop {
            if let (id, Event::Elected(token)) = self.next(deadline, "an election").await? {
                if Some(id) != not {
                    return Ok((id, token));
                }
            }
        }
    }

    /// Waits until the leader has enqueued `count` more jobs, starting from `leader` and
    /// following each election after it (a leader whose renewal came late on a loaded
    /// machine loses its lease, and another is elected); returns the leader then.
    async fn triggers(&mut self, mut leader: u32, count: usize) -> Result<u32, BoxError> {
        let deadline = Instant::now() + STEP;
        let mut seen = 0;
        while seen < count {
            match self.next(deadline, "triggers").await? {
                (id, Event::Triggered(_)) if id == leader => seen += 1,
                (id, Event::Elected(_)) if id != leader => leader = id,
                _ => {}
            }
        }
        Ok(leader)
    }

    /// Stops `leader` while it waits for the interval it armed (SIGSTOP right after its
    /// `armed` line, then checked: had it started firing, it is resumed and stopped at its
    /// next interval instead).
    async fn stop_while_armed(&mut self, leader: u32) -> Result<(), BoxError> {
        let deadline = Instant::now() + STEP;
        loop {
            let armed = match self.next(deadline, "the leader to arm its timer").await? {
                (id, Event::Armed(interval)) if id == leader => interval,
                _ => continue,
            };
            self.signal(leader, "STOP").await?;
            // Whatever it printed before the signal arrives within this pause.
            let drained = Instant::now() + Duration::from_millis(100);
            let mut fired = false;
            while let Ok((id, event)) = self.next(drained, "").await {
                fired |= id == leader && event == Event::Firing(armed);
            }
            if !fired {
                return Ok(());
            }
            self.signal(leader, "CONT").await?;
        }
    }

    /// Sends SIGSTOP or SIGCONT to scheduler `id`.
    async fn signal(&self, id: u32, signal: &str) -> Result<(), BoxError> {
        let child = &self.children[usize::try_from(id - 1)?];
        let pid = child.id().ok_or("the child exited")?;
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .await?;
        if !status.success() {
            return Err(format!("kill -{signal} {pid} failed: {status}").into());
        }
        Ok(())
    }

    /// Closes every child's stdin (they resign and exit) and waits for them.
    async fn stop_all(mut self) -> Result<Vec<(u32, i64, FencingToken)>, BoxError> {
        for child in &mut self.children {
            drop(child.stdin.take());
        }
        let deadline = Instant::now() + STEP;
        for child in &mut self.children {
            let status = timeout_at(deadline, child.wait())
                .await
                .map_err(|_| "a scheduler did not exit after its stdin closed")??;
            if !status.success() {
                return Err(format!("a scheduler failed: {status}").into());
            }
        }
        // The rest of what they printed, up to the end of their output.
        let deadline = Instant::now() + STEP;
        while self
            .next(deadline, "the schedulers' last lines")
            .await
            .is_ok()
        {}
        Ok(self.rejected)
    }
}

/// Runs the scenario against the PostgreSQL server at `postgres_url` (leases, fencing and
/// the job table), printing the schedulers' events, and audits the table.
pub async fn run(postgres_url: &str) -> Result<Report, BoxError> {
    let run = format!("{:016x}", rand::random::<u64>());
    let backend = backend(postgres_url)?;
    backend.setup().await?;
    let pool = backend.pool().clone();
    // No unique key on the interval: a double trigger must be possible to see.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS scheduler_jobs (id bigserial PRIMARY KEY, run text NOT NULL, \
             interval_no bigint NOT NULL, scheduler int NOT NULL, fencing_token bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let mut schedulers = Schedulers::start(postgres_url, &run)?;
    let (first, _) = schedulers.elected(None).await?;
    let leader = schedulers.triggers(first, 5).await?;
    schedulers.stop_while_armed(leader).await?;
    // The token it holds as it stops: its first, unless it lost the lease on the way and
    // was elected again.
    let old = schedulers.terms[&leader];
    println!("-- scheduler {leader} stopped (SIGSTOP) while waiting to fire; its lease runs out");
    let (successor, new) = schedulers.elected(Some(leader)).await?;
    let leading = schedulers.triggers(successor, 5).await?;
    schedulers.signal(leader, "CONT").await?;
    println!("-- scheduler {leader} resumed (SIGCONT) with token {old}");
    schedulers.triggers(leading, 5).await?;
    let stale_rejected = schedulers.stop_all().await?;

    let mut report = audit(&pool, &run).await?;
    report.stopped = Some((leader, old));
    report.successor = Some((successor, new));
    report.stale_rejected = stale_rejected;
    Ok(report)
}

/// Reads the job table of run `run`: terms, stale jobs accepted, doubled and missed
/// intervals.
async fn audit(pool: &PgPool, run: &str) -> Result<Report, BoxError> {
    let terms: Vec<(i32, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT scheduler, fencing_token, count(*), min(interval_no), max(interval_no) \
           FROM scheduler_jobs WHERE run = $1 GROUP BY scheduler, fencing_token \
          ORDER BY fencing_token",
    )
    .bind(run)
    .fetch_all(pool)
    .await?;
    let stale_accepted: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT later.id) FROM scheduler_jobs later JOIN scheduler_jobs earlier \
             ON earlier.run = later.run AND earlier.id < later.id \
            AND earlier.fencing_token > later.fencing_token \
          WHERE later.run = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await?;
    let doubled: Vec<i64> = sqlx::query_scalar(
        "SELECT interval_no FROM scheduler_jobs WHERE run = $1 \
          GROUP BY interval_no HAVING count(*) > 1 ORDER BY interval_no",
    )
    .bind(run)
    .fetch_all(pool)
    .await?;
    let missed: i64 = sqlx::query_scalar(
        "SELECT coalesce(max(interval_no) - min(interval_no) + 1 - count(DISTINCT interval_no), 0) \
           FROM scheduler_jobs WHERE run = $1",
    )
    .bind(run)
    .fetch_one(pool)
    .await?;
    Ok(Report {
        terms,
        stale_accepted,
        doubled,
        missed,
        ..Report::default()
    })
}

/// The environment variable that hands the PostgreSQL URL to the children.
const POSTGRES_URL_VAR: &str = "DISTLOCK_SCHEDULER_POSTGRES_URL";

/// A child's arguments: `--child ID --run RUN`, with the PostgreSQL URL in the
/// environment; `None` if the first argument is not `--child`.
pub fn child_args(args: &[String]) -> Option<Result<(u32, String, String), String>> {
    if args.first().map(String::as_str) != Some("--child") {
        return None;
    }
    let [_, id, flag, run] = args else {
        return Some(Err("usage: --child ID --run RUN".into()));
    };
    if flag != "--run" {
        return Some(Err("usage: --child ID --run RUN".into()));
    }
    Some(
        id.parse()
            .map_err(|e| format!("--child: {e}"))
            .and_then(|id| {
                let url = std::env::var(POSTGRES_URL_VAR)
                    .map_err(|_| format!("{POSTGRES_URL_VAR} is not set"))?;
                Ok((id, url, run.clone()))
            }),
    )
}
