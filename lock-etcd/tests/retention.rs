//! Token-key retention: with a lock per job id every name leaves a token key behind.
//! Acquires sweep, in the background, the token keys of names nobody holds whose token is
//! older than the retention; held names keep theirs, a token that ran ahead of the clock
//! stays until the clock passes it, and a swept name's next token is still higher.

use std::time::Duration;

use distlock_core::{Fence, FencingToken, Lease, LockBackend, LockKey, OwnerId, Release};
use etcd_client::{Client, CompactionOptions, GetOptions};
use harness::etcd::{EtcdServer, EtcdSpace};
use harness::require;
use lock_etcd::EtcdBackend;
use tokio::time::{Instant, sleep};

const PREFIX: &str = "retention";
/// Longer than any test here runs: a held name must stay held throughout.
const HELD_TTL: Duration = Duration::from_secs(3600);
/// For names a test releases: longer than a grant and its release take on any load.
const TTL: Duration = Duration::from_secs(60);
/// The shortest lease the harness's etcd grants, for a name that runs out.
const SHORT_TTL: Duration = Duration::from_secs(2);
/// A hang guard for waiting on sweeps, not a speed bound: sweeps are a second apart here.
const SWEPT_WITHIN: Duration = Duration::from_secs(60);

async fn backend(server: &EtcdServer, prefix: &str, retention: Duration) -> EtcdBackend {
    EtcdBackend::builder()
        .endpoint(server.endpoint())
        .key_prefix(prefix)
        .token_retention(retention)
        .build()
        .await
        .unwrap()
}

async fn raw(server: &EtcdServer) -> Client {
    Client::connect([server.endpoint()], None).await.unwrap()
}

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

async fn take(backend: &EtcdBackend, name: &str, ttl: Duration) -> Lease {
    backend
        .acquire(&key(name), ttl)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} is free"))
}

/// An acquire of a held name, as a worker trying a busy job would: it starts a sweep if
/// one is due, and writes nothing.
async fn poke(backend: &EtcdBackend, held: &Lease) {
    let refused = backend.acquire(held.key(), HELD_TTL).await.unwrap();
    assert!(refused.is_none(), "{} is held", held.key());
}

/// The value of an etcd key, if it exists.
async fn value(client: &mut Client, etcd_key: &str) -> Option<Vec<u8>> {
    let mut resp = client.get(etcd_key, None).await.unwrap();
    resp.take_kvs().pop().map(|kv| kv.value().to_vec())
}

/// How many keys lie under `prefix`.
async fn count(client: &mut Client, prefix: &str) -> i64 {
    let options = GetOptions::new().with_prefix().with_count_only();
    client.get(prefix, Some(options)).await.unwrap().count()
}

/// Puts a token key as another client would have left it: `token` for a clock-token client.
async fn put_token(client: &mut Client, backend: &EtcdBackend, name: &str, token: u64) {
    let token_key = backend.token_key(&key(name));
    client
        .put(token_key, format!("{token:020}"), None)
        .await
        .unwrap();
}

fn clock_us() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

