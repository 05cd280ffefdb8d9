//! The servers one run measures, started from the test harness.

use harness::etcd::EtcdServer;
use harness::postgres::PostgresServer;
use harness::redis::RedisServer;

use super::Store;
use crate::BenchError;

/// The servers one run measures, started from the test harness on free loopback
/// ports and stopped when this value is dropped.
#[derive(Debug, Default)]
pub struct Servers {
    redis: Option<RedisServer>,
    postgres: Option<PostgresServer>,
    etcd: Option<EtcdServer>,
}

impl Servers {
    /// Starts the servers of `stores` (the memory store needs none).
    pub async fn start(stores: &[Store]) -> Result<Self, BenchError> {
        let mut servers = Servers::default();
        if stores.contains(&Store::Redis) {
            servers.redis = Some(RedisServer::start().await.map_err(BenchError::server)?);
        }
        if stores.contains(&Store::Postgres) {
            // As deployed: every commit waits for its WAL flush (`fsync=on`,
            // `synchronous_commit=on`).
            let postgres = PostgresServer::start_durable()
                .await
                .map_err(BenchError::server)?;
            // The role the benchmarks connect as may create the backends' schema, as a
            // deployment grants once.
            postgres
                .psql("GRANT CREATE ON DATABASE postgres TO distlock")
                .await
                .map_err(BenchError::server)?;
            servers.postgres = Some(postgres);
        }
        if stores.contains(&Store::Etcd) {
            servers.etcd = Some(EtcdServer::start().await.map_err(BenchError::server)?);
        }
        Ok(servers)
    }

    fn missing(store: Store) -> BenchError {
        BenchError::Unexpected {
            subject: store.name(),
            detail: "the server for this store was not started".into(),
        }
    }

    /// The Redis server's URL.
    pub fn redis_url(&self) -> Result<String, BenchError> {
        self.redis
            .as_ref()
            .map(RedisServer::url)
            .ok_or_else(|| Self::missing(Store::Redis))
    }

    /// Sends one command to the Redis server and returns its reply as text.
    pub async fn redis_command(&self, args: &[&str]) -> Result<String, BenchError> {
        let redis = self
            .redis
            .as_ref()
            .ok_or_else(|| Self::missing(Store::Redis))?;
        let reply = redis.command(args).await.map_err(BenchError::server)?;
        match reply.as_text() {
            Some(text) if !reply.is_error() => Ok(text),
            _ => Err(BenchError::Unexpected {
                subject: "redis",
                detail: format!("{args:?} answered {reply:?}"),
            }),
        }
    }

    /// The PostgreSQL server's URL (the harness's unprivileged role).
    pub fn postgres_url(&self) -> Result<String, BenchError> {
        self.postgres
            .as_ref()
            .map(PostgresServer::url)
            .ok_or_else(|| Self::missing(Store::Postgres))
    }

    /// The pid of `store`'s server process, if it runs (for its CPU time).
    pub fn pid(&self, store: Store) -> Option<u32> {
        match store {
            Store::Memory => None,
            Store::Redis => self.redis.as_ref()?.pid(),
            Store::Postgres => self.postgres.as_ref()?.pid(),
            Store::Etcd => self.etcd.as_ref()?.pid(),
        }
    }

    /// The last lines of each started server's log: printed when a run fails, since the
    /// servers and their logs go with it.
    pub fn log_tails(&self) -> String {
        let mut tails = String::new();
        let logs = [
            (Store::Redis, self.redis.as_ref().map(RedisServer::log_tail)),
            (
                Store::Postgres,
                self.postgres.as_ref().map(PostgresServer::log_tail),
            ),
            (Store::Etcd, self.etcd.as_ref().map(EtcdServer::log_tail)),
        ];
        for (store, tail) in logs {
            if let Some(tail) = tail {
                tails.push_str(&format!(
                    "--- the {} server's log ends:\n{tail}\n",
                    store.name()
                ));
            }
        }
        tails
    }

    /// The etcd client endpoint.
    pub fn etcd_endpoint(&self) -> Result<String, BenchError> {
        self.etcd
            .as_ref()
            .map(EtcdServer::endpoint)
            .ok_or_else(|| Self::missing(Store::Etcd))
    }
}
