//! The lease table's statements, with the schema's name filled in once: every statement
//! the backend sends, in one place, so that the backend reads as what it does with them.

use std::sync::Arc;

use crate::client::with_clock;
use crate::schema::Schema;
use crate::waiters::waited;

/// The statements, with the schema name filled in once.
pub(super) struct Statements {
    pub(super) acquire: Arc<str>,
    pub(super) acquire_any: Arc<str>,
    pub(super) acquire_many: Arc<str>,
    pub(super) renew_many: Arc<str>,
    pub(super) release_many: Arc<str>,
    pub(super) renew: Arc<str>,
    pub(super) release: Arc<str>,
    pub(super) fence: Arc<str>,
    pub(super) inspect: Arc<str>,
    pub(super) purge: Arc<str>,
}

impl Statements {
    /// The statements on the lease table of schema `s`.
    pub(super) fn new(s: &Schema) -> Self {
        Self {
            // A name its snapshot shows held is filtered out before the upsert: the
            // refused attempt then inserts nothing and locks no row, so it writes no WAL,
            // takes no transaction id, and never waits for the holder's renew. The
            // upsert's own condition still decides when the row changed meanwhile.
            acquire: s.sql(&with_clock(
                "INSERT INTO {s}.distlock_leases AS l (name, owner, token, expires_at) \
                 SELECT $1, $2, {clock_us}, statement_timestamp() + $3::bigint * interval '1 millisecond' \
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.distlock_leases h \
                                     WHERE h.name = $1 AND h.expires_at > statement_timestamp()) \
                 ON CONFLICT (name) DO UPDATE \
                    SET owner = EXCLUDED.owner, token = greatest(l.token + 1, {clock_us}), \
                        expires_at = EXCLUDED.expires_at \
                  WHERE l.owner IS NULL OR l.expires_at <= statement_timestamp() \
                 RETURNING token",
            )),
            // The first name of $1 (in order) its snapshot shows free, taken as `acquire`
            // takes one. `candidates` says whether the snapshot showed one: a row taken by
            // another between the snapshot and the upsert makes the upsert skip it, and the
            // caller asks again rather than report every name held.
            acquire_any: s.sql(&with_clock(
                "WITH free AS (SELECT k.name FROM unnest($1::text[]) WITH ORDINALITY AS k(name, ord) \
                   WHERE NOT EXISTS (SELECT 1 FROM {s}.distlock_leases h \
                                      WHERE h.name = k.name AND h.expires_at > statement_timestamp()) \
                   ORDER BY k.ord LIMIT 1), \
                 taken AS (INSERT INTO {s}.distlock_leases AS l (name, owner, token, expires_at) \
                   SELECT name, $2, {clock_us}, statement_timestamp() + $3::bigint * interval '1 millisecond' \
                     FROM free \
                   ON CONFLICT (name) DO UPDATE \
                      SET owner = EXCLUDED.owner, token = greatest(l.token + 1, {clock_us}), \
                          expires_at = EXCLUDED.expires_at \
                    WHERE l.owner IS NULL OR l.expires_at <= statement_timestamp() \
                   RETURNING l.name, l.token) \
                 SELECT (SELECT count(*) FROM free) AS candidates, taken.name, taken.token \
                   FROM (SELECT 1) AS one LEFT JOIN taken ON true",
            )),
            acquire_many: s.sql(&with_clock(
                "INSERT INTO {s}.distlock_leases AS l (name, owner, token, expires_at) \
                 SELECT k.name, k.owner, {clock_us}, \
                        statement_timestamp() + $3::bigint * interval '1 millisecond' \
                   FROM unnest($1::text[], $2::uuid[]) AS k(name, owner) \
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.distlock_leases h \
                                     WHERE h.name = k.name AND h.expires_at > statement_timestamp()) \
                 ON CONFLICT (name) DO UPDATE \
                    SET owner = EXCLUDED.owner, token = greatest(l.token + 1, {clock_us}), \
                        expires_at = EXCLUDED.expires_at \
                  WHERE l.owner IS NULL OR l.expires_at <= statement_timestamp() \
                 RETURNING name, token",
            )),
            renew_many: s.sql(
                "UPDATE {s}.distlock_leases AS l \
                    SET expires_at = statement_timestamp() + k.ttl_ms * interval '1 millisecond' \
                   FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[]) \
                        AS k(name, owner, token, ttl_ms) \
                  WHERE l.name = k.name AND l.owner = k.owner AND l.token = k.token \
                    AND l.expires_at > statement_timestamp() \
                 RETURNING l.name, l.token, false AS waited",
            ),
            // Each released row says whether some process waits for its key
            // (`crate::waiters`); the backend then has it announced.
            release_many: s.sql(&format!(
                "WITH r AS (UPDATE {{s}}.distlock_leases AS l SET owner = NULL, expires_at = NULL \
                   FROM unnest($1::text[], $2::uuid[], $3::bigint[], $4::int4[], $5::int4[]) \
                        AS k(name, owner, token, wclass, wobj) \
                  WHERE l.name = k.name AND l.owner = k.owner AND l.token = k.token \
                    AND l.expires_at > statement_timestamp() \
                 RETURNING l.name, l.token, k.wclass, k.wobj) \
                 SELECT r.name, r.token, {} AS waited FROM r",
                waited("r.wclass", "r.wobj")
            )),
            renew: s.sql(
                "UPDATE {s}.distlock_leases \
                    SET expires_at = statement_timestamp() + $4::bigint * interval '1 millisecond' \
                  WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > statement_timestamp()",
            ),
            // A row when released, saying whether some process waits for the key.
            release: s.sql(&format!(
                "WITH r AS (UPDATE {{s}}.distlock_leases SET owner = NULL, expires_at = NULL \
                  WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > statement_timestamp() \
                 RETURNING name) \
                 SELECT {} AS waited FROM r",
                waited("$4", "$5")
            )),
            fence: s.sql(
                "SELECT token, (owner = $2 AND token = $3 AND expires_at > statement_timestamp()) AS held \
                   FROM {s}.distlock_leases WHERE name = $1",
            ),
            inspect: s.sql(
                "SELECT CASE WHEN expires_at > statement_timestamp() THEN owner END AS owner, token, \
                        CASE WHEN expires_at > statement_timestamp() \
                             THEN (extract(epoch FROM expires_at - statement_timestamp()) * 1000000)::bigint \
                        END AS remaining_us \
                   FROM {s}.distlock_leases WHERE name = $1",
            ),
            purge: s.sql("DELETE FROM {s}.distlock_leases WHERE name = $1"),
        }
    }
}
