//! The scenario of the `prometheus` example, shared with its test: a Prometheus scrape
//! endpoint on a loopback port ([`serve`]) and a few locks on the in-memory store that give
//! every series the README lists a value ([`take_locks`]).

use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use distlock::backend::Layered;
use distlock::memory::{Faults, MemoryBackend};
use distlock::tower::{JobError, LeaderLayer, LockLayer, Locked, OnMiss};
use distlock::{
    Admission, Election, EnforcementMode, FencedResource, LockBackend, LockError, LockKey, Locker,
    MemoryFencedResource,
};
use metrics_exporter_prometheus::{BuildError, PrometheusBuilder};
use tokio::time::{Instant, sleep};
use tower_layer::Layer;
use tower_service::Service;

/// Any error of the scenario, boxed: it is an example, and every error ends the run.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// The histograms' bucket bounds in seconds, from a millisecond to five minutes: the
/// dashboard computes quantiles across instances from buckets, which summaries cannot give.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The leases' TTL: short, so that renewals and a loss happen within a second.
const TTL: Duration = Duration::from_millis(300);
/// How long the contended key is held while another caller waits for it.
const HOLD: Duration = Duration::from_millis(400);

/// Installs the Prometheus recorder as the process's global recorder and serves the
/// scrape endpoint (`GET /metrics`) on `127.0.0.1:port`; port 0 picks a free port. Returns
/// the address it serves on.
///
/// Call it inside a tokio runtime: the endpoint is served by a task on it. Only loopback
/// addresses are bound, and only loopback clients are answered.
pub fn serve(port: u16) -> Result<SocketAddr, BoxError> {
    // The exporter binds the address it is given and does not say which port it got, so
    // a free port is found first; another process may take it in between, then try again.
    let mut attempts = 0;
    loop {
        let chosen = if port == 0 { free_port()? } else { port };
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, chosen));
        let installed = PrometheusBuilder::new()
            .with_http_listener(address)
            .add_allowed_address("127.0.0.0/8")?
            .set_buckets(BUCKETS)?
            .install();
        match installed {
            Ok(()) => return Ok(address),
            Err(BuildError::FailedToCreateHTTPListener(_)) if port == 0 && attempts < 5 => {
                attempts += 1;
            }
            Err(e) => return Err(format!("serving /metrics on {address}: {e}").into()),
        }
    }
}

/// A loopback port that was free a moment ago.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Takes a few locks on an in-memory store, so that every series has a value: free keys
/// taken and released; a held key that a `try_lock` finds contended, a `with_lock` waits
/// for while the holder's lease is renewed, and a waiter gives up on; a late write refused
/// by its fencing token; through the `tower` layers, a job handed back because its key
/// was held, a job stopped because its store stopped answering, and a tick skipped by the
/// instance that does not lead.
pub async fn take_locks() -> Result<(), BoxError> {
    let store = MemoryBackend::new();
    let locker = new_locker(store.client(), Duration::from_secs(5))?;

    for id in 1..=3 {
        let key = LockKey::new(format!("payout:{id}"))?;
        let guard = locker.try_lock(&key).await?.ok_or("a free key")?;
        guard.release().await?;
    }

    // payout:42 is held for HOLD (its lease renewed every TTL / 3 meanwhile): a `try_lock`
    // finds it contended, a `with_lock` waits for it and writes with the newer token.
    let key = LockKey::new("payout:42")?;
    let holder = locker.try_lock(&key).await?.ok_or("a free key")?;
    let old_token = holder.token();
    if locker.try_lock(&key).await?.is_some() {
        return Err("a held key was granted again".into());
    }
    let releasing = tokio::spawn(async move {
        sleep(HOLD).await;
        holder.release().await
    });
    let ledger = MemoryFencedResource::new(EnforcementMode::Enforce);
    let waited = Instant::now();
    let admitted = locker
        .with_lock(&key, |guard| {
            let token = guard.token();
            let ledger = &ledger;
            async move { ledger.write("payout:42", token, b"paid").await }
        })
        .await??;
    println!(
        "waited {:?} for payout:42 held by another caller",
        waited.elapsed()
    );
    releasing.await??;
    if !admitted.is_admitted() {
        return Err(format!("the new holder's write was refused: {admitted:?}").into());
    }
    // The first holder's late write, with its older token.
    if !matches!(
        ledger.write("payout:42", old_token, b"paid late").await?,
        Admission::Stale { .. }
    ) {
        return Err("a stale write was admitted".into());
    }

    // Held again: a caller that waits at most 100 ms gives up.
    let holder = locker.try_lock(&key).await?.ok_or("a free key")?;
    let impatient = new_locker(store.client(), Duration::from_millis(100))?;
    match impatient.lock(&key).await {
        Err(LockError::Timeout { .. }) => {}
        other => return Err(format!("a wait on a held key: {other:?}").into()),
    }

    // A job whose key (payout:42) is held is handed back to its queue.
    let mut jobs = LockLayer::new(locker.clone(), job_key)
        .on_miss(OnMiss::Requeue)
        .layer(Work::default());
    if !matches!(jobs.call(42).await, Err(JobError::Busy { .. })) {
        return Err("a job ran while its key was held".into());
    }
    holder.release().await?;

    // A job whose store stops answering loses its lease and is stopped.
    let faults = Arc::new(Faults::default());
    let flaky = Layered::new(Arc::new(MemoryBackend::new()), faults.clone());
    let stalls = Work {
        takes: Duration::from_secs(2),
        partitions: Some(faults),
    };
    let mut jobs =
        LockLayer::new(new_locker(flaky, Duration::from_secs(5))?, job_key).layer(stalls);
    if !matches!(jobs.call(7).await, Err(JobError::Lost { .. })) {
        return Err("a job ran on after its lease was lost".into());
    }

    // Two instances of a cron worker: one leads and runs the tick, the other skips it.
    let instances = [
        LeaderLayer::new(Election::new(
            new_locker(store.client(), Duration::from_secs(5))?,
            "nightly",
        )?)?,
        LeaderLayer::new(Election::new(
            new_locker(store.client(), Duration::from_secs(5))?,
            "nightly",
        )?)?,
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    while !instances.iter().any(LeaderLayer::is_leading) {
        if Instant::now() >= deadline {
            return Err("no instance leads the role".into());
        }
        sleep(Duration::from_millis(10)).await;
    }
    let mut ran = 0;
    for instance in &instances {
        ran += usize::from(instance.layer(Work::default()).call(1).await?.is_some());
    }
    if ran != 1 {
        return Err(format!("the tick ran {ran} times").into());
    }
    Ok(())
}

/// A locker on a client of `store` that waits up to `wait` in `lock`.
fn new_locker(client: impl LockBackend + 'static, wait: Duration) -> Result<Locker, LockError> {
    Locker::builder(Arc::new(client))
        .ttl(TTL)
        .wait_timeout(Some(wait))
        .build()
}

/// A job's key: its payout's.
fn job_key(job: &u64) -> Result<LockKey, LockError> {
    LockKey::new(format!("payout:{job}"))
}

/// A job: it takes `takes`, and first cuts its store off if `partitions` holds the store's
/// faults.
#[derive(Clone, Debug, Default)]
struct Work {
    takes: Duration,
    partitions: Option<Arc<Faults>>,
}

impl Service<Locked<u64>> for Work {
    type Response = u64;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<u64, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, job: Locked<u64>) -> Self::Future {
        if let Some(faults) = &self.partitions {
            faults.partition();
        }
        let takes = self.takes;
        Box::pin(async move {
            sleep(takes).await;
            Ok(job.request)
        })
    }
}
