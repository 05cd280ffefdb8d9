//! `lockctl setup`, `inspect`, `acquire` and `release`: one store or one lock, by hand.

use std::process::ExitCode;
use std::time::Duration;

use distlock::{Fence, FencingToken, LockError, LockKey, OwnerId, Release, Scheme};
use serde_json::json;

use crate::exit;

/// True when `url` names the in-process memory store.
pub fn is_memory(url: &str) -> bool {
    url.trim()
        .split_once("://")
        .and_then(|(scheme, _)| Scheme::from_name(scheme))
        == Some(Scheme::Memory)
}

fn note_if_memory(url: &str) {
    if is_memory(url) {
        eprintln!(
            "note: memory:// is a store inside this lockctl process; it ends when lockctl exits"
        );
    }
}

/// Prepares the store for use (for PostgreSQL, creates the schema and tables).
pub async fn setup(url: &str, json: bool) -> Result<ExitCode, LockError> {
    distlock::setup(url).await?;
    let shown = distlock::redact_url(url);
    let tables = url
        .trim()
        .split_once("://")
        .and_then(|(s, _)| Scheme::from_name(s))
        == Some(Scheme::Postgres);
    if json {
        println!("{}", json!({"store": shown, "tables": tables}));
    } else if tables {
        println!("the tables distlock uses are ready on {shown}");
    } else {
        println!("nothing to set up on {shown}: this store needs no tables");
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints the holder, newest token and remaining TTL of `key`.
pub async fn inspect(url: &str, key: &str, json: bool) -> Result<ExitCode, LockError> {
    let key = LockKey::new(key)?;
    let backend = distlock::connect(url).await?;
    note_if_memory(url);
    let info = backend.inspect(&key).await?;
    if json {
        let value = json!({
            "key": key.as_str(),
            "holder": info.owner.map(|o| o.to_string()),
            "token": info.token.map(FencingToken::get),
            "remaining_ms": info.remaining.map(|r| r.as_millis()),
        });
        println!("{value}");
    } else {
        println!("key:       {key}");
        println!(
            "holder:    {}",
            info.owner.map_or("none".into(), |o| o.to_string())
        );
        println!(
            "token:     {}",
            info.token.map_or("none issued".into(), |t| t.to_string())
        );
        println!(
            "remaining: {}",
            info.remaining
                .map_or("-".into(), |r| humantime::format_duration(
                    Duration::from_millis(u64::try_from(r.as_millis()).unwrap_or(u64::MAX))
                )
                .to_string())
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Takes `key` for `ttl` and prints the owner id and token; exits non-zero if it is held.
pub async fn acquire(
    url: &str,
    key: &str,
    ttl: Duration,
    json: bool,
) -> Result<ExitCode, LockError> {
    let key = LockKey::new(key)?;
    // What no store can honour is refused before connecting: a zero TTL, or one finer
    // than a millisecond (the finest granularity any store keeps).
    if ttl.is_zero() || ttl.subsec_nanos() % 1_000_000 != 0 {
        return Err(LockError::invalid_ttl(
            ttl,
            "a TTL must be a whole number of milliseconds above zero",
        ));
    }
    let backend = distlock::connect(url).await?;
    if backend.capabilities().session_bound {
        return Err(LockError::Config(format!(
            "{} locks end with the session that took them, and lockctl's session ends when it \
             exits: the lock would be free again at once. Nothing was taken. Take the lock in \
             the process that does the work, or use a store whose locks outlive their client \
             (for PostgreSQL, mode=lease)",
            backend.name()
        )));
    }
    note_if_memory(url);
    let Some(lease) = backend.acquire(&key, ttl).await? else {
        eprintln!("lockctl: {key} is held by someone else");
        return Ok(exit::no());
    };
    if json {
        let value = json!({
            "key": key.as_str(),
            "owner": lease.owner().to_string(),
            "token": lease.token().get(),
            "ttl_ms": ttl.as_millis(),
        });
        println!("{value}");
    } else {
        println!("key:   {key}");
        println!("owner: {}", lease.owner());
        println!("token: {}", lease.token());
        println!("ttl:   {}", humantime::format_duration(ttl));
    }
    Ok(ExitCode::SUCCESS)
}

/// Releases `key` if the lease of `owner` with `token` still holds it.
///
/// The lease was granted to another process (`lockctl acquire`, a worker): it is rebuilt
/// from its owner id and token with [`distlock::LockBackend::adopt`], and the store
/// releases it only if that owner and token still hold the key (the token is checked with
/// `fence` first: a store may release by owner id alone, which is unique per acquisition,
/// but a wrong token typed here is a mistake to report, not to act on). Backends whose
/// leases are a pinned session (PostgreSQL advisory locks) cannot do this and say so.
pub async fn release(
    url: &str,
    key: &str,
    owner: &str,
    token: u64,
    json: bool,
) -> Result<ExitCode, LockError> {
    let key = LockKey::new(key)?;
    let owner = OwnerId::parse(owner)?;
    let backend = distlock::connect(url).await?;
    let ttl = backend.capabilities().min_ttl;
    let lease = match backend.adopt(&key, owner, FencingToken(token), ttl) {
        Ok(lease) => lease,
        Err(LockError::Unsupported { backend, .. }) => {
            return Err(LockError::Config(format!(
                "the {backend} backend cannot release a lock held by another process: \
                 its lease is the holder's own session; nothing changed \
                 (the lock frees itself when that session ends)"
            )));
        }
        Err(e) => return Err(e),
    };
    let released = match backend.fence(&lease).await? {
        Fence::Current => backend.release(&lease).await?,
        Fence::Stale { .. } => Release::NotHeld,
    };
    if json {
        let outcome = match released {
            Release::Released => "released",
            Release::NotHeld => "not_held",
            Release::Unreachable => "unreachable",
        };
        println!(
            "{}",
            json!({"key": key.as_str(), "owner": owner.to_string(), "token": token, "outcome": outcome})
        );
    }
    match released {
        Release::Released => {
            if !json {
                println!("released {key}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Release::NotHeld if is_memory(url) => {
            eprintln!(
                "lockctl: {key} is not held by owner {owner} with token {token}; nothing changed. \
                 memory:// is a store inside each lockctl process, so a lock taken by another \
                 lockctl run is never in it: use a shared store (redis://, etcd://, postgres://)"
            );
            Ok(exit::no())
        }
        Release::NotHeld => {
            eprintln!(
                "lockctl: {key} is not held by owner {owner} with token {token}; nothing changed \
                 (the lease expired, was released, or belongs to someone else)"
            );
            Ok(exit::no())
        }
        Release::Unreachable => {
            eprintln!(
                "lockctl: the store did not answer for {key}; it may still be held until its TTL runs out"
            );
            Ok(ExitCode::from(3))
        }
    }
}
