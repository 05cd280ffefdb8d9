//! Token-key retention: the token key of a name nobody holds is deleted once its token is
//! older than the retention, so a lock per job id does not grow etcd's keyspace by a key
//! per job until the database reaches its quota and etcd refuses every write (`NOSPACE`).
//!
//! # Why deleting is safe
//!
//! A name's next token is at least the granting client's clock in microseconds. A token key
//! goes only when its token is older than the sweeping client's clock less the retention,
//! so the next grant, whose only floor is then the clock, is above it as long as no client
//! that grants reads a clock behind the sweeping client's by the retention or more (24 h by
//! default). The token itself is compared, not the key's age: a token granted by a clock
//! running ahead stays until the clocks have passed it by the retention. A token key
//! written when tokens were etcd revisions (an owner id, see
//! [`recorded_token`](crate::tokens::recorded_token)) holds a revision, far below any clock,
//! and goes at the first sweep.
//!
//! Each deletion is a transaction that checks the token key's `mod_revision` is still the
//! one read and that the lock key does not exist: a grant between the read and the
//! deletion, or a name held for longer than the retention, keeps its token key.
//!
//! # Who sweeps, and when
//!
//! Acquires start a sweep in the background, at most once per [`sweep_interval`] in a
//! process (a 24th of the retention, between 1 s and 1 h; a [`Periodic`] chore). Across the processes sharing a
//! prefix, `<prefix>/sweeps/tokens` holds the instant the next sweep is due: a process
//! sweeps only when that instant has passed (or lies more than an interval ahead of its
//! clock, as a client whose clock ran ahead would have written it) and its transaction
//! moving it an interval on is the one that lands. So about one sweep per interval runs,
//! whatever the number of processes; a free token key is gone at most about two intervals
//! after its retention ran out.
//!
//! A sweep reads the token keys in key order, at most [`PAGE`] at a time, and deletes the
//! expired ones of each page in transactions of [`GROUP`] names:
//!
//! ```text
//! if mod_revision(token key) == <as read> and create_revision(lock key) == 0, every name
//! then delete(token key), every name
//! else get(lock key), get(token key), every name  (keys only)
//! ```
//!
//! A failed comparison drops the names it shows held or granted since, and sends the
//! others again (at most [`TRANSACTIONS_PER_GROUP`] transactions).
//!
//! # Ranges of about a page
//!
//! To answer a range request etcd (3.4 to 3.6) visits every key of the range in its index,
//! even with a limit (the reply says how many keys the range holds), under a lock its
//! writes wait for. Read page after page up to the end of the token keys, each page would
//! cost as much as all the keys after it: a page of 1,000 read from the start of a million
//! took 190 to 340 ms here, 5 ms from 10,000 before their end, and a sweep visits about
//! n² / 2,000 keys. So each range ends where a prefix of its first key ends: after a page
//! that did not hold its whole range, the next range is that of the longest prefix the
//! page's first and last keys share (about the page's own span of names); after a range
//! that held under a quarter of a page, the next one's prefix is a byte shorter. Only the
//! first range of a sweep, and one after a jump into a denser stretch of names, visits many
//! more keys than it returns: a million expired token keys were swept in 55 s, against
//! 188 s reading to the end each time.
//!
//! One request at a time, so a sweep adds at most one request to the cluster's load; it
//! stops after the page under way when the backend is dropped, and at the first error. A
//! sweep that stops at an error leaves the range it reached, and the process's next sweep
//! goes on from there: started over each time, sweeps that a flaky connection cuts off
//! would only ever go over the first names. One that reached the end leaves the start.
//!
//! # Why not a lease on the token key
//!
//! A token key attached to a lease of the retention's length would be deleted by etcd,
//! with no sweep. But etcd expires a lease by its age on the leader, not by the token the
//! key holds: a token that a clock running ahead granted would go while the clocks are
//! still behind it, and the name's next token would be lower. A lease per name also costs
//! a consensus write more for every new name (a one-off name costs four: the lock's lease
//! grant, the transaction, the release and the revoke), and keeps a lease per name in
//! etcd's lessor for the retention; a lease shared by the names of an interval deletes all
//! of them in one raft entry when it expires. What was measured is in docs/DESIGN.md.

