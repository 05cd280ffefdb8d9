//! The table the leader writes each tick to, fenced by its leadership's token.

use std::time::Duration;

use distlock::FencingToken;
use distlock::postgres::PgFencedResource;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::BoxError;

/// The ticks of one run (rows are tagged with the run id, so runs do not meet).
#[derive(Clone, Debug)]
pub struct Ticks {
    pool: PgPool,
    fenced: PgFencedResource,
    run: String,
}

/// One tick as written: its second, the instance that ran it, and the seconds since
/// the epoch at which it was written (PostgreSQL's clock).
#[derive(Clone, Debug)]
pub struct Written {
    /// The tick's second since the epoch.
    pub tick: i64,
    /// The instance that ran it.
    pub instance: String,
    /// When it was written, seconds since the epoch.
    pub at: f64,
}

impl Ticks {
    /// Connects to the table at `url`, creating it if it does not exist.
    pub async fn open(url: &str, run: &str) -> Result<Self, BoxError> {
        let (pool, fenced) = crate::open_fenced(url, 2).await?;
        // No unique key on the tick: a tick run twice must be possible to see.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS cron_ticks (id bigserial PRIMARY KEY, \
                 run text NOT NULL, tick bigint NOT NULL, instance text NOT NULL, \
                 fencing_token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .execute(&pool)
        .await?;
        Ok(Self {
            fenced,
            pool,
            run: run.to_owned(),
        })
    }

    /// Writes `tick` as run by `instance` under `token`, admitted by the token in the
    /// same transaction; false when a newer leader had written already.
    pub async fn write(
        &self,
        tick: i64,
        instance: &str,
        token: FencingToken,
    ) -> Result<bool, BoxError> {
        let mut tx = self.pool.begin().await?;
        let resource = format!("cron:{}", self.run);
        if !self
            .fenced
            .admit_in(&mut tx, &resource, token)
            .await?
            .is_admitted()
        {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO cron_ticks (run, tick, instance, fencing_token) VALUES ($1, $2, $3, $4)",
        )
        .bind(&self.run)
        .bind(tick)
        .bind(instance)
        .bind(i64::try_from(token)?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Every tick written, in the order written.
    pub async fn written(&self) -> Result<Vec<Written>, BoxError> {
        let rows: Vec<(i64, String, f64)> = sqlx::query_as(
            "SELECT tick, instance, extract(epoch FROM at)::float8 FROM cron_ticks \
              WHERE run = $1 ORDER BY id",
        )
        .bind(&self.run)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(tick, instance, at)| Written { tick, instance, at })
            .collect())
    }

    /// Polls the table until `found` finds something in it (30 s at most, every 10 ms).
    pub async fn wait_for<T>(
        &self,
        found: impl Fn(&[Written]) -> Option<T>,
    ) -> Result<T, BoxError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(found) = found(&self.written().await?) {
                return Ok(found);
            }
            if Instant::now() > deadline {
                return Err("the tick table did not show what the run waited for in 30 s".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// PostgreSQL's clock now, seconds since the epoch: the times above are on it.
    pub async fn now(&self) -> Result<f64, BoxError> {
        Ok(
            sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                .fetch_one(&self.pool)
                .await?,
        )
    }
}
