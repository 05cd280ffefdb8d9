//! `lockctl inspect`, `acquire` and `release`: one lock, by hand.

use std::process::ExitCode;
use std::time::Duration;

use distlock::{BackendId, FencingToken, Lease, LockError, LockKey, OwnerId, Release, Scheme};
use serde_json::json;
use tokio::time::Instant;

fn note_if_memory(url: &str) {
    let memory = url
        .split_once("://")
        .and_then(|(scheme, _)| Scheme::from_name(scheme))
        == Some(Scheme::Memory);
    if memory {
        eprintln!(
            "note: memory:// is a store inside this lockctl process; it ends when lockctl exits"
        );
    }
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
    let backend = distlock::connect(url).await?;
    note_if_memory(url);
    let Some(lease) = backend.acquire(&key, ttl).await? else {
        eprintln!("lockctl: {key} is held by someone else");
        return Ok(ExitCode::FAILURE);
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
/// A lease is bound to the backend instance that granted it, and this process did not
/// grant it: a backend that enforces the binding refuses it with `ForeignLease`, which
/// is reported as such.
pub async fn release(url: &str, key: &str, owner: &str, token: u64) -> Result<ExitCode, LockError> {
    let key = LockKey::new(key)?;
    let owner = OwnerId::parse(owner)?;
    let backend = distlock::connect(url).await?;
    let caps = backend.capabilities();
    let lease = Lease::new(
        BackendId::next(),
        key.clone(),
        owner,
        FencingToken(token),
        caps.min_ttl,
        Instant::now(),
    );
    match backend.release(&lease).await {
        Ok(Release::Released) => {
            println!("released {key}");
            Ok(ExitCode::SUCCESS)
        }
        Ok(Release::NotHeld) => {
            eprintln!(
                "lockctl: {key} is not held by owner {owner} with token {token}; nothing changed"
            );
            Ok(ExitCode::FAILURE)
        }
        Ok(Release::Unreachable) => {
            eprintln!(
                "lockctl: the store did not answer for {key}; it may still be held until its TTL runs out"
            );
            Ok(ExitCode::FAILURE)
        }
        Err(LockError::ForeignLease { backend }) => Err(LockError::Config(format!(
            "the {backend} backend only releases leases granted by the same client instance, \
             and this lockctl process did not grant this one; nothing changed \
             (wait for the TTL to run out instead)"
        ))),
        Err(e) => Err(e),
    }
}