use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::LockError;
use distlock_core::chore::{Periodic, sweep_interval};
use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp, TxnOpResponse};
use tracing::{debug, warn};

use super::{EtcdBackend, Inner};
use crate::error::Effect;
use crate::keys::{etcd_key, name_of};
use crate::tokens::{clock_us, recorded_token};

/// How long the token key of a name nobody holds is kept by default.
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The shortest retention the builder accepts.
pub const MIN_TOKEN_RETENTION: Duration = Duration::from_secs(1);

/// The longest retention the builder accepts (ten years).
pub const MAX_TOKEN_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);

/// Token keys read per range request at most.
const PAGE: usize = 1_000;

/// Names per deleting transaction: two comparisons each, and etcd refuses a transaction
/// with more than `--max-txn-ops` comparisons (128 by default).
const GROUP: usize = 64;

/// Transactions per group while names in it are granted or held between the page's read
/// and the deletion; the names left go at the next sweep.
const TRANSACTIONS_PER_GROUP: usize = 3;

/// The retention, when this process may next sweep, and where its next sweep starts.
pub(crate) struct Sweeper {
    retention: Duration,
    sweeps: Periodic,
    /// Where the previous sweep stopped at an error; none: the start of the token keys.
    resume: std::sync::Mutex<Option<Cursor>>,
}

impl Sweeper {
    pub(crate) fn new(retention: Duration) -> Self {
        Self {
            retention,
            sweeps: Periodic::new(sweep_interval(retention)),
            resume: std::sync::Mutex::new(None),
        }
    }

    pub(crate) fn retention(&self) -> Duration {
        self.retention
    }

    fn resume(&self) -> std::sync::MutexGuard<'_, Option<Cursor>> {
        self.resume
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Where a sweep's next range starts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    /// The first key of the next range.
    from: Vec<u8>,
    /// The length of the prefix of `from` whose end ends the next range; none: the end
    /// of the token keys.
    prefix: Option<usize>,
}

/// The expired token key of one name, as a page read it.
struct Expired {
    token_key: Vec<u8>,
    lock_key: String,
    revision: i64,
}

/// What one sweep did.
#[derive(Debug, Default)]
struct Swept {
    /// Token keys read.
    scanned: usize,
    /// Token keys deleted.
    deleted: usize,
    /// Range requests sent.
    ranges: usize,
}

impl EtcdBackend {
    /// Starts a sweep in the background if this process's turn to look has come and it is
    /// not sweeping already. Costs an atomic load when it has not; does nothing outside a
    /// tokio runtime.
    pub(super) fn poke_sweeper(&self) {
        let Some(turn) = self.inner.sweeper.sweeps.due() else {
            return;
        };
        let inner = Arc::downgrade(&self.inner);
        turn.spawn(async move {
            let outcome = sweep(&inner).await;
            let Some(backend) = upgrade(&inner) else {
                return;
            };
            match outcome {
                Ok(Some(swept)) => debug!(
                    scanned = swept.scanned,
                    deleted = swept.deleted,
                    ranges = swept.ranges,
                    "swept the token keys of free names past their retention"
                ),
                Ok(None) => {}
                Err(e) => warn!(
                    error = %e,
                    "sweeping the token keys of free names failed; the next acquire after {:?} \
                     tries again",
                    backend.inner.sweeper.sweeps.every()
                ),
            }
        });
    }

    /// The key that holds the instant (µs since 1970) the next sweep of this prefix is due.
    fn sweep_key(&self) -> String {
        etcd_key(&self.inner.prefix, "sweeps", "tokens")
    }

