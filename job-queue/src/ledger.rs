//! The payout provider's ledger, in PostgreSQL: one row per payout call it accepted,
//! and what every delivery of a job did, so that a run can be counted afterwards.
//!
//! A fenced call is admitted by its fencing token and recorded under an idempotency key
//! in the same transaction as its row; a plain call is a bare insert, as a worker that
//! knows nothing of locks would make it.

use distlock::FencingToken;
use distlock::postgres::{Idempotency, IdempotencyKeys, PgFencedResource};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::BoxError;

/// What one payout call came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The provider made the payout.
    Applied,
    /// A newer lock holder had already called: the stale call was refused, nothing made.
    StaleRejected,
    /// The payout had been made already (a re-run after a crash before the ack).
    Absorbed,
}

impl Outcome {
    /// The name recorded in the event table.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::StaleRejected => "stale_rejected",
            Outcome::Absorbed => "absorbed",
        }
    }
}

/// The ledger of one run (rows are tagged with the run id, so runs do not meet).
#[derive(Clone, Debug)]
pub struct Ledger {
    pool: PgPool,
    fenced: PgFencedResource,
    keys: IdempotencyKeys,
    run: String,
}

impl Ledger {
    /// Connects to the ledger at `url`, creating its tables if they do not exist.
    pub async fn open(url: &str, run: &str) -> Result<Self, BoxError> {
        let (pool, fenced) = crate::open_fenced(url, 4).await?;
        for ddl in [
            // No unique key on the job: a payout made twice must be possible to see.
            "CREATE TABLE IF NOT EXISTS queue_payouts (id bigserial PRIMARY KEY, \
                 run text NOT NULL, job bigint NOT NULL, worker text NOT NULL, \
                 fencing_token bigint)",
            "CREATE TABLE IF NOT EXISTS queue_events (id bigserial PRIMARY KEY, \
                 run text NOT NULL, job bigint NOT NULL, worker text NOT NULL, \
                 what text NOT NULL)",
            "CREATE TABLE IF NOT EXISTS queue_marks (run text NOT NULL, mark text NOT NULL, \
                 worker text NOT NULL, pid integer NOT NULL, job bigint NOT NULL, \
                 PRIMARY KEY (run, mark))",
        ] {
            sqlx::query(ddl).execute(&pool).await?;
        }
        Ok(Self {
            fenced,
            keys: IdempotencyKeys::new(crate::SCHEMA)?,
            pool,
            run: run.to_owned(),
        })
    }

    /// Makes the payout of `job`. With a token: admitted by it, under the job's
    /// idempotency key, in one transaction; anything but a clean first payout rolls back.
    /// Without one: a bare insert.
    pub async fn pay(
        &self,
        job: i64,
        worker: &str,
        token: Option<FencingToken>,
    ) -> Result<Outcome, BoxError> {
        let mut tx = self.pool.begin().await?;
        if let Some(token) = token {
            let resource = format!("queue-payout:{}:{job}", self.run);
            if !self
                .fenced
                .admit_in(&mut tx, &resource, token)
                .await?
                .is_admitted()
            {
                return Ok(Outcome::StaleRejected);
            }
            let key = format!("queue-payment:{}:{job}", self.run);
            if self.keys.record(&mut tx, &key).await? == Idempotency::AlreadyApplied {
                return Ok(Outcome::Absorbed);
            }
        }
        let token = token.map(i64::try_from).transpose()?;
        sqlx::query(
            "INSERT INTO queue_payouts (run, job, worker, fencing_token) VALUES ($1, $2, $3, $4)",
        )
        .bind(&self.run)
        .bind(job)
        .bind(worker)
        .bind(token)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Outcome::Applied)
    }

    /// Records what a delivery of `job` did.
    pub async fn event(&self, job: i64, worker: &str, what: &str) -> Result<(), BoxError> {
        sqlx::query("INSERT INTO queue_events (run, job, worker, what) VALUES ($1, $2, $3, $4)")
            .bind(&self.run)
            .bind(job)
            .bind(worker)
            .bind(what)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Claims the once-only `mark` for this process and `job`: true for the first caller
    /// of the run.
    pub async fn claim(&self, mark: &str, worker: &str, job: i64) -> Result<bool, BoxError> {
        let done = sqlx::query(
            "INSERT INTO queue_marks (run, mark, worker, pid, job) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT DO NOTHING",
        )
        .bind(&self.run)
        .bind(mark)
        .bind(worker)
        .bind(i32::try_from(std::process::id())?)
        .bind(job)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The worker, process and job that claimed `mark`, once one has.
    pub async fn claimed(&self, mark: &str) -> Result<Option<(String, i32, i64)>, BoxError> {
        Ok(
            sqlx::query_as("SELECT worker, pid, job FROM queue_marks WHERE run = $1 AND mark = $2")
                .bind(&self.run)
                .bind(mark)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    /// Payouts of `job` made by a worker other than `worker`.
    pub async fn paid_by_others(&self, job: i64, worker: &str) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM queue_payouts WHERE run = $1 AND job = $2 AND worker <> $3",
        )
        .bind(&self.run)
        .bind(job)
        .bind(worker)
        .fetch_one(&self.pool)
        .await?)
    }

    /// The first event whose name starts with `prefix`, once one was recorded.
    pub async fn first_event(&self, prefix: &str) -> Result<Option<String>, BoxError> {
        Ok(sqlx::query_scalar(
            "SELECT what FROM queue_events WHERE run = $1 AND starts_with(what, $2) \
              ORDER BY id LIMIT 1",
        )
        .bind(&self.run)
        .bind(prefix)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Events named `what`, all jobs.
    pub async fn count_events(&self, what: &str) -> Result<i64, BoxError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM queue_events WHERE run = $1 AND what = $2")
                .bind(&self.run)
                .bind(what)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// Payouts made, and the jobs paid more than once.
    pub async fn payouts(&self) -> Result<(i64, Vec<i64>), BoxError> {
        let made = sqlx::query_scalar("SELECT count(*) FROM queue_payouts WHERE run = $1")
            .bind(&self.run)
            .fetch_one(&self.pool)
            .await?;
        let twice = sqlx::query_scalar(
            "SELECT job FROM queue_payouts WHERE run = $1 \
              GROUP BY job HAVING count(*) > 1 ORDER BY job",
        )
        .bind(&self.run)
        .fetch_all(&self.pool)
        .await?;
        Ok((made, twice))
    }

    /// Every event of `jobs`, in the order recorded (a payout made is its `applied`
    /// event): one line each, for the report of a run that went wrong.
    pub async fn history(&self, jobs: &[i64]) -> Result<Vec<String>, BoxError> {
        let rows: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT job, worker, what FROM queue_events WHERE run = $1 AND job = ANY($2) \
              ORDER BY id",
        )
        .bind(&self.run)
        .bind(jobs)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(job, worker, what)| format!("payout {job}: {worker} {what}"))
            .collect())
    }

    /// Jobs among `1..=jobs` with no payout.
    pub async fn unpaid(&self, jobs: i64) -> Result<Vec<i64>, BoxError> {
        Ok(sqlx::query_scalar(
            "SELECT j FROM generate_series(1::bigint, $2) AS j WHERE NOT EXISTS \
               (SELECT 1 FROM queue_payouts p WHERE p.run = $1 AND p.job = j) ORDER BY j",
        )
        .bind(&self.run)
        .bind(jobs)
        .fetch_all(&self.pool)
        .await?)
    }
}
