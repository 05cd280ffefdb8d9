//! `lockctl leader URL ROLE`: who leads a role elected with `distlock::Election`, for
//! operators: the leader's owner id, its fencing token and how long its lease still runs.

use std::process::ExitCode;
use std::time::Duration;

use distlock::{FencingToken, LockError, election_key};
use serde_json::json;

use crate::exit;
use crate::keys::is_memory;

/// Prints the leader of `role` on the store at `url`: owner id, token, TTL left; exits 1
/// when nobody leads.
///
/// When nobody leads, it says so and prints the newest token issued for the role (the
/// last leader's, which the next leader's token will exceed) where the store keeps it;
/// Redis keeps none after a release, its next token being its clock.
pub async fn show(url: &str, role: &str, json: bool) -> Result<ExitCode, LockError> {
    // The role is checked before anything is sent.
    let key = election_key(role)?;
    let backend = distlock::connect(url).await?;
    if is_memory(url) {
        eprintln!(
            "note: memory:// is a store inside this lockctl process; nobody leads there \
             but this process"
        );
    }
    let info = backend.inspect(&key).await?;
    if json {
        let value = json!({
            "role": role,
            "key": key.as_str(),
            "leader": info.owner.map(|o| o.to_string()),
            "token": info.token.map(FencingToken::get),
            "ttl_left_ms": info.owner.and(info.remaining).map(|r| r.as_millis()),
        });
        println!("{value}");
        return Ok(if info.owner.is_some() {
            ExitCode::SUCCESS
        } else {
            exit::no()
        });
    }
    println!("role:     {role}");
    println!("key:      {key}");
    match info.owner {
        Some(owner) => {
            println!("leader:   {owner}");
            println!(
                "token:    {}",
                info.token.map_or("none issued".into(), |t| t.to_string())
            );
            println!(
                "ttl left: {}",
                info.remaining.map_or("-".into(), |left| {
                    // Whole milliseconds: finer digits are noise for an operator.
                    let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
                    humantime::format_duration(Duration::from_millis(ms)).to_string()
                })
            );
        }
        None => {
            println!("leader:   none");
            println!(
                "token:    {}",
                info.token.map_or("none kept by the store".into(), |t| {
                    format!("{t} (the last leader's)")
                })
            );
            return Ok(exit::no());
        }
    }
    Ok(ExitCode::SUCCESS)
}
