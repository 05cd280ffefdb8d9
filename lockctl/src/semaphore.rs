//! `lockctl semaphore URL NAME --permits N`: a semaphore's permits, for operators: each
//! slot's holder, fencing token and how long its lease still runs.

use std::process::ExitCode;
use std::time::Duration;

use distlock::{FencingToken, LockError, LockKey, Locker};
use serde_json::json;

use crate::keys::is_memory;

/// Prints the slots of the semaphore `name` of `permits` permits on the store at `url`,
/// and how many are held.
pub async fn show(url: &str, name: &str, permits: u32, json: bool) -> Result<ExitCode, LockError> {
    // The name and the number of permits are checked before anything is sent.
    let name = LockKey::new(name)?;
    if permits == 0 || permits > distlock::MAX_PERMITS {
        return Err(LockError::Config(format!(
            "a semaphore has 1 to {} permits, not {permits}",
            distlock::MAX_PERMITS
        )));
    }
    let backend = distlock::connect(url).await?;
    if is_memory(url) {
        eprintln!(
            "note: memory:// is a store inside this lockctl process; no permit is held there \
             but by this process"
        );
    }
    let semaphore = Locker::new(backend)?.semaphore(&name, permits)?;
    let slots = semaphore.holders().await?;
    let held = slots.iter().filter(|s| s.owner.is_some()).count();
    if json {
        let rows: Vec<_> = semaphore
            .slots()
            .iter()
            .zip(&slots)
            .map(|(key, info)| {
                json!({
                    "key": key.as_str(),
                    "holder": info.owner.map(|o| o.to_string()),
                    "token": info.token.map(FencingToken::get),
                    "ttl_left_ms": info.owner.and(info.remaining).map(|r| r.as_millis()),
                })
            })
            .collect();
        let value = json!({
            "semaphore": name.as_str(),
            "permits": permits,
            "held": held,
            "slots": rows,
        });
        println!("{value}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("semaphore: {name} ({held} of {permits} permits held)");
    println!(
        "{:<6} {:<32} {:>20} {:>10}",
        "slot", "holder", "token", "ttl left"
    );
    for (slot, info) in slots.iter().enumerate() {
        let holder = info.owner.map_or("-".to_owned(), |o| o.to_string());
        let token = info.token.map_or("-".to_owned(), |t| t.to_string());
        let left = info
            .owner
            .and(info.remaining)
            .map_or("-".to_owned(), |left| {
                // Whole milliseconds: finer digits are noise for an operator.
                let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
                humantime::format_duration(Duration::from_millis(ms)).to_string()
            });
        println!("{slot:<6} {holder:<32} {token:>20} {left:>10}");
    }
    Ok(ExitCode::SUCCESS)
}