    /// Whether this process sweeps now: the next sweep is due and this process's
    /// transaction moved the due instant an interval on.
    async fn claim_sweep(&self) -> Result<bool, LockError> {
        let key = self.sweep_key();
        let read = self
            .call(Effect::None, |client| {
                let key = key.clone();
                async move { client.kv_client().get(key, None).await }
            })
            .await?;
        let now = clock_us();
        let every =
            u64::try_from(self.inner.sweeper.sweeps.every().as_micros()).unwrap_or(u64::MAX);
        let current = read.kvs().first();
        let due = current.and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse::<u64>().ok());
        if due.is_some_and(|due| due > now && due - now <= every) {
            return Ok(false);
        }
        let revision = current.map_or(0, KeyValue::mod_revision);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::put(key, now.saturating_add(every).to_string(), None)]);
        Ok(self.txn(Effect::Write("sweep"), txn).await?.succeeded())
    }

    /// Up to [`PAGE`] token keys from `from` up to `end`, and whether there are more.
    async fn token_page(
        &self,
        from: &[u8],
        end: &[u8],
    ) -> Result<(Vec<KeyValue>, bool), LockError> {
        let limit = i64::try_from(PAGE).unwrap_or(i64::MAX);
        let mut page = self
            .call(Effect::None, |client| {
                let (from, end) = (from.to_vec(), end.to_vec());
                let options = GetOptions::new().with_range(end).with_limit(limit);
                async move { client.kv_client().get(from, Some(options)).await }
            })
            .await?;
        let more = page.more();
        Ok((page.take_kvs(), more))
    }

    /// The token keys of `page` whose token is older than the retention, by this client's
    /// clock now. Keys of another prefix that share the range (prefix `a/tokens/b` lies
    /// under `a/tokens/`) have no name here and are left alone.
    fn expired(&self, page: &[KeyValue]) -> Vec<Expired> {
        let retention = u64::try_from(self.inner.sweeper.retention.as_micros()).unwrap_or(u64::MAX);
        let cutoff = clock_us().saturating_sub(retention);
        let prefix = &self.inner.prefix;
        page.iter()
            .filter_map(|kv| {
                let name = name_of(prefix, "tokens", kv.key())?;
                let token = recorded_token(kv)?;
                (token.get() < cutoff).then(|| Expired {
                    token_key: kv.key().to_vec(),
                    lock_key: etcd_key(prefix, "locks", &name),
                    revision: kv.mod_revision(),
                })
            })
            .collect()
    }

    /// Deletes the token keys of `group` whose names are free and were not granted since
    /// they were read; the number deleted.
    async fn delete_expired(&self, group: &[Expired]) -> Result<usize, LockError> {
        let mut left: Vec<&Expired> = group.iter().collect();
        for _ in 0..TRANSACTIONS_PER_GROUP {
            if left.is_empty() {
                break;
            }
            let resp = self.txn(Effect::Write("sweep"), deletion(&left)).await?;
            if resp.succeeded() {
                return Ok(left.len());
            }
            let mut gets = resp.op_responses().into_iter().filter_map(|op| match op {
                TxnOpResponse::Get(mut get) => Some(get.take_kvs().into_iter().next()),
                _ => None,
            });
            left.retain(|name| {
                let (lock, token) = (gets.next().flatten(), gets.next().flatten());
                lock.is_none() && token.is_some_and(|kv| kv.mod_revision() == name.revision)
            });
        }
        Ok(0)
    }
}

