//! Token-row retention: with a lock per job id every name leaves a row behind. Acquires
//! sweep, in the background, the rows of names nobody holds whose token is older than the
//! retention; held names keep theirs, and a deleted name's next token is still higher.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Kind, builder, shared_server, start_server};
use distlock_core::{Fence, Lease, LockBackend, LockKey, Release};
use harness::postgres::PostgresServer;
use tokio::time::Instant;

const RETENTION: Duration = Duration::from_secs(1);
/// Longer than any test here runs, on any load: the held name must stay held throughout
/// (a million names took 171 s with seven other tests beside them).
const HELD_TTL: Duration = Duration::from_secs(3600);
/// A hang guard for work over a million rows (seeding, sweeping, vacuuming), not a speed
/// bound: a million-row advisory sweep takes 6 s alone (a batch is an index scan of its
/// own rows), and seeding a million rows took more than 30 s under CI's load.
const BULK_GUARD: Duration = Duration::from_secs(480);

fn table(kind: Kind) -> &'static str {
    match kind {
        Kind::Lease => "distlock_leases",
        Kind::Advisory => "distlock_advisory_tokens",
    }
}

/// A backend of `kind` on a schema of its own (so the sweep sees this test's rows only),
/// keeping free rows for `retention`.
async fn backend_in(
    server: &PostgresServer,
    kind: Kind,
    schema: &str,
    retention: Duration,
    pool_size: u32,
) -> Arc<dyn LockBackend> {
    let b = builder(server)
        .schema(schema)
        .pool_size(pool_size)
        .token_retention(retention);
    let lease = b.build_lease_backend().unwrap();
    lease.setup().await.unwrap();
    match kind {
        Kind::Lease => Arc::new(lease),
        Kind::Advisory => {
            let advisory = b.build_advisory_backend().unwrap();
            advisory.connect().await.unwrap();
            Arc::new(advisory)
        }
    }
}

/// The names in the table and their tokens.
async fn rows(server: &PostgresServer, kind: Kind, schema: &str) -> BTreeMap<String, u64> {
    let out = server
        .psql(&format!(
            "SELECT name, token FROM {schema}.{} ORDER BY name",
            table(kind)
        ))
        .await
        .unwrap();
    out.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (name, token) = l.split_once('|').unwrap();
            (name.to_owned(), token.parse().unwrap())
        })
        .collect()
}

async fn count(server: &PostgresServer, kind: Kind, schema: &str) -> u64 {
    server
        .psql(&format!("SELECT count(*) FROM {schema}.{}", table(kind)))
        .await
        .unwrap()
        .parse()
        .unwrap()
}

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

async fn take(backend: &Arc<dyn LockBackend>, name: &str, ttl: Duration) -> Lease {
    backend
        .acquire(&key(name), ttl)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} is free"))
}

/// An acquire of a held name, as a worker trying a busy job would: it starts a sweep if
/// one is due, and adds or moves no row.
async fn poke(backend: &Arc<dyn LockBackend>, held: &Lease) {
    assert!(
        backend
            .acquire(held.key(), HELD_TTL)
            .await
            .unwrap()
            .is_none()
    );
}

