//! The payout scenario of the `payout_worker` example, shared with its test: workers on
//! Redis locks pay out jobs from an at-least-once queue into a PostgreSQL ledger, where
//! the fencing token and an idempotency key are checked in the same transaction as the
//! ledger insert.
//!
//! What goes wrong on purpose: every third payout is delivered twice (a queue redelivers
//! after a visibility timeout), and one worker freezes (a GC pause, a stopped VM) right
//! after taking the lock for payout 1, until its lease has expired and the redelivered
//! job has been paid by another worker. The lock alone cannot stop the frozen worker's
//! late write; the ledger's fencing check does, and the idempotency key absorbs the
//! duplicates that arrive after the payout was made.

use std::collections::VecDeque;
use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock::postgres::{Idempotency, IdempotencyKeys, PgBuilder, PgFencedResource};
use distlock::{Admission, EnforcementMode, FencingToken, LockKey, Locker};
use sqlx::PgPool;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// Any error of the scenario, boxed: it is an example, and every error ends the run.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// The lock TTL: short, so the frozen worker loses its lease quickly.
const TTL: Duration = Duration::from_millis(500);
/// The schema of distlock's tables (fencing, idempotency keys).
const SCHEMA: &str = "distlock";

/// How big a run is.
#[derive(Clone, Debug)]
pub struct Options {
    /// Payouts in the queue (each paid once in the end).
    pub payouts: u32,
    /// Worker tasks, each with its own Redis client, as separate processes would have.
    pub workers: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            payouts: 12,
            workers: 4,
        }
    }
}

/// What happened, read back from the ledger and counted by the workers.
#[derive(Debug, Default)]
pub struct Report {
    /// Payouts in the queue.
    pub payouts: u32,
    /// Deliveries, duplicates and the frozen worker's included.
    pub deliveries: usize,
    /// Ledger inserts committed.
    pub applied: usize,
    /// Deliveries of an already-paid payout, stopped by the idempotency key.
    pub repeats_absorbed: usize,
    /// Writes carrying an older fencing token, rejected by the ledger.
    pub stale_rejected: usize,
    /// Payouts with more than one ledger entry: must be empty.
    pub paid_twice: Vec<i64>,
    /// Payouts with no ledger entry: must be empty.
    pub unpaid: Vec<i64>,
}

impl Report {
    /// True when every payout was paid exactly once.
    pub fn is_correct(&self) -> bool {
        self.paid_twice.is_empty() && self.unpaid.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} payouts, {} deliveries",
            self.payouts, self.deliveries
        )?;
        writeln!(f, "  payouts applied:                    {}", self.applied)?;
        writeln!(
            f,
            "  repeats absorbed (idempotency key): {}",
            self.repeats_absorbed
        )?;
        writeln!(
            f,
            "  stale writes rejected (fencing):    {}",
            self.stale_rejected
        )?;
        writeln!(f, "  paid twice: {:?}", self.paid_twice)?;
        write!(f, "  unpaid:     {:?}", self.unpaid)
    }
}

/// One delivery of a payout job.
#[derive(Clone, Copy, Debug)]
struct Delivery {
    payout: i64,
}

/// Counters the workers share.
#[derive(Default)]
struct Counts {
    applied: AtomicUsize,
    absorbed: AtomicUsize,
    stale: AtomicUsize,
}

/// How one delivery ended.
enum Outcome {
    Applied,
    Absorbed,
    Stale,
}

/// The ledger: PostgreSQL tables of the application, and distlock's fencing and
/// idempotency helpers on the same pool.
struct Ledger {
    pool: PgPool,
    fenced: PgFencedResource,
    keys: IdempotencyKeys,
    /// Tags this run's rows, so runs against the same database do not meet.
    run: String,
}

