//! The advisory backend's statements, with the schema's name filled in once: every
//! statement the backend sends, in one place, as the lease table's are in
//! `lease_table/statements.rs`.

use std::sync::Arc;

use crate::client::with_clock;
use crate::schema::Schema;

/// The statements, with the schema name filled in once.
pub(super) struct Statements {
    pub(super) acquire: Arc<str>,
    pub(super) token: Arc<str>,
    pub(super) inspect: Arc<str>,
    pub(super) purge: Arc<str>,
}

impl Statements {
    /// The statements on the advisory tokens table of schema `s`.
    pub(super) fn new(s: &Schema) -> Self {
        Self {
            acquire: s.sql(&acquire_sql("{s}.distlock_advisory_tokens")),
            token: s.sql("SELECT token FROM {s}.distlock_advisory_tokens WHERE name = $1"),
            // The holder's remaining time is its idle-session budget: the TTL minus the
            // time since its session's last state change.
            inspect: s.sql(
                "SELECT t.token, t.owner, \
                        (SELECT greatest(1, (extract(epoch FROM a.state_change - clock_timestamp()) \
                                             * 1000000)::bigint + t.ttl_ms * 1000) \
                           FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid \
                          WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 1 \
                            AND k.classid = $2::bigint::oid AND k.objid = $3::bigint::oid \
                            AND k.database = (SELECT oid FROM pg_database \
                                               WHERE datname = current_database()) \
                          LIMIT 1) AS remaining_us \
                   FROM {s}.distlock_advisory_tokens t WHERE t.name = $1",
            ),
            purge: s.sql("DELETE FROM {s}.distlock_advisory_tokens WHERE name = $1"),
        }
    }
}

/// Unlocks, drops any other advisory lock the session may hold (none, by the acquire's
/// check), and resets the session's time limits (`set_config` with a NULL value is
/// `RESET`), so they are again whatever the server, database or role says and the
/// connection can serve the pool again. The CTE runs the unlock of this key first, and
/// only in the server session that took the lock (pid `$2`): in any other session the
/// statement does nothing and returns no row.
/// The second column says whether the key was unlocked and some process waits for it (the
/// waiter id `$3`, `$4` is registered, see `crate::waiters`): the backend then has the
/// release announced. The statement gets no transaction id and writes nothing to the WAL.
pub(crate) const UNLOCK: &str = "WITH u AS (SELECT pg_advisory_unlock($1) AS released \
                WHERE pg_backend_pid() = $2) \
     SELECT u.released, \
     CASE WHEN u.released THEN NOT pg_try_advisory_xact_lock($3, $4) ELSE false END, \
     pg_advisory_unlock_all(), \
     set_config('distlock.holds', NULL, false), \
     set_config('idle_session_timeout', NULL, false), \
     set_config('tcp_user_timeout', NULL, false), \
     set_config('tcp_keepalives_idle', NULL, false), \
     set_config('tcp_keepalives_interval', NULL, false), \
     set_config('tcp_keepalives_count', NULL, false) \
     FROM u";

/// The acquire, its token bump going to the table `tokens` (`distlock_advisory_tokens`'s
/// columns), the server clock filled in.
///
/// The CTEs hold volatile calls, so each is evaluated exactly once, in the order they read
/// each other: first whether this session already holds a lock of this backend's (a pooled
/// session must hold none, so that it holds exactly one after the acquire and one unlock
/// frees the key), then the try; the session settings and the token bump only happen when
/// the lock was taken. The mark is a session setting the lock's statement sets and the
/// unlock resets: reading it costs nothing, where `pg_locks` would take every lock-manager
/// partition lock and visit every backend's fast-path locks on each acquire.
pub(crate) fn acquire_sql(tokens: &str) -> String {
    with_clock(&ACQUIRE.replace("{tokens}", tokens))
}

/// [`acquire_sql`]'s statement, `{tokens}` and `{clock_us}` still to fill in.
const ACQUIRE: &str = "WITH pre AS (SELECT CASE WHEN current_setting('distlock.holds', true) = 'yes' \
                              THEN 1 ELSE 0 END::bigint AS held), \
     l AS (SELECT pre.held, \
                  CASE WHEN pre.held = 0 THEN pg_try_advisory_lock($1) \
                       ELSE false END AS ok \
             FROM pre), \
     cfg AS (SELECT set_config('distlock.holds', 'yes', false), \
                    set_config('idle_session_timeout', $3, false), \
                    set_config('tcp_user_timeout', $3, false), \
                    set_config('tcp_keepalives_idle', $4, false), \
                    set_config('tcp_keepalives_interval', $4, false), \
                    set_config('tcp_keepalives_count', $5, false) \
               FROM l WHERE l.ok), \
     bumped AS (INSERT INTO {tokens} AS t \
                       (name, token, owner, ttl_ms) \
                SELECT $2, {clock_us}, $6, $7 FROM l, cfg WHERE l.ok \
                ON CONFLICT (name) DO UPDATE \
                   SET token = greatest(t.token + 1, {clock_us}), \
                       owner = EXCLUDED.owner, ttl_ms = EXCLUDED.ttl_ms \
                RETURNING token) \
     SELECT l.held, pg_backend_pid() AS pid, \
            (SELECT token FROM bumped) AS token \
       FROM l";