async fn free_rows_past_their_retention_go_and_held_ones_stay(kind: Kind) {
    let server = shared_server().await;
    let schema = format!("retention_{kind:?}").to_lowercase();
    // Sweeps run at most once a second (a 24th of this, raised to the 1 s floor).
    let retention = Duration::from_secs(4);
    let backend = backend_in(&server, kind, &schema, retention, 16).await;

    let released = take(&backend, "released", HELD_TTL).await;
    assert_eq!(backend.release(&released).await.unwrap(), Release::Released);
    // Runs out without a release (for the advisory backend its session ends on the
    // server's idle timeout).
    let _expired = take(&backend, "expired", Duration::from_millis(50)).await;
    // Held for longer than the retention. Several names, so that some advisory keys
    // have the sign bit set, and one that is not ASCII.
    let mut held = Vec::new();
    for i in 0..8 {
        held.push(take(&backend, &format!("held:{i}"), HELD_TTL).await);
    }
    held.push(take(&backend, "held:ünï", HELD_TTL).await);

    tokio::time::sleep(retention + Duration::from_millis(500)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = rows(&server, kind, &schema).await;
        if !left.contains_key("released") && !left.contains_key("expired") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{kind:?}: free rows past their retention are still there: {left:?}"
        );
        poke(&backend, &held[0]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A fresh grant, and a sweep that surely starts after it (sweeps are a second apart),
    // while it is younger than the retention.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let recent = take(&backend, "recent", HELD_TTL).await;
    let recent_at = Instant::now();
    assert_eq!(backend.release(&recent).await.unwrap(), Release::Released);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    poke(&backend, &held[0]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        recent_at.elapsed() < retention,
        "the test ran too slowly to judge: {:?} since the recent grant",
        recent_at.elapsed()
    );
    let left = rows(&server, kind, &schema).await;
    for lease in &held {
        assert_eq!(
            left.get(lease.key().as_str()),
            Some(&lease.token().get()),
            "{kind:?}: a held name's row must stay: {left:?}"
        );
        assert_eq!(
            backend.fence(lease).await.unwrap(),
            Fence::Current,
            "{kind:?}: {}",
            lease.key()
        );
    }
    assert!(
        left.contains_key("recent"),
        "{kind:?}: a free row younger than the retention must stay: {left:?}"
    );

    let again = take(&backend, "released", HELD_TTL).await;
    assert!(
        again.token() > released.token(),
        "{kind:?}: token {} after {} went back when the row was deleted",
        again.token(),
        released.token()
    );
    backend.release(&again).await.unwrap();
    for lease in &held {
        assert_eq!(backend.release(lease).await.unwrap(), Release::Released);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_table_free_rows_past_their_retention_go_and_held_ones_stay() {
    free_rows_past_their_retention_go_and_held_ones_stay(Kind::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_free_rows_past_their_retention_go_and_held_ones_stay() {
    free_rows_past_their_retention_go_and_held_ones_stay(Kind::Advisory).await;
}

/// Heap size of the table, after a `VACUUM` that gives trailing empty pages back.
///
/// `VACUUM` removes a deleted row only when no snapshot older than its deletion remains,
/// and truncates only pages left empty, and only if it gets the table's exclusive lock
/// within a few seconds and nobody asks for a lock on the table meanwhile (else it stops
/// truncating and says so only at `VERBOSE`). So the measurement waits until no other
/// session holds a snapshot, a transaction or a lock on the table (an autovacuum worker
/// at work, a sweep still running), and prints what it waited for.
async fn heap_bytes(server: &PostgresServer, kind: Kind, schema: &str) -> u64 {
    let t = format!("{schema}.{}", table(kind));
    let others = server
        .until_no_session(
            &format!(
                "backend_xmin IS NOT NULL OR backend_xid IS NOT NULL \
                 OR pid IN (SELECT pid FROM pg_locks WHERE relation = '{t}'::regclass)"
            ),
            Duration::from_millis(200),
            BULK_GUARD,
        )
        .await
        .unwrap();
    match others {
        Ok(waited) if !waited.is_empty() => {
            println!(
                "waited for the sessions with a snapshot or a lock on the table to end: {waited}"
            );
        }
        Ok(_) => {}
        Err(others) => panic!("sessions kept a snapshot or a lock for {BULK_GUARD:?}: {others}"),
    }
    server
        .psql_within(&format!("VACUUM {t}"), BULK_GUARD)
        .await
        .unwrap();
    server
        .psql(&format!("SELECT pg_relation_size('{t}')"))
        .await
        .unwrap()
        .parse()
        .unwrap()
}

/// After a case's run: the table's heap is back within 64 KiB of the `start` it had. No
/// new autovacuum worker is let onto the table first (the sweep's deletions start them,
/// and one taking its lock stops the measuring `VACUUM`'s truncation); the run itself had
/// autovacuum, as deployed. Under load the swept table once kept 80 MB, and once 125 MB
/// right after the autovacuum worker it had waited for ended: a failure prints the table's
/// statistics and the server's sessions.
async fn assert_heap_back_to(server: &PostgresServer, kind: Kind, schema: &str, start: u64) {
    let t = format!("{schema}.{}", table(kind));
    server
        .psql(&format!("ALTER TABLE {t} SET (autovacuum_enabled = false)"))
        .await
        .unwrap();
    let end = heap_bytes(server, kind, schema).await;
    println!("table heap: {start} bytes at the start, {end} bytes at the end");
    if end > start + 64 * 1024 {
        let state = table_state(server, kind, schema).await;
        panic!("the table kept {end} bytes (started at {start}); {state}");
    }
}

/// The table's statistics and the sessions on the server, for a failure's message.
async fn table_state(server: &PostgresServer, kind: Kind, schema: &str) -> String {
    let stats = server
        .psql(&format!(
            "SELECT n_live_tup, n_dead_tup, last_vacuum, last_autovacuum, vacuum_count, \
                    autovacuum_count FROM pg_stat_user_tables \
              WHERE schemaname = '{schema}' AND relname = '{}'",
            table(kind)
        ))
        .await
        .unwrap_or_else(|e| e.to_string());
    let sessions = server
        .psql(
            "SELECT string_agg(backend_type || ' ' || coalesce(state, '') || ' xmin=' || \
                    coalesce(backend_xmin::text, '-') || ': ' || coalesce(query, ''), '; ') \
               FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
        )
        .await
        .unwrap_or_else(|e| e.to_string());
    format!(
        "n_live_tup|n_dead_tup|last_vacuum|last_autovacuum|vacuum_count|autovacuum_count: \
         {stats}; sessions: {sessions}"
    )
}

/// Waits until the sweeps (started by attempts on the held name) leave only `want` rows
/// in the table.
async fn swept_down_to(
    server: &PostgresServer,
    backend: &Arc<dyn LockBackend>,
    held: &Lease,
    kind: Kind,
    schema: &str,
    want: u64,
) {
    let deadline = Instant::now() + BULK_GUARD;
    loop {
        let n = count(server, kind, schema).await;
        if n == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{kind:?}: {n} rows are left, {want} expected"
        );
        poke(backend, held).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A million one-off names, each taken and released through the lease table (in batches
/// of a thousand, as a busy queue would), leave the table as small as it started once
/// their retention runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_one_off_names_leave_the_lease_table_as_it_started() {
    const NAMES: usize = 1_000_000;
    const BATCH: usize = 1_000;
    // A server of its own: VACUUM gives the swept table's pages back only when no
    // statement older than the sweep's deletes runs in the database, and the other
    // million-row test's sweep (of another schema, under its own sweep lock) would.
    let server = start_server().await;
    let schema = "retention_million";
    let backend = backend_in(&server, Kind::Lease, schema, RETENTION, 4).await;
    let held = take(&backend, "held", HELD_TTL).await;
    let start = heap_bytes(&server, Kind::Lease, schema).await;

    let started = Instant::now();
    for batch in 0..NAMES / BATCH {
        let keys: Vec<LockKey> = (0..BATCH)
            .map(|i| key(&format!("job:{}", batch * BATCH + i)))
            .collect();
        let leases: Vec<Lease> = backend
            .acquire_many(&keys, HELD_TTL)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.expect("a one-off name is free"))
            .collect();
        let released = backend.release_many(&leases).await.unwrap();
        assert!(released.iter().all(|r| *r == Release::Released));
    }
    println!(
        "{NAMES} one-off names taken and released in {:?}",
        started.elapsed()
    );

    let swept = Instant::now();
    tokio::time::sleep(RETENTION).await;
    swept_down_to(&server, &backend, &held, Kind::Lease, schema, 1).await;
    println!("swept down to the held row in {:?}", swept.elapsed());
    assert_eq!(backend.fence(&held).await.unwrap(), Fence::Current);
    assert_heap_back_to(&server, Kind::Lease, schema, start).await;
}

/// The advisory table's sweep over a million rows: the rows one-off names leave (a name,
/// its last token, owner and TTL; an advisory release writes nothing), written here in
/// one statement since taking a million advisory locks one session at a time would take
/// minutes, beside a name held through the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_free_advisory_token_rows_are_swept_and_the_held_one_kept() {
    // A server of its own: VACUUM gives the swept table's pages back only when no
    // statement older than the sweep's deletes runs in the database, and the other
    // million-row test's sweep (of another schema, under its own sweep lock) would.
    let server = start_server().await;
    let schema = "retention_million_advisory";
    let backend = backend_in(&server, Kind::Advisory, schema, RETENTION, 4).await;
    let held = take(&backend, "held", HELD_TTL).await;
    let start = heap_bytes(&server, Kind::Advisory, schema).await;
    server
        .psql_within(
            &format!(
                "INSERT INTO {schema}.distlock_advisory_tokens (name, token, owner, ttl_ms) \
             SELECT 'job:' || g, \
                    (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - 10000000 + g, \
                    gen_random_uuid(), 30000 \
               FROM generate_series(1, 1000000) AS g"
            ),
            BULK_GUARD,
        )
        .await
        .unwrap();
    let swept = Instant::now();
    swept_down_to(&server, &backend, &held, Kind::Advisory, schema, 1).await;
    println!(
        "swept a million advisory token rows in {:?}",
        swept.elapsed()
    );
    assert_eq!(backend.fence(&held).await.unwrap(), Fence::Current);
    assert_heap_back_to(&server, Kind::Advisory, schema, start).await;
}
