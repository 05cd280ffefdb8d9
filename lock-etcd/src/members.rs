//! [`Members`]: one `etcd-client` connection per cluster member, and the failover that
//! sends a call to the next member when the one it tried surely never received it.
//!
//! # Why not one balanced client
//!
//! `etcd-client` puts every endpoint in one tonic balanced channel. Its endpoints connect
//! lazily, and a lazy endpoint whose connection fails still reports itself ready: the
//! connect error is handed to the next call routed to it. The balancer sees a ready,
//! idle endpoint and keeps routing calls there, so with one member down a share of all
//! calls fails with `tcp connect error` although two members are healthy.
//!
//! Here every member has a client of its own, and calls stick to one member (the
//! *preferred* one) while it answers. A call whose attempt failed before it was sent
//! (the connection was refused or could not be made, or the member has no leader and
//! refused to propose it) moves on to the next member, each member at most once per
//! call. An attempt that may have reached the server (a timeout, a connection that broke
//! mid-call) is never repeated, since a repeated write could apply twice; the error goes
//! to the caller, and the next call starts at the next member.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::LockError;
use etcd_client::{Client, ConnectOptions};
use tokio::sync::OnceCell;
use tracing::debug;

use crate::error::{self, Effect, NAME};

/// The members of one cluster, each with a client connected on first use.
pub(crate) struct Members {
    endpoints: Vec<String>,
    options: ConnectOptions,
    clients: Vec<OnceCell<Client>>,
    /// The member the next call tries first: the last one that answered.
    preferred: AtomicUsize,
    connect_timeout: Duration,
    request_timeout: Duration,
}

impl Members {
    /// Members for `endpoints` (validated, at least one); nothing connects yet.
    pub(crate) fn new(
        endpoints: Vec<String>,
        options: ConnectOptions,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> Self {
        Self {
            clients: endpoints.iter().map(|_| OnceCell::new()).collect(),
            endpoints,
            options,
            preferred: AtomicUsize::new(0),
            connect_timeout,
            request_timeout,
        }
    }

    /// The members' endpoints, in the order given.
    pub(crate) fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The request timeout of one attempt.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Runs `op` on the preferred member, and on the next ones while attempts fail before
    /// anything was sent. Each attempt gets the whole request timeout.
    ///
    /// `effect` says what a failed attempt may have changed; it decides between
    /// `Unavailable` and `OutcomeUnknown` (see the `error` module).
    pub(crate) async fn call<T, F, Fut>(&self, effect: Effect, mut op: F) -> Result<T, LockError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let count = self.clients.len();
        let first = self.preferred.load(Ordering::Relaxed) % count;
        let mut failures = Vec::new();
        for step in 0..count {
            let member = (first + step) % count;
            let client = match self.client(member).await {
                Ok(client) => client,
                Err(Failover::Next(why)) => {
                    failures.push(format!("{}: {why}", self.endpoints[member]));
                    continue;
                }
                Err(Failover::Stop(e)) => return Err(e),
            };
            match tokio::time::timeout(self.request_timeout, op(client)).await {
                Ok(Ok(value)) => {
                    if member != first {
                        self.move_preference(first, member);
                    }
                    return Ok(value);
                }
                Ok(Err(e)) if error::never_sent(&e) => {
                    debug!(endpoint = %self.endpoints[member], error = %e, "trying the next member");
                    failures.push(format!(
                        "{}: {}",
                        self.endpoints[member],
                        error::convert(e, Effect::None)
                    ));
                }
                Ok(Err(e)) => {
                    let e = error::convert(e, effect);
                    if e.is_retryable() {
                        self.move_preference(member, (member + 1) % count);
                    }
                    return Err(e);
                }
                Err(_) => {
                    self.move_preference(member, (member + 1) % count);
                    return Err(error::timed_out(effect, self.request_timeout));
                }
            }
        }
        Err(LockError::unavailable(
            NAME,
            format!(
                "no member answered; nothing was sent: {}",
                failures.join("; ")
            ),
        ))
    }

    /// Moves the preferred member from `from` to `to`, unless a concurrent call already
    /// moved it: calls racing over one failure move it once.
    fn move_preference(&self, from: usize, to: usize) {
        let _ = self
            .preferred
            .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The client of `member`, connecting it on first use. Connecting changes nothing in
    /// the store (at most it authenticates), so any failure but rejected credentials or
    /// invalid settings moves on to the next member.
    async fn client(&self, member: usize) -> Result<Client, Failover> {
        let endpoint = &self.endpoints[member];
        let connect = async {
            match tokio::time::timeout(
                self.connect_timeout + self.request_timeout,
                Client::connect([endpoint], Some(self.options.clone())),
            )
            .await
            {
                Ok(Ok(client)) => Ok(client),
                Ok(Err(e)) => match error::convert(e, Effect::None) {
                    LockError::Config(message) => Err(Failover::Stop(LockError::Config(message))),
                    other => Err(Failover::Next(other.to_string())),
                },
                Err(_) => Err(Failover::Next(format!(
                    "no connection within {:?}",
                    self.connect_timeout + self.request_timeout
                ))),
            }
        };
        self.clients[member]
            .get_or_try_init(|| connect)
            .await
            .cloned()
    }
}

/// Why a member could not be used.
enum Failover {
    /// Try the next member; the text says what happened.
    Next(String),
    /// Give up: the error would be the same on every member.
    Stop(LockError),
}
