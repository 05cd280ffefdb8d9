//! [`Announcer`]: sends the notifications of released keys that some process waits for,
//! after their releases committed, many in one transaction.
//!
//! # Why not in the release's own transaction
//!
//! A transaction that runs `NOTIFY` takes one cluster-wide lock as it commits and holds it
//! until its commit record is written and (with `synchronous_commit = on`) flushed: every
//! notifying transaction on the server, of every database and application, commits one at
//! a time. With a waiter on every key, releases that notified themselves ran at 0.42× the
//! rate of releases nobody waited for at 64 tasks (fsync on). A release now only reads
//! whether its key is waited for (`crate::waiters`) and says so; the backend hands such
//! names here, and one task per backend sends them with one `pg_notify` per name in a
//! single statement on a connection of its own: one commit, one lock, for every name that
//! queued up while the previous statement ran.
//!
//! That transaction commits without waiting for its WAL flush (`synchronous_commit` off
//! for it alone): it writes nothing but its commit record, the releases it announces
//! were flushed by their own commits before they were queued, and a notification is a
//! hint. So the cluster-wide lock is held for no disk flush, and the announcer asks for
//! none of its own. What that gives a release's throughput is below the noise of the
//! capacity report's `--waited-releases-only` on a busy 2-core machine: waited / unwaited
//! lease-table releases at 64 tasks measured 0.80–0.94× in five runs before and
//! 0.86–0.95× in three after.
//!
//! # What it costs a waiter
//!
//! The notification leaves one round trip after the release returned instead of at its
//! commit. A release whose future is dropped after its statement was sent, a process that
//! exits first, or a failed announcement (logged at debug level; the connection is opened
//! again for the next one, and a batch that failed on a connection kept from before is
//! sent once more on a new one) leaves the key's waiters unwoken: they find it free at their
//! next backoff step, as after a lease that ran out.
//!
//! # The server bounds it
//!
//! With [`PgPooling::Session`] the announcer's connection gets the pool's session limits
//! and `lock_timeout`, all the request time limit: its commit waits for the notify lock
//! after `statement_timeout` stopped counting, and a notifying commit that never ends
//! (one waiting for a synchronous standby that is gone) would otherwise keep a backend of
//! the announcer's waiting behind it for ever, one more each time it gives up.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::wake::Background;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgQueryResult};
use tokio::sync::{Notify, watch};
use tracing::debug;

use crate::pooling::PgPooling;
use crate::statement::{SESSION_LIMITS, Sending, Statement, Value, bound_session};

/// The `application_name` of the announcer's session.
pub const ANNOUNCER_APPLICATION_NAME: &str = "distlock-announcer";

/// One `pg_notify` per name, in one statement whose commit does not wait for its WAL
/// flush (`synchronous_commit` off for this transaction only, so a pooler's session
/// keeps its settings).
const ANNOUNCE: &str = "SELECT count(*), set_config('synchronous_commit', 'off', true) \
     FROM (SELECT pg_notify($1, n) FROM unnest($2::text[]) AS n) AS sent";

/// The names waiting to be announced, and the task that announces them.
pub(crate) struct Announcer {
    shared: Arc<Shared>,
    task: Background,
}

struct Shared {
    channel: String,
    options: PgConnectOptions,
    connect_timeout: Duration,
    request_timeout: Duration,
    queue: Mutex<Vec<String>>,
    queued: Notify,
    /// [`ANNOUNCE`], and how to send it: through a transaction pooler, as one query.
    announce: Arc<str>,
    pooling: PgPooling,
}

impl Announcer {
    pub(crate) fn new(
        channel: String,
        options: PgConnectOptions,
        connect_timeout: Duration,
        request_timeout: Duration,
        pooling: PgPooling,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                channel,
                options: options.application_name(ANNOUNCER_APPLICATION_NAME),
                connect_timeout,
                request_timeout,
                queue: Mutex::new(Vec::new()),
                queued: Notify::new(),
                announce: ANNOUNCE.into(),
                pooling,
            }),
            task: Background::default(),
        }
    }

    /// Queues `name` to be announced, starting the task if it does not run. Outside a
    /// tokio runtime nothing is announced (waiters poll).
    pub(crate) fn announce(&self, name: &str, stop: &watch::Sender<()>) {
        let (shared, stop) = (&self.shared, stop);
        if !self
            .task
            .ensure_running(|| run(shared.clone(), stop.subscribe()))
        {
            return;
        }
        self.shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(name.to_owned());
        self.shared.queued.notify_one();
    }
}

/// Announces every queued name, a batch per statement, until the backend is dropped.
async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    let mut conn: Option<PgConnection> = None;
    loop {
        // `changed` fails once the sender is dropped with the backend; nothing is sent.
        tokio::select! {
            _ = stop.changed() => return,
            () = shared.queued.notified() => {}
        }
        loop {
            let names =
                std::mem::take(&mut *shared.queue.lock().unwrap_or_else(PoisonError::into_inner));
            if names.is_empty() {
                break;
            }
            if let Err(e) = shared.send(&mut conn, &names).await {
                debug!(error = %e, names = names.len(), "cannot announce releases");
                conn = None;
            }
        }
    }
}

impl Shared {
    /// Sends `names` on the announcer's connection, opened if there is none. A connection
    /// kept from before that fails is dropped and the names are sent again on a new one
    /// at once: the server (`idle_session_timeout`, a restart) or the network may have
    /// ended it while it idled, and the batch would otherwise be lost to that. A
    /// notification sent twice only wakes a waiter twice.
    async fn send(&self, conn: &mut Option<PgConnection>, names: &[String]) -> Result<(), String> {
        let kept = conn.is_some();
        match self.send_on(conn, names).await {
            Err(e) if kept => {
                debug!(error = %e, "the announcer's connection failed; sending on a new one");
                *conn = None;
                self.send_on(conn, names).await
            }
            sent => sent,
        }
    }

    async fn send_on(
        &self,
        conn: &mut Option<PgConnection>,
        names: &[String],
    ) -> Result<(), String> {
        let c = match conn {
            Some(c) => c,
            None => {
                let mut opened = tokio::time::timeout(
                    self.connect_timeout,
                    PgConnection::connect_with(&self.options),
                )
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
                if self.pooling == PgPooling::Session {
                    // As on the pool's connections, and `lock_timeout` too: the statement
                    // waits for the notify lock at its commit, after `statement_timeout`
                    // stopped counting, and ends when the client gives up on it instead of
                    // keeping a backend waiting for nobody.
                    let startup = self.options.get_options();
                    let limits = [SESSION_LIMITS, &["lock_timeout"]].concat();
                    let bounded =
                        bound_session(&mut opened, self.request_timeout, startup, &limits);
                    tokio::time::timeout(self.request_timeout, bounded)
                        .await
                        .map_err(|_| "no reply in time".to_owned())?
                        .map_err(|e| e.to_string())?;
                }
                conn.insert(opened)
            }
        };
        let sent = Statement::new(&self.announce)
            .bind(Value::Text(&self.channel))
            .bind(Value::Texts(names.iter().map(String::as_str).collect()))
            .send::<PgQueryResult>(
                Sending {
                    pooling: self.pooling,
                    limit: self.request_timeout,
                },
                c,
            );
        tokio::time::timeout(self.request_timeout, sent)
            .await
            .map_err(|_| "no reply in time".to_owned())?
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}
