//! The Redis baselines (`PING`, `SET NX` + `DEL`, the article's two-step design) and the
//! `rslock` peer.

use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{BenchKey, Cycle, Subject, SubjectId, TTL};
use crate::BenchError;

/// The owner-checked delete of the article design (the same check distlock's release does).
const CHECKED_DEL: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
                               return redis.call('DEL', KEYS[1]) \
                           else return 0 end";

/// The Redis baselines and the `rslock` peer, on one multiplexed connection like the backend.
pub(super) struct RawRedis {
    id: SubjectId,
    conn: redis::aio::MultiplexedConnection,
    checked_del: redis::Script,
    rslock: rslock::LockManager,
    ttl_ms: u64,
}

impl RawRedis {
    pub(super) async fn connect(id: SubjectId, url: &str) -> Result<Self, BenchError> {
        let err = |e: redis::RedisError| BenchError::client(id.slug(), e);
        let client = redis::Client::open(url).map_err(err)?;
        // The response timeout of the distlock backend the baselines are compared with, not
        // redis-rs's 500 ms, which a raw baseline's reply outlasted in a quick run on a
        // loaded two-core machine: both sides of a ratio wait as long for a reply.
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(lock_redis::DEFAULT_REQUEST_TIMEOUT));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(err)?;
        let mut rslock = rslock::LockManager::new(vec![url.to_owned()]);
        // A refused lock fails at once instead of sleeping between retries, as distlock's
        // `acquire` does.
        rslock.set_retry(1, Duration::from_millis(1));
        Ok(Self {
            id,
            conn,
            checked_del: redis::Script::new(CHECKED_DEL),
            rslock,
            ttl_ms: u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> BenchError {
        BenchError::client(self.id.slug(), e)
    }

    /// `SET key owner NX PX ttl`; true when the key was taken.
    async fn set_nx(&self, key: &str, owner: &str) -> Result<bool, BenchError> {
        let mut conn = self.conn.clone();
        let reply: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(owner)
            .arg("NX")
            .arg("PX")
            .arg(self.ttl_ms)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(reply.is_some())
    }
}

#[async_trait]
impl Subject for RawRedis {
    fn id(&self) -> SubjectId {
        self.id
    }

    async fn cycle(&self, key: &BenchKey) -> Result<Cycle, BenchError> {
        let mut conn = self.conn.clone();
        let key = key.as_str();
        let start = Instant::now();
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let (acquire, acquired) = match self.id {
            SubjectId::RedisPing => {
                let _: String = redis::cmd("PING")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| self.err(e))?;
                (start.elapsed(), true)
            }
            SubjectId::RedisSetNx => {
                let taken = self.set_nx(key, &owner).await?;
                let acquire = start.elapsed();
                if taken {
                    let _: i64 = redis::cmd("DEL")
                        .arg(key)
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                (acquire, taken)
            }
            SubjectId::RedisTwoStep => {
                let taken = self.set_nx(key, &owner).await?;
                if taken {
                    let _token: u64 = redis::cmd("INCR")
                        .arg(format!("{key}:fence"))
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                let acquire = start.elapsed();
                if taken {
                    let _: i64 = self
                        .checked_del
                        .key(key)
                        .arg(&owner)
                        .invoke_async(&mut conn)
                        .await
                        .map_err(|e| self.err(e))?;
                }
                (acquire, taken)
            }
            _ => match self.rslock.lock(key, TTL).await {
                Ok(lock) => {
                    let acquire = start.elapsed();
                    self.rslock.unlock(&lock).await;
                    (acquire, true)
                }
                Err(rslock::LockError::Unavailable) => (start.elapsed(), false),
                Err(e) => return Err(self.err(e)),
            },
        };
        Ok(Cycle { acquire, acquired })
    }
}
