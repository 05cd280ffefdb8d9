//! What the scripts' replies mean: a token, a renewal, a release.

use std::time::Duration;

use distlock_core::{Effect, LockError, Release, Renewal, valid_until};
use redis::Value;
use tokio::time::Instant;

use crate::error::{NAME, map_error};

/// A renew script's reply (`1`: renewed) for a call sent at `sent`.
pub(crate) fn renewal(renewed: i64, sent: Instant, ttl: Duration) -> Renewal {
    if renewed == 1 {
        Renewal::Renewed {
            valid_until: valid_until(sent, ttl),
        }
    } else {
        Renewal::Lost
    }
}

/// A release script's reply (`1`: released).
pub(crate) fn release(released: i64) -> Release {
    if released == 1 {
        Release::Released
    } else {
        Release::NotHeld
    }
}

/// An acquire script's reply: the token granted, or none (the key is held).
pub(crate) fn parse_token(reply: Option<Value>) -> Result<Option<u64>, LockError> {
    let Some(reply) = reply else {
        return Err(LockError::backend(NAME, "the acquire script sent no reply"));
    };
    let reply = reply
        .extract_error()
        .map_err(|e| map_error("acquire", Effect::Write("acquire"), &e))?;
    redis::from_redis_value::<Option<u64>>(reply).map_err(|e| LockError::backend(NAME, e))
}