impl Ledger {
    async fn open(url: &str, run: String, payouts: u32) -> Result<Self, BoxError> {
        let backend = PgBuilder::new(url)
            .schema(SCHEMA)
            .pool_size(8)
            .build_lease_backend()?;
        backend.setup().await?;
        let pool = backend.pool().clone();
        for ddl in [
            "CREATE TABLE IF NOT EXISTS payouts (run text NOT NULL, id bigint NOT NULL, \
                 amount_cents bigint NOT NULL, status text NOT NULL, \
                 last_fencing_token bigint, PRIMARY KEY (run, id))",
            // No unique key on the payout: a double payment must be possible to see.
            "CREATE TABLE IF NOT EXISTS payout_ledger (id bigserial PRIMARY KEY, \
                 run text NOT NULL, payout_id bigint NOT NULL, amount_cents bigint NOT NULL, \
                 fencing_token bigint NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&pool).await?;
        }
        for id in 1..=i64::from(payouts) {
            sqlx::query(
                "INSERT INTO payouts (run, id, amount_cents, status) VALUES ($1, $2, $3, 'pending')",
            )
            .bind(&run)
            .bind(id)
            .bind(id * 100)
            .execute(&pool)
            .await?;
        }
        Ok(Self {
            fenced: PgFencedResource::new(pool.clone(), SCHEMA, EnforcementMode::Enforce)?,
            keys: IdempotencyKeys::new(SCHEMA)?,
            pool,
            run,
        })
    }

    fn resource(&self, payout: i64) -> String {
        format!("payout:{}:{payout}", self.run)
    }

    /// Pays `payout` under `token`, in one transaction: admit the token, record the
    /// idempotency key, insert the ledger entry, mark the payout paid (guarded UPDATE).
    /// Anything but a clean first payment rolls back.
    async fn pay(&self, payout: i64, token: FencingToken) -> Result<Outcome, BoxError> {
        let mut tx = self.pool.begin().await?;
        let admission = self
            .fenced
            .admit_in(&mut tx, &self.resource(payout), token)
            .await?;
        if !matches!(admission, Admission::Admitted) {
            return Ok(Outcome::Stale);
        }
        let key = format!("payment:{}:{payout}", self.run);
        if self.keys.record(&mut tx, &key).await? == Idempotency::AlreadyApplied {
            return Ok(Outcome::Absorbed);
        }
        let token = i64::try_from(token.get())?;
        sqlx::query(
            "INSERT INTO payout_ledger (run, payout_id, amount_cents, fencing_token) \
             SELECT run, id, amount_cents, $3 FROM payouts WHERE run = $1 AND id = $2",
        )
        .bind(&self.run)
        .bind(payout)
        .bind(token)
        .execute(&mut *tx)
        .await?;
        let marked = sqlx::query(
            "UPDATE payouts SET status = 'paid', last_fencing_token = $3 \
              WHERE run = $1 AND id = $2 AND $3 >= COALESCE(last_fencing_token, 0)",
        )
        .bind(&self.run)
        .bind(payout)
        .bind(token)
        .execute(&mut *tx)
        .await?;
        if marked.rows_affected() != 1 {
            return Ok(Outcome::Stale);
        }
        tx.commit().await?;
        Ok(Outcome::Applied)
    }

    /// Payouts with more than one ledger entry, and payouts with none.
    async fn audit(&self) -> Result<(Vec<i64>, Vec<i64>), BoxError> {
        let twice = sqlx::query_scalar(
            "SELECT payout_id FROM payout_ledger WHERE run = $1 \
              GROUP BY payout_id HAVING count(*) > 1 ORDER BY payout_id",
        )
        .bind(&self.run)
        .fetch_all(&self.pool)
        .await?;
        let unpaid = sqlx::query_scalar(
            "SELECT p.id FROM payouts p WHERE p.run = $1 AND NOT EXISTS \
               (SELECT 1 FROM payout_ledger l WHERE l.run = p.run AND l.payout_id = p.id) \
             ORDER BY p.id",
        )
        .bind(&self.run)
        .fetch_all(&self.pool)
        .await?;
        Ok((twice, unpaid))
    }