/// Pokes sweeps until none of `names` has a token key left.
async fn swept(client: &mut Client, backend: &EtcdBackend, held: &Lease, names: &[&str]) {
    let deadline = Instant::now() + SWEPT_WITHIN;
    loop {
        let mut left = Vec::new();
        for name in names {
            if value(client, &backend.token_key(&key(name)))
                .await
                .is_some()
            {
                left.push(*name);
            }
        }
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "token keys past their retention are still there: {left:?}"
        );
        poke(backend, held).await;
        sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_token_keys_past_their_retention_go_and_held_ones_stay() {
    let server = require(EtcdServer::start().await);
    let mut client = raw(&server).await;
    // Sweeps run at most once a second (a 24th of this, raised to the 1 s floor).
    let retention = Duration::from_secs(8);
    let backend = backend(&server, PREFIX, retention).await;
    // A backend whose prefix puts its keys in the range of the first one's token keys.
    let nested = self::backend(&server, &format!("{PREFIX}/tokens/nested"), retention).await;

    let released = take(&backend, "released", TTL).await;
    assert_eq!(backend.release(&released).await.unwrap(), Release::Released);
    // Runs out without a release.
    let _expired = take(&backend, "expired", SHORT_TTL).await;
    // Held for longer than the retention.
    let mut held = Vec::new();
    for i in 0..8 {
        held.push(take(&backend, &format!("held:{i}"), HELD_TTL).await);
    }
    let nested_held = take(&nested, "x", HELD_TTL).await;
    sleep(retention + Duration::from_millis(500)).await;

    // A fresh grant, then a token key written long ago: the sweep that deletes the old one
    // has judged the fresh one too (one page).
    let recent = take(&backend, "recent", TTL).await;
    let recent_at = Instant::now();
    assert_eq!(backend.release(&recent).await.unwrap(), Release::Released);
    let long_ago = clock_us() - 2 * u64::try_from(retention.as_micros()).unwrap();
    put_token(&mut client, &backend, "old", long_ago).await;
    swept(
        &mut client,
        &backend,
        &held[0],
        &["released", "expired", "old"],
    )
    .await;
    assert!(
        recent_at.elapsed() < retention,
        "the test ran too slowly to judge: {:?} since the recent grant",
        recent_at.elapsed()
    );

    let recent_token = value(&mut client, &backend.token_key(recent.key())).await;
    assert_eq!(
        recent_token,
        Some(format!("{:020}", recent.token().get()).into_bytes()),
        "a free token key younger than the retention must stay"
    );
    for lease in &held {
        let token = value(&mut client, &backend.token_key(lease.key())).await;
        assert_eq!(
            token,
            Some(format!("{:020}", lease.token().get()).into_bytes()),
            "a held name's token key must stay: {}",
            lease.key()
        );
        assert_eq!(backend.fence(lease).await.unwrap(), Fence::Current);
    }
    for etcd_key in [
        nested.lock_key(nested_held.key()),
        nested.token_key(nested_held.key()),
    ] {
        assert!(
            value(&mut client, &etcd_key).await.is_some(),
            "{etcd_key} of another prefix must stay"
        );
    }
    assert_eq!(nested.fence(&nested_held).await.unwrap(), Fence::Current);

    let again = take(&backend, "released", TTL).await;
    assert!(
        again.token() > released.token(),
        "token {:?} after {:?} went back when the token key was deleted",
        again.token(),
        released.token()
    );
}

/// The next token of a swept name has the clock alone as its floor. A token granted by a
/// client whose clock ran an hour ahead is not older than the retention by this clock,
/// however long ago it was written: its key must stay, or the next grant would be lower.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_rising_across_the_deletion_of_their_key() {
    let server = require(EtcdServer::start().await);
    let mut client = raw(&server).await;
    let retention = Duration::from_secs(1);
    let backend = backend(&server, PREFIX, retention).await;
    let held = take(&backend, "held", HELD_TTL).await;

    let first = take(&backend, "swept", TTL).await;
    assert_eq!(backend.release(&first).await.unwrap(), Release::Released);
    let ahead = clock_us() + 3_600_000_000;
    put_token(&mut client, &backend, "ahead", ahead).await;
    // Written by a client from before tokens came from the clock: an owner id, the key's
    // `mod_revision` its token.
    let revision_token = backend.token_key(&key("revision"));
    client
        .put(revision_token.as_str(), OwnerId::random().to_string(), None)
        .await
        .unwrap();
    sleep(retention).await;
    swept(&mut client, &backend, &held, &["swept", "revision"]).await;

    let kept = value(&mut client, &backend.token_key(&key("ahead"))).await;
    let after_ahead = take(&backend, "ahead", TTL).await;
    assert!(
        after_ahead.token() > FencingToken(ahead),
        "granted {:?} after {ahead} was granted",
        after_ahead.token()
    );
    assert_eq!(
        kept,
        Some(format!("{ahead:020}").into_bytes()),
        "a token ahead of the clock must keep its key"
    );
    let second = take(&backend, "swept", TTL).await;
    assert!(
        second.token() > first.token(),
        "granted {:?} after {:?}, whose token key was swept",
        second.token(),
        first.token()
    );
    assert_eq!(
        backend.inspect(second.key()).await.unwrap().token,
        Some(second.token())
    );
}

