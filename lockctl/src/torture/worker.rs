//! One torture worker process: takes the run's locks one after another and, under each,
//! runs a fenced critical section on the ledger, reporting every step on its standard
//! output (see [`Event`]). It stops after its current critical section when its standard
//! input closes.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distlock::{
    Admission, EnforcementMode, FencedResource, LockBackend, LockError, LockKey, Locker, Release,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncReadExt;

use super::broken::Break;
use super::event::{Clock, Event, now};

/// What a worker is told by the run that starts it.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerArgs {
    /// The store under test.
    #[arg(long)]
    pub url: String,
    /// The store holding the ledger.
    #[arg(long)]
    pub ledger: String,
    /// The run's name prefix: locks are `PREFIX:0` to `PREFIX:KEYS-1`.
    #[arg(long)]
    pub prefix: String,
    /// How many locks the run shares.
    #[arg(long)]
    pub keys: u32,
    /// The lease TTL.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// Steps per critical section.
    #[arg(long)]
    pub steps: u32,
    /// The pause after each step.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub step_time: Duration,
    /// The seed of the worker's choices.
    #[arg(long)]
    pub seed: u64,
    /// A bug to put into the store's client, to show the checker catches it.
    #[arg(long, value_enum)]
    pub r#break: Option<Break>,
}

/// The name of lock (and ledger entry) `key` of a run.
pub fn name(prefix: &str, key: u32) -> String {
    format!("{prefix}:{key}")
}

/// How long a worker's setup waits for a store that cannot be reached: one started while
/// the run restarts its store (or a replacement for a killed worker) waits for it to come
/// back, as a deployed worker would; past this, the store is taken for misconfigured.
const SETUP_PATIENCE: Duration = Duration::from_secs(30);

/// `connect` again while it fails for want of the store ([`LockError::Unavailable`]: nothing
/// was done), at most until [`SETUP_PATIENCE`] has passed since `started`.
async fn patiently<T, F, Fut>(started: tokio::time::Instant, mut connect: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, LockError>>,
{
    loop {
        match connect().await {
            Err(LockError::Unavailable { .. }) if started.elapsed() < SETUP_PATIENCE => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            done => return done,
        }
    }
}

/// Runs the worker until its standard input closes; errors are the setup's only.
pub async fn run(args: &WorkerArgs) -> Result<(), LockError> {
    let started = tokio::time::Instant::now();
    let backend = patiently(started, || distlock::connect(&args.url)).await?;
    let backend: Arc<dyn LockBackend> = match args.r#break {
        Some(bug) => bug.into_backend(backend),
        None => backend,
    };
    let ledger = patiently(started, || {
        distlock::fenced_resource(&args.ledger, EnforcementMode::Enforce)
    })
    .await?;
    let locker = Locker::builder(backend)
        .ttl(args.ttl)
        .wait_timeout(Some(args.ttl * 4))
        .build()?;
    let keys = (0..args.keys)
        .map(|k| LockKey::new(name(&args.prefix, k)))
        .collect::<Result<Vec<_>, _>>()?;
    let stop = Arc::new(AtomicBool::new(false));
    tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut sink = [0u8; 64];
            let mut stdin = tokio::io::stdin();
            while !matches!(stdin.read(&mut sink).await, Ok(0) | Err(_)) {}
            stop.store(true, Ordering::SeqCst);
        }
    });
    let clock = Clock::new();
    let mut rng = StdRng::seed_from_u64(args.seed);
    while !stop.load(Ordering::SeqCst) {
        let key = rng.random_range(0..args.keys);
        critical_section(args, &locker, &*ledger, &clock, key, &keys[key as usize]).await;
    }
    Ok(())
}

/// Takes `key`, runs the steps while the guard says held, and releases.
async fn critical_section(
    args: &WorkerArgs,
    locker: &Locker,
    ledger: &dyn FencedResource,
    clock: &Clock,
    key: u32,
    lock: &LockKey,
) {
    let invoked = now();
    let guard = match locker.lock(lock).await {
        Ok(guard) => guard,
        Err(LockError::Timeout { .. }) => return,
        Err(e) => return report_error(&e),
    };
    let token = guard.token().0;
    report(&Event::Grant {
        key,
        token,
        invoked,
        granted: now(),
        valid: clock.of(guard.valid_until().into_std()),
    });
    let resource = lock.as_str();
    for _ in 0..args.steps {
        let checked = now();
        if !guard.is_held() {
            report(&Event::Lost {
                key,
                token,
                at: checked,
            });
            break;
        }
        let valid = clock.of(guard.valid_until().into_std());
        match fenced_step(ledger, resource, guard.token()).await {
            Ok((read, admitted)) => report(&Event::Step {
                key,
                token,
                checked,
                valid,
                read,
                admitted,
            }),
            Err(e) => report_error(&e),
        }
        tokio::time::sleep(args.step_time).await;
    }
    let invoked = now();
    report(&Event::Releasing {
        key,
        token,
        invoked,
    });
    match guard.release().await {
        Ok(released) => report(&Event::Release {
            key,
            token,
            invoked,
            released: Some(released == Release::Released),
        }),
        // The release may have freed the key before the error: without the event, the
        // checker ran this lease's window to its validity and called this worker's own
        // next grant of the key an overlap.
        Err(e) => {
            report(&Event::Release {
                key,
                token,
                invoked,
                released: None,
            });
            report_error(&e);
        }
    }
}

/// One read-modify-write of the ledger entry, fenced by `token` before the read and at
/// the write, so a holder that lost its lease can neither write late nor write a value
/// it read before a newer holder wrote: the fence check records the token first, and a
/// stale holder's write after it is refused. Returns the value read (`None` when the
/// fence refused the token before reading) and whether the write was admitted.
async fn fenced_step(
    ledger: &dyn FencedResource,
    resource: &str,
    token: distlock::FencingToken,
) -> Result<(Option<u64>, bool), LockError> {
    if let Admission::Stale { .. } = ledger.check_only(resource, token).await? {
        return Ok((None, false));
    }
    let read = match ledger.read(resource).await? {
        Some(value) => parse(&value)?,
        None => 0,
    };
    let written = (read + 1).to_string();
    let admission = ledger.write(resource, token, written.as_bytes()).await?;
    Ok((Some(read), admission.is_admitted()))
}

/// A ledger value: the count of admitted writes, in decimal.
pub fn parse(value: &[u8]) -> Result<u64, LockError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            LockError::Config(format!(
                "the ledger holds {:?}, not a count: the run's names are in use by something else",
                String::from_utf8_lossy(value)
            ))
        })
}

fn report_error(error: &LockError) {
    report(&Event::Error {
        at: now(),
        what: error.to_string(),
    });
}

/// Writes `event` as one line and flushes it, so a worker killed right after a step has
/// reported it.
fn report(event: &Event) {
    let Ok(line) = serde_json::to_string(event) else {
        return;
    };
    let mut out = std::io::stdout().lock();
    // A closed pipe means the run is over; there is no one left to tell.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}
