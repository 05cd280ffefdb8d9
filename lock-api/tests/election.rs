//! Leader election on the memory backend, on tokio's paused clock: one leader at a time,
//! hand-over on resign, loss ends leadership, fenced triggers, cancel safety, observation.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::memory::{Faults, MemoryBackend};
use distlock_core::{
    Admission, BackendLayer, Capabilities, Election, EnforcementMode, FencedResource, FencingToken,
    Layered, Lease, LockBackend, LockError, LockInfo, LockKey, Locker, MemoryFencedResource,
    Release, RetryPolicy, async_trait, election_key,
};
use futures::StreamExt;
use parking_lot::Mutex;
use tokio::time::{Instant, sleep, timeout};

const TTL: Duration = Duration::from_secs(3);

/// An election for `role` on `client`, a new client of a store, with its own locker (as
/// another process would have).
fn election(client: impl LockBackend + 'static, role: &str) -> Election {
    let locker = Locker::builder(Arc::new(client)).ttl(TTL).build().unwrap();
    Election::new(locker, role).unwrap()
}

#[tokio::test(start_paused = true)]
async fn one_leader_at_a_time_among_campaigners() {
    const CAMPAIGNERS: usize = 4;
    const TERMS: usize = 5;
    let store = MemoryBackend::new();
    let acting = Arc::new(AtomicUsize::new(0));
    let most_acting = Arc::new(AtomicUsize::new(0));
    let terms = Arc::new(Mutex::new(Vec::new()));
    let queue = Arc::new(MemoryFencedResource::new(EnforcementMode::Enforce));
    let tasks: Vec<_> = (0..CAMPAIGNERS)
        .map(|_| {
            let election = election(store.client(), "scheduler");
            let (acting, most_acting, terms, queue) = (
                acting.clone(),
                most_acting.clone(),
                terms.clone(),
                queue.clone(),
            );
            tokio::spawn(async move {
                for _ in 0..TERMS {
                    let leadership = election.campaign().await.unwrap();
                    let now = acting.fetch_add(1, Ordering::SeqCst) + 1;
                    most_acting.fetch_max(now, Ordering::SeqCst);
                    terms.lock().push(leadership.token());
                    let admitted = queue.check_only("queue", leadership.token()).await.unwrap();
                    assert_eq!(admitted, Admission::Admitted);
                    sleep(Duration::from_millis(50)).await;
                    acting.fetch_sub(1, Ordering::SeqCst);
                    assert_eq!(leadership.resign().await.unwrap(), Release::Released);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(most_acting.load(Ordering::SeqCst), 1, "two leaders at once");
    let terms = terms.lock().clone();
    assert_eq!(terms.len(), CAMPAIGNERS * TERMS);
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "tokens in election order: {terms:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn tokens_strictly_increase_across_leaders() {
    let store = MemoryBackend::new();
    let elections: Vec<_> = (0..3)
        .map(|_| election(store.client(), "sweeper"))
        .collect();
    let mut last = FencingToken(0);
    for round in 0..9 {
        let leadership = elections[round % 3].campaign().await.unwrap();
        assert!(
            leadership.token() > last,
            "{} after {last}",
            leadership.token()
        );
        last = leadership.token();
        // A dropped leadership (no resign) is released in the background, too.
        if round % 2 == 0 {
            leadership.resign().await.unwrap();
        } else {
            drop(leadership);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_standby_takes_over_within_one_backoff_step_after_resign() {
    let store = MemoryBackend::new();
    let leader = election(store.client(), "scheduler");
    let retry = RetryPolicy {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(100),
    };
    let standby = Election::builder(
        Locker::builder(Arc::new(store.client()))
            .ttl(TTL)
            .build()
            .unwrap(),
        "scheduler",
    )
    .retry(retry)
    .build()
    .unwrap();
    let first = leader.campaign().await.unwrap();
    let first_token = first.token();
    let waiting = tokio::spawn(async move {
        let leadership = standby.campaign().await.unwrap();
        (Instant::now(), leadership)
    });
    // The standby has been waiting long enough for its backoff to reach its ceiling.
    sleep(TTL * 2).await;
    assert!(first.is_leader() && !waiting.is_finished());
    let resigned_at = Instant::now();
    assert_eq!(first.resign().await.unwrap(), Release::Released);
    let (elected_at, second) = waiting.await.unwrap();
    assert!(
        elected_at - resigned_at <= retry.max,
        "elected {:?} after the resign; one backoff step is at most {:?}",
        elected_at - resigned_at,
        retry.max
    );
    assert!(second.token() > first_token);
    second.resign().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_ends_leadership_and_the_old_leaders_triggers_are_refused() {
    let store = MemoryBackend::new();
    let faults = Arc::new(Faults::default());
    let faulty = || Layered::new(Arc::new(store.client()), faults.clone());
    let queue = MemoryFencedResource::new(EnforcementMode::Enforce);
    let (first, second) = (
        election(faulty(), "scheduler"),
        election(faulty(), "scheduler"),
    );
    let old = first.campaign().await.unwrap();
    assert!(
        queue
            .check_only("queue", old.token())
            .await
            .unwrap()
            .is_admitted()
    );
    let standby = tokio::spawn(async move { second.campaign().await.unwrap() });

    // The old leader cannot reach the store (a pause, a partition) past its TTL.
    faults.partition();
    let lost = timeout(TTL * 2, old.lost()).await;
    assert!(lost.is_ok(), "lost() fires when the lease runs out");
    assert!(!old.is_leader());
    faults.heal();

    let new = timeout(TTL * 2, standby).await.unwrap().unwrap();
    assert!(
        new.token() > old.token(),
        "{} > {}",
        new.token(),
        old.token()
    );
    assert!(
        queue
            .check_only("queue", new.token())
            .await
            .unwrap()
            .is_admitted()
    );
    // The old leader resumes and fires once more: refused downstream.
    assert_eq!(
        queue.check_only("queue", old.token()).await.unwrap(),
        Admission::Stale {
            latest: new.token()
        }
    );
    assert_eq!(old.resign().await.unwrap(), Release::NotHeld);
    new.resign().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_campaign_leaves_nothing_held() {
    let store = MemoryBackend::new();
    let key = election_key("scheduler").unwrap();
    let (first, second) = (
        election(store.client(), "scheduler"),
        election(store.client(), "scheduler"),
    );

    // Cancelled while waiting for the leader: it does not take over later.
    let leader = first.campaign().await.unwrap();
    assert!(
        timeout(Duration::from_millis(200), second.campaign())
            .await
            .is_err()
    );
    leader.resign().await.unwrap();
    sleep(TTL).await;
    assert_eq!(store.inspect(&key).await.unwrap().owner, None);

    // Cancelled after the store granted its acquire but before the reply came back: the
    // lease it won is released at once, not left to run out.
    let slow = Layered::new(
        Arc::new(store.client()),
        Shim {
            grant_delay: Duration::from_millis(100),
            inspect: true,
        },
    );
    let slow = Election::new(
        Locker::builder(Arc::new(slow)).ttl(TTL).build().unwrap(),
        "scheduler",
    )
    .unwrap();
    assert!(
        timeout(Duration::from_millis(50), slow.campaign())
            .await
            .is_err()
    );
    assert!(store.inspect(&key).await.unwrap().owner.is_some());
    sleep(Duration::from_millis(100)).await;
    let info = store.inspect(&key).await.unwrap();
    assert_eq!(
        info.owner, None,
        "nothing held after the cancelled campaign"
    );
    assert!(
        info.token.is_some_and(|t| t.get() >= 2),
        "the in-flight acquire was granted (and then released): {info:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn observe_reports_each_leader_in_turn() {
    let store = MemoryBackend::new();
    let (first, second) = (
        election(store.client(), "scheduler"),
        election(store.client(), "scheduler"),
    );
    let watcher = election(store.client(), "scheduler");
    let mut leaders = Box::pin(watcher.observe());
    assert_eq!(leaders.next().await.unwrap().unwrap(), None);

    let a = first.campaign().await.unwrap();
    let a_token = a.token();
    let seen = leaders.next().await.unwrap().unwrap().unwrap();
    assert_eq!((seen.owner, seen.token), (a.owner(), a.token()));
    assert!(seen.remaining.is_some_and(|r| r <= TTL));
    a.resign().await.unwrap();
    assert_eq!(leaders.next().await.unwrap().unwrap(), None);

    let b = second.campaign().await.unwrap();
    let seen = leaders.next().await.unwrap().unwrap().unwrap();
    assert_eq!((seen.owner, seen.token), (b.owner(), b.token()));
    assert!(seen.token > a_token);
    assert_eq!(
        watcher.leader().await.unwrap().map(|l| l.owner),
        Some(b.owner())
    );
    b.resign().await.unwrap();
}

/// A layer whose grants reach the caller `grant_delay` after the store made them, and
/// which answers `inspect` only when `inspect` is set (else the trait's default,
/// `Unsupported`).
#[derive(Debug)]
struct Shim {
    grant_delay: Duration,
    inspect: bool,
}

#[async_trait]
impl BackendLayer for Shim {
    fn name(&self, _: &dyn LockBackend) -> &'static str {
        "shim"
    }
    fn capabilities(&self, next: &dyn LockBackend) -> Capabilities {
        next.capabilities().inspect(self.inspect)
    }
    async fn acquire(
        &self,
        next: &dyn LockBackend,
        key: &LockKey,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let granted = next.acquire(key, ttl).await;
        sleep(self.grant_delay).await;
        granted
    }
    async fn inspect(&self, next: &dyn LockBackend, key: &LockKey) -> Result<LockInfo, LockError> {
        if !self.inspect {
            return Err(LockError::Unsupported {
                operation: "inspect",
                backend: "shim",
            });
        }
        next.inspect(key).await
    }
}

#[tokio::test(start_paused = true)]
async fn observe_ends_with_unsupported_on_a_backend_without_inspect() {
    let shim = Layered::new(
        Arc::new(MemoryBackend::new()),
        Shim {
            grant_delay: Duration::ZERO,
            inspect: false,
        },
    );
    let locker = Locker::builder(Arc::new(shim)).ttl(TTL).build().unwrap();
    let watcher = Election::new(locker, "scheduler").unwrap();
    let mut leaders = Box::pin(watcher.observe());
    let first = leaders.next().await.unwrap();
    assert!(
        matches!(
            first,
            Err(LockError::Unsupported {
                operation: "inspect",
                ..
            })
        ),
        "{first:?}"
    );
    assert!(leaders.next().await.is_none(), "the stream ends");
}

#[tokio::test]
async fn bad_settings_are_refused_before_anything_is_sent() {
    let faults = Arc::new(Faults::default());
    let store = Layered::new(Arc::new(MemoryBackend::new()), faults.clone());
    let locker = Locker::builder(Arc::new(store)).ttl(TTL).build().unwrap();
    let empty = Election::new(locker.clone(), "");
    assert!(
        matches!(empty, Err(LockError::InvalidKey { .. })),
        "{empty:?}"
    );
    let control = Election::new(locker.clone(), "cron\n");
    assert!(matches!(control, Err(LockError::InvalidKey { .. })));
    let long = Election::new(locker.clone(), &"r".repeat(600));
    assert!(matches!(long, Err(LockError::InvalidKey { .. })));
    let retry = Election::builder(locker.clone(), "cron")
        .retry(RetryPolicy {
            initial: Duration::from_secs(2),
            max: Duration::from_secs(1),
        })
        .build();
    assert!(matches!(retry, Err(LockError::Config(_))), "{retry:?}");
    let poll = Election::builder(locker, "cron")
        .poll_interval(Duration::ZERO)
        .build();
    assert!(matches!(poll, Err(LockError::Config(_))), "{poll:?}");
    assert_eq!(faults.calls(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_election_on_a_chosen_key_leads_on_that_key() {
    let store = MemoryBackend::new();
    let key = LockKey::new("tenant-7:election:cron").unwrap();
    let locker = Locker::builder(Arc::new(store.client()))
        .ttl(TTL)
        .build()
        .unwrap();
    let election = Election::builder(locker, "cron")
        .key(key.clone())
        .build()
        .unwrap();
    assert_eq!(election.key(), &key);
    let leadership = election.campaign().await.unwrap();
    assert_eq!(
        store.inspect(&key).await.unwrap().owner,
        Some(leadership.owner())
    );
    let default = election_key("cron").unwrap();
    assert_eq!(store.inspect(&default).await.unwrap().owner, None);
    leadership.resign().await.unwrap();
}