/// One-off names, as a lock per job id leaves them, taken and released in batches while
/// the token keys are counted: sweeps keep the count to the names of the last few seconds
/// (retention 1 s, a sweep a second), and once the names stop it falls back to the held
/// name alone; the prefix then holds nothing but the held lock, its token and the sweep
/// schedule. `DISTLOCK_ETCD_ONE_OFF_NAMES` runs it at another scale (10,000 by default).
/// etcd is compacted every 10,000 names, as its auto-compaction would, so a large run
/// stays under its space quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_off_names_keep_the_token_keys_flat() {
    const BATCH: usize = 500;
    const COMPACT_EVERY: usize = 10_000;
    let names: usize = std::env::var("DISTLOCK_ETCD_ONE_OFF_NAMES")
        .map_or(10_000, |n| n.parse().expect("a number of names"));
    let server = require(EtcdServer::start().await);
    let mut client = raw(&server).await;
    let backend = backend(&server, PREFIX, Duration::from_secs(1)).await;
    let held = take(&backend, "held", HELD_TTL).await;
    let tokens = format!("{PREFIX}/tokens/");
    let start_db = client.status().await.unwrap();

    let started = Instant::now();
    let mut samples = Vec::new();
    for batch in 0..names.div_ceil(BATCH) {
        let keys: Vec<LockKey> = (batch * BATCH..names.min((batch + 1) * BATCH))
            .map(|i| key(&format!("job:{i}")))
            .collect();
        let leases: Vec<Lease> = backend
            .acquire_many(&keys, TTL)
            .await
            .unwrap()
            .into_iter()
            .map(|lease| lease.expect("a one-off name is free"))
            .collect();
        let released = backend.release_many(&leases).await.unwrap();
        assert!(released.iter().all(|r| *r == Release::Released));
        samples.push(count(&mut client, &tokens).await);
        if ((batch + 1) * BATCH) % COMPACT_EVERY == 0 {
            let revision = client.status().await.unwrap().header().unwrap().revision();
            client
                .compact(revision, Some(CompactionOptions::new().with_physical()))
                .await
                .unwrap();
        }
    }
    let took = started.elapsed();
    let peak = *samples.iter().max().unwrap();
    println!(
        "{names} one-off names taken and released in {took:?}; token keys after each batch \
         of {BATCH}: peak {peak}, samples {samples:?}"
    );

    let sweeping = Instant::now();
    let deadline = sweeping + SWEPT_WITHIN;
    while count(&mut client, &tokens).await > 1 {
        assert!(Instant::now() < deadline, "token keys are still there");
        poke(&backend, &held).await;
        sleep(Duration::from_millis(100)).await;
    }
    println!("swept down to the held name in {:?}", sweeping.elapsed());
    let left = client
        .get(
            format!("{PREFIX}/"),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    let left: Vec<String> = left
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    assert_eq!(
        left,
        [
            backend.lock_key(held.key()),
            format!("{PREFIX}/sweeps/tokens"),
            backend.token_key(held.key()),
        ],
        "what the prefix holds once the names are swept"
    );
    assert_eq!(backend.fence(&held).await.unwrap(), Fence::Current);
    // Flat: a backend that kept every token key would end its run with all of them.
    assert!(
        usize::try_from(peak).unwrap() <= names / 2,
        "up to {peak} token keys of {names} names were kept at once"
    );

    let revision = client.status().await.unwrap().header().unwrap().revision();
    client
        .compact(revision, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    let end_db = client.status().await.unwrap();
    println!(
        "etcd database: {} bytes ({} in use) at the start, {} bytes ({} in use) after the \
         last compaction",
        start_db.db_size(),
        start_db.raft_used_db_size(),
        end_db.db_size(),
        end_db.raft_used_db_size()
    );
}

/// An etcd run as operators run it, with a small space quota and periodic automatic
/// compaction: one-off names far beyond what the quota could hold as token keys are taken
/// and released without a write refused. Without retention every name's token key stays
/// live, compaction cannot reclaim it, and etcd refuses writes (`NOSPACE`) part way
/// through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_off_names_fit_an_etcd_with_a_small_quota() {
    const QUOTA: u64 = 2 << 20;
    const NAMES: usize = 20_000;
    const BATCH: usize = 500;
    let space = EtcdSpace {
        quota_bytes: QUOTA,
        compaction_retention: Duration::from_secs(1),
    };
    let server = require(EtcdServer::start_with_space(space).await);
    let mut client = raw(&server).await;
    // A batch's 500 acquires wait their turn behind etcd's fsyncs. In a workspace run
    // beside two CPU-bound processes one came back not taken (`None`: its call failed with
    // a retryable error, as the batch contract allows), 129 s into the case; the default
    // 5 s request timeout is the error such a wait makes likely. This case measures
    // space, not time: its calls may take as long as a hang guard allows.
    let backend = EtcdBackend::builder()
        .endpoint(server.endpoint())
        .key_prefix(PREFIX)
        .token_retention(Duration::from_secs(1))
        .request_timeout(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let started = Instant::now();
    let mut sizes = Vec::new();
    for batch in 0..NAMES / BATCH {
        let keys: Vec<LockKey> = (batch * BATCH..(batch + 1) * BATCH)
            .map(|i| key(&format!("job:{i}")))
            .collect();
        let leases: Vec<Lease> = match backend.acquire_many(&keys, TTL).await {
            Ok(leases) => leases
                .into_iter()
                .map(|lease| lease.expect("a one-off name is free"))
                .collect(),
            Err(e) => panic!(
                "batch {batch} of {BATCH} names refused after {:?}, database sizes {sizes:?}: {e}",
                started.elapsed()
            ),
        };
        let released = backend.release_many(&leases).await.unwrap();
        assert!(released.iter().all(|r| *r == Release::Released));
        sizes.push(client.status().await.unwrap().db_size());
    }
    println!(
        "{NAMES} one-off names in {:?} under a {QUOTA}-byte quota; database size after each \
         batch of {BATCH}: {sizes:?}",
        started.elapsed()
    );
    assert!(
        sizes
            .iter()
            .all(|size| u64::try_from(*size).unwrap() <= QUOTA)
    );
}