/// The transaction that deletes the token keys of `names` if none was granted since it
/// was read and none is held; otherwise it reads them (keys only, in `names`' order: the
/// lock key, then the token key).
fn deletion(names: &[&Expired]) -> Txn {
    let compares: Vec<Compare> = names
        .iter()
        .flat_map(|name| {
            [
                Compare::mod_revision(name.token_key.clone(), CompareOp::Equal, name.revision),
                Compare::create_revision(name.lock_key.clone(), CompareOp::Equal, 0),
            ]
        })
        .collect();
    let deletes: Vec<TxnOp> = names
        .iter()
        .map(|name| TxnOp::delete(name.token_key.clone(), None))
        .collect();
    let reads: Vec<TxnOp> = names
        .iter()
        .flat_map(|name| {
            [
                TxnOp::get(
                    name.lock_key.clone(),
                    Some(GetOptions::new().with_keys_only()),
                ),
                TxnOp::get(
                    name.token_key.clone(),
                    Some(GetOptions::new().with_keys_only()),
                ),
            ]
        })
        .collect();
    Txn::new().when(compares).and_then(deletes).or_else(reads)
}

/// The end of the range of `prefix`'s token keys: `<prefix>/tokens0`, `0` being the byte
/// after `/`.
fn tokens_end(prefix: &str) -> String {
    format!("{prefix}/tokens0")
}

fn upgrade(inner: &Weak<Inner>) -> Option<EtcdBackend> {
    inner.upgrade().map(|inner| EtcdBackend { inner })
}

/// One sweep, if this process's claim on it lands: range after range of token keys (see
/// "Ranges of about a page" above) from where the previous sweep stopped until their end,
/// or until the backend is dropped.
async fn sweep(inner: &Weak<Inner>) -> Result<Option<Swept>, LockError> {
    let Some(backend) = upgrade(inner) else {
        return Ok(None);
    };
    if !backend.claim_sweep().await? {
        return Ok(None);
    }
    drop(backend);
    let mut swept = Swept::default();
    while let Some(backend) = upgrade(inner) {
        if backend.sweep_range(&mut swept).await? {
            break;
        }
    }
    Ok(Some(swept))
}

impl EtcdBackend {
    /// Sweeps the range at the sweeper's cursor and moves the cursor past it, or back to
    /// the start once the range reached the end of the token keys (then true). An error
    /// leaves the cursor where it was.
    async fn sweep_range(&self, swept: &mut Swept) -> Result<bool, LockError> {
        let dir = etcd_key(&self.inner.prefix, "tokens", "").into_bytes();
        let end = tokens_end(&self.inner.prefix).into_bytes();
        let Cursor { mut from, prefix } =
            self.inner
                .sweeper
                .resume()
                .clone()
                .unwrap_or_else(|| Cursor {
                    from: dir.clone(),
                    prefix: None,
                });
        let upper = prefix
            .and_then(|len| prefix_end(&from[..len.min(from.len())]))
            .map_or_else(|| end.clone(), |upper| upper.min(end.clone()));
        let (page, more) = self.token_page(&from, &upper).await?;
        for group in self.expired(&page).chunks(GROUP) {
            swept.deleted += self.delete_expired(group).await?;
        }
        swept.scanned += page.len();
        swept.ranges += 1;
        let next = match (page.first(), page.last()) {
            (Some(first), Some(last)) if more => {
                let shared = shared_prefix(first.key(), last.key());
                from = last.key().to_vec();
                from.push(0);
                Cursor {
                    from,
                    prefix: Some(shared.max(dir.len() + 1)),
                }
            }
            _ => {
                let shorter = if page.len() < PAGE / 4 {
                    prefix.filter(|&len| len > dir.len() + 1).map(|len| len - 1)
                } else {
                    prefix
                };
                Cursor {
                    from: upper,
                    prefix: shorter,
                }
            }
        };
        let done = next.from >= end;
        *self.inner.sweeper.resume() = (!done).then_some(next);
        Ok(done)
    }
}

