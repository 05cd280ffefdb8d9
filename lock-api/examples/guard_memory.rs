//! Measures what a held `LockGuard` costs with the watchdog running: holds 100,000
//! guards in one process, reports resident memory per guard, and checks that one
//! renewal task renews all of them with batched `renew_many` calls.
//!
//! Run: `cargo run --release -p distlock-core --example guard_memory [COUNT]`

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use distlock_core::memory::MemoryBackend;
use distlock_core::{
    BackendLayer, Layered, Lease, LockBackend, LockError, LockKey, Locker, Renewal, async_trait,
};

/// Counts renewal calls.
#[derive(Debug, Default)]
struct Counting {
    renew_many_calls: AtomicUsize,
    renewed: AtomicUsize,
}

#[async_trait]
impl BackendLayer for Counting {
    fn name(&self, _: &dyn LockBackend) -> &'static str {
        "counting-memory"
    }
    async fn renew_many(
        &self,
        next: &dyn LockBackend,
        leases: &[Lease],
    ) -> Result<Vec<Renewal>, LockError> {
        self.renew_many_calls.fetch_add(1, Ordering::SeqCst);
        self.renewed.fetch_add(leases.len(), Ordering::SeqCst);
        next.renew_many(leases).await
    }
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn keys(prefix: &str, count: usize) -> Vec<LockKey> {
    (0..count)
        .map(|i| LockKey::new(format!("{prefix}:{i:08}")).expect("valid key"))
        .collect()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), LockError> {
    let count: usize = std::env::args()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(100_000);
    let ttl = Duration::from_secs(3);
    let store: Arc<dyn LockBackend> = Arc::new(MemoryBackend::new());
    let counting = Arc::new(Counting::default());
    let backend = Arc::new(Layered::new(store.clone(), counting.clone()));

    // The store's own cost of `count` leases, without guards, to subtract below.
    let before_store = rss_bytes();
    let plain: Vec<Lease> = store
        .acquire_many(&keys("plain", count), ttl)
        .await?
        .into_iter()
        .flatten()
        .collect();
    let store_and_lease = rss_bytes().saturating_sub(before_store);
    assert_eq!(plain.len(), count);

    let locker = Locker::builder(backend).ttl(ttl).build()?;
    let guarded_keys = keys("guard", count);
    let before = rss_bytes();
    let mut guards = Vec::with_capacity(count);
    for key in &guarded_keys {
        guards.push(locker.try_lock(key).await?.expect("free key"));
    }
    let with_guards = rss_bytes().saturating_sub(before);

    // Two renewal rounds (renewal at ttl / 3).
    tokio::time::sleep(ttl * 2 / 3 + Duration::from_millis(200)).await;
    let calls = counting.renew_many_calls.load(Ordering::SeqCst);
    let renewed = counting.renewed.load(Ordering::SeqCst);
    let held = guards.iter().filter(|g| g.is_held()).count();

    let per_guard = with_guards as f64 / count as f64;
    let per_store_entry = store_and_lease as f64 / count as f64;
    println!("guards held:                 {count}");
    println!(
        "RSS growth with guards:      {with_guards} bytes ({per_guard:.0} B per guard, store entry included)"
    );
    println!(
        "RSS growth of store + lease: {store_and_lease} bytes ({per_store_entry:.0} B per lease without a guard)"
    );
    println!(
        "guard cost beyond the store: {:.0} B per guard",
        per_guard - per_store_entry
    );
    println!("renew_many calls:            {calls} (one renewal task), leases renewed: {renewed}");
    println!("still held after 2 rounds:   {held}/{count}");
    if held != count || renewed < count {
        eprintln!("FAILED: not every guard was renewed");
        std::process::exit(1);
    }
    Ok(())
}