    fn record(&self, counts: &Counts, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Applied => &counts.applied,
            Outcome::Absorbed => &counts.absorbed,
            Outcome::Stale => &counts.stale,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

/// Runs the scenario against the Redis server at `redis_url` (locks) and the PostgreSQL
/// server at `postgres_url` (ledger), printing each event to stdout.
pub async fn run(
    redis_url: &str,
    postgres_url: &str,
    options: &Options,
) -> Result<Report, BoxError> {
    if options.payouts == 0 || options.workers == 0 {
        return Err("a run needs at least one payout and one worker".into());
    }
    let run = format!("{:016x}", rand::random::<u64>());
    let ledger = Arc::new(Ledger::open(postgres_url, run.clone(), options.payouts).await?);

    // The queue: every payout once, every third one delivered again later, and payout 1
    // redelivered because its first delivery (to the worker that freezes) timed out.
    let mut queue: VecDeque<Delivery> = (1..=i64::from(options.payouts))
        .map(|payout| Delivery { payout })
        .collect();
    queue.extend(
        (1..=i64::from(options.payouts))
            .filter(|p| p % 3 == 0 || *p == 1)
            .map(|payout| Delivery { payout }),
    );
    let deliveries = queue.len() + 1;
    let queue = Arc::new(Mutex::new(queue));
    let counts = Arc::new(Counts::default());

    // The worker that freezes takes payout 1's lock before anyone else starts.
    let frozen_backend = distlock::connect(redis_url).await?;
    let frozen_lease = frozen_backend
        .acquire(&lock_key(&run, 1)?, TTL)
        .await?
        .ok_or("payout 1's lock is held before the run started")?;
    println!(
        "worker F  took payout 1 with token {} and froze (no renewals while frozen)",
        frozen_lease.token()
    );

    let mut workers = Vec::new();
    for worker in 0..options.workers {
        let backend = distlock::connect(redis_url).await?;
        let locker = Locker::builder(backend)
            .ttl(TTL)
            .wait_timeout(Some(Duration::from_secs(30)))
            .build()?;
        let (queue, ledger, counts) = (queue.clone(), ledger.clone(), counts.clone());
        let run = run.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let Some(delivery) = queue.lock().await.pop_front() else {
                    return Ok::<(), BoxError>(());
                };
                let guard = locker.lock(&lock_key(&run, delivery.payout)?).await?;
                let outcome = ledger.pay(delivery.payout, guard.token()).await?;
                println!(
                    "worker {worker}  payout {:>3} token {:>20}: {}",
                    delivery.payout,
                    guard.token(),
                    describe(&outcome)
                );
                ledger.record(&counts, &outcome);
                guard.release().await?;
            }
        }));
    }

    // The frozen worker wakes once payout 1 was paid by a newer lock holder, and then
    // tries to pay it with the token of its long-expired lease.
    let deadline = Instant::now() + Duration::from_secs(60);
    while ledger.fenced.latest(&ledger.resource(1)).await? <= Some(frozen_lease.token()) {
        if Instant::now() > deadline {
            return Err("payout 1 was never paid by another worker".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outcome = ledger.pay(1, frozen_lease.token()).await?;
    println!(
        "worker F  woke up, payout   1 token {:>20}: {}",
        frozen_lease.token(),
        describe(&outcome)
    );
    ledger.record(&counts, &outcome);
    // Its lease is long gone; the release says so and changes nothing.
    frozen_backend.release(&frozen_lease).await?;

    for worker in workers {
        worker.await??;
    }
    let (paid_twice, unpaid) = ledger.audit().await?;
    Ok(Report {
        payouts: options.payouts,
        deliveries,
        applied: counts.applied.load(Ordering::SeqCst),
        repeats_absorbed: counts.absorbed.load(Ordering::SeqCst),
        stale_rejected: counts.stale.load(Ordering::SeqCst),
        paid_twice,
        unpaid,
    })
}

fn describe(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Applied => "paid",
        Outcome::Absorbed => "already paid: repeat absorbed by the idempotency key",
        Outcome::Stale => "REJECTED: stale fencing token, nothing written",
    }
}

/// The lock of `payout` in run `run`.
fn lock_key(run: &str, payout: i64) -> Result<LockKey, BoxError> {
    Ok(LockKey::new(format!("payout-example:{run}:{payout}"))?)
}