/// The first key after every key that starts with `prefix` (etcd's prefix range end);
/// none when `prefix` is all `0xFF` bytes.
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// How many bytes `a` and `b` start with alike.
fn shared_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use distlock_core::{LockBackend, LockKey, Release};
    use harness::etcd::EtcdServer;
    use harness::require;

    use super::*;

    /// The name is granted again between the page's read and the deletion: the deletion
    /// must see the new grant and keep its token key, or the name's next token would have
    /// only the clock as its floor while a token of a moment ago is in use.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_between_the_read_and_the_deletion_keeps_the_token_key() {
        let server = require(EtcdServer::start().await);
        let retention = Duration::from_secs(1);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .token_retention(retention)
            .build()
            .await
            .unwrap();
        let key = LockKey::new("granted-between").unwrap();
        let ttl = Duration::from_secs(2);
        let first = backend.acquire(&key, ttl).await.unwrap().expect("free");
        assert_eq!(backend.release(&first).await.unwrap(), Release::Released);
        tokio::time::sleep(retention + Duration::from_millis(100)).await;

        let from = etcd_key(&backend.inner.prefix, "tokens", "").into_bytes();
        let end = tokens_end(&backend.inner.prefix).into_bytes();
        let (page, _) = backend.token_page(&from, &end).await.unwrap();
        let expired = backend.expired(&page);
        assert_eq!(
            expired.len(),
            1,
            "the released name's token is past its retention"
        );
        let second = backend.acquire(&key, ttl).await.unwrap().expect("free");

        assert_eq!(backend.delete_expired(&expired).await.unwrap(), 0);
        assert_eq!(
            backend.lookup(&key).await.unwrap().newest(),
            Some(second.token())
        );
        assert_eq!(backend.release(&second).await.unwrap(), Release::Released);
        assert_eq!(backend.delete_expired(&expired).await.unwrap(), 0);
        assert_eq!(
            backend.lookup(&key).await.unwrap().newest(),
            Some(second.token()),
            "a released name's token key read before its last grant"
        );
    }

    /// Puts `kvs` in transactions of 100.
    async fn put_all(backend: &EtcdBackend, kvs: Vec<(String, String)>) {
        for chunk in kvs.chunks(100) {
            let puts: Vec<TxnOp> = chunk
                .iter()
                .map(|(k, v)| TxnOp::put(k.as_str(), v.as_str(), None))
                .collect();
            let txn = Txn::new().and_then(puts);
            backend.txn(Effect::Write("test"), txn).await.unwrap();
        }
    }

    /// Dense job ids, names of other shapes between and after them, and another prefix's
    /// keys inside the token range: one sweep must read each key once, however the ranges
    /// fall, and delete every expired token key of a free name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_sweep_reads_every_token_key_once_and_deletes_each_expired_one() {
        let server = require(EtcdServer::start().await);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .token_retention(Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        let mut names: Vec<String> = (0..5_000).map(|i| format!("job:{i:07}")).collect();
        names.extend((0..300).map(|i| format!("tenant-{}:{i}", i % 7)));
        for name in [
            "job:1", "job:10", "job:2", "a", "b:1", "zz", "Ω-ünï", "x/y", "50%",
        ] {
            names.push(name.to_owned());
        }
        let now = clock_us();
        let (long_ago, ahead) = (now - 60_000_000, now + 3_600_000_000);
        let expired: Vec<&String> = names.iter().step_by(2).collect();
        let held = [expired[10], expired[2_600]];
        let key = |kind, name: &str| etcd_key(&backend.inner.prefix, kind, name);
        let mut kvs: Vec<(String, String)> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let token = if i % 2 == 0 { long_ago } else { ahead };
                (key("tokens", name), format!("{token:020}"))
            })
            .collect();
        for name in held {
            kvs.push((key("locks", name), "held".into()));
        }
        // Another prefix's lock and token keys, inside this one's token range.
        let nested = format!("{}/tokens/nested", backend.inner.prefix);
        let nested_keys = [
            etcd_key(&nested, "locks", "x"),
            etcd_key(&nested, "tokens", "x"),
        ];
        for nested_key in &nested_keys {
            kvs.push((nested_key.clone(), format!("{long_ago:020}")));
        }
        put_all(&backend, kvs).await;

        let swept = sweep(&Arc::downgrade(&backend.inner))
            .await
            .unwrap()
            .expect("the first sweep's claim lands");
        println!("{swept:?}");
        assert_eq!(swept.scanned, names.len() + nested_keys.len());
        assert_eq!(swept.deleted, expired.len() - held.len());

        let left = backend
            .call(Effect::None, |client| {
                let dir = key("tokens", "");
                let options = GetOptions::new().with_prefix().with_keys_only();
                async move { client.kv_client().get(dir, Some(options)).await }
            })
            .await
            .unwrap();
        let left: BTreeSet<String> = left
            .kvs()
            .iter()
            .map(|kv| String::from_utf8(kv.key().to_vec()).unwrap())
            .collect();
        let mut kept: BTreeSet<String> = names
            .iter()
            .skip(1)
            .step_by(2)
            .chain(held)
            .map(|name| key("tokens", name))
            .collect();
        kept.extend(nested_keys);
        assert_eq!(left, kept);
    }

    /// A sweep cut off by an error after its first range, a page of names whose tokens
    /// are kept: the next sweep goes on from the range it reached instead of reading those
    /// names again, and deletes every expired token key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sweep_cut_off_by_an_error_is_taken_up_where_it_stopped() {
        let server = require(EtcdServer::start().await);
        let backend = EtcdBackend::builder()
            .endpoint(server.endpoint())
            .token_retention(Duration::from_secs(1))
            .request_timeout(Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        // A page of names whose tokens are kept, then two of expired ones.
        let names = 3 * PAGE;
        let now = clock_us();
        let (long_ago, ahead) = (now - 60_000_000, now + 3_600_000_000);
        let kvs = (0..names)
            .map(|i| {
                let name = format!("job:{i:05}");
                let key = etcd_key(&backend.inner.prefix, "tokens", &name);
                let token = if i < PAGE { ahead } else { long_ago };
                (key, format!("{token:020}"))
            })
            .collect();
        put_all(&backend, kvs).await;

        let mut first = Swept::default();
        assert!(!backend.sweep_range(&mut first).await.unwrap());
        assert_eq!((first.scanned, first.deleted), (PAGE, 0), "the kept page");
        server.pause().unwrap();
        let failed = backend.sweep_range(&mut Swept::default()).await;
        server.resume().unwrap();
        assert!(
            failed.is_err(),
            "a paused member answers nothing: {failed:?}"
        );

        let next = sweep(&Arc::downgrade(&backend.inner))
            .await
            .unwrap()
            .expect("the first claimed sweep");
        assert_eq!(
            next.scanned,
            names - first.scanned,
            "the next sweep reads the names after those the cut-off one read"
        );
        assert_eq!(next.deleted, names - PAGE, "every expired token key");
        assert_eq!(
            *backend.inner.sweeper.resume(),
            None,
            "a full sweep starts over"
        );
    }

    #[test]
    fn a_prefix_ends_at_its_successor_and_shared_prefixes_are_counted_in_bytes() {
        assert_eq!(
            prefix_end(b"a/tokens/job:0"),
            Some(b"a/tokens/job:1".to_vec())
        );
        assert_eq!(prefix_end(b"a\xff\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff"), None);
        assert_eq!(shared_prefix(b"job:0000999", b"job:0000000"), 8);
        assert_eq!(shared_prefix(b"a", b"b"), 0);
        assert_eq!(shared_prefix(b"ab", b"abc"), 2);
    }

    #[test]
    fn the_token_range_holds_token_keys_and_no_other_kind() {
        let (start, end) = (etcd_key("app", "tokens", ""), tokens_end("app"));
        let inside = |key: &str| start.as_str() <= key && key < end.as_str();
        assert!(inside(&etcd_key("app", "tokens", "x")));
        assert!(inside(&etcd_key("app", "tokens", "~\u{10ffff}")));
        for kind in ["locks", "sweeps", "fenced", "data"] {
            let key = etcd_key("app", kind, "tokens");
            assert!(!inside(&key), "{key}");
        }
    }
}
