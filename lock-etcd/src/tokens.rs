//! What the keys of a lock hold, and where its next token comes from.
//!
//! - The lock key holds `<owner id>:<token>` while the lock is held: one value that names
//!   the holder and the token it was granted, compared as a whole by renew, release and
//!   fence (an owner id is drawn afresh for every acquisition, so no other holder's value
//!   is ever equal).
//! - The token key holds the newest token granted for the name, as a 20-digit zero-padded
//!   decimal, so that etcd's byte-wise comparison orders tokens numerically (fenced
//!   resources store theirs the same way).
//!
//! # Why tokens are not etcd revisions
//!
//! A revision is the obvious token, and it rises through restarts and leader changes, but
//! not through a snapshot restore: `etcdctl snapshot restore` brings back the snapshot's
//! revision, and every token granted after the snapshot was taken would be granted again.
//! Anything kept in etcd goes back with the restore, so the token needs a source outside
//! it: the next token is the client's wall clock in microseconds, or one more than the
//! name's newest token when that is higher. Between restores the acquire transaction
//! checks that the token key is still the one read, so tokens strictly increase per name
//! whatever the clients' clocks say; after a restore they keep rising as long as the
//! clients that grant read clocks later than the last token granted before it (a restore
//! takes minutes; clocks in sync to within that are the one assumption).
//!
//! # When a token key goes
//!
//! With a lock per job id every name leaves a token key, so the token key of a name nobody
//! holds is deleted once its token is older than the token retention (see the backend's
//! `retention` module). The clock is then the only floor for the name's next token, so a
//! key goes only when the sweeping client's clock is past its token by the retention: the
//! next token is above it as long as no granting client's clock is behind the sweeping
//! one's by the retention (24 h by default). The token itself is compared with the clock,
//! not the key's age: a token that a clock running ahead granted stays until clocks pass it.

use std::time::{SystemTime, UNIX_EPOCH};

use distlock_core::{FencingToken, LockError, OwnerId};
use etcd_client::KeyValue;

use crate::error::NAME;

/// The value of a held lock key.
pub(crate) fn lock_value(owner: OwnerId, token: FencingToken) -> String {
    format!("{owner}:{}", token.get())
}

/// The holder and token a lock key's value names; `None` for anything else.
pub(crate) fn parse_lock_value(value: &[u8]) -> Option<(OwnerId, FencingToken)> {
    let (owner, token) = std::str::from_utf8(value).ok()?.split_once(':')?;
    Some((
        OwnerId::parse(owner).ok()?,
        FencingToken(token.parse().ok()?),
    ))
}

/// Zero-padded to the 20 digits of `u64::MAX`, so byte order is numeric order.
pub(crate) fn encode(token: FencingToken) -> String {
    format!("{:020}", token.get())
}

/// A token as [`encode`] writes it.
pub(crate) fn parse_token(bytes: &[u8]) -> Result<FencingToken, LockError> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(FencingToken)
        .ok_or_else(|| {
            LockError::backend(
                NAME,
                "a token or fence key holds something other than a token",
            )
        })
}

/// The newest token a token key records. A token key that holds no token was written when
/// tokens were etcd revisions: its `mod_revision` was the newest token then.
pub(crate) fn recorded_token(kv: &KeyValue) -> Option<FencingToken> {
    parse_token(kv.value())
        .ok()
        .or_else(|| u64::try_from(kv.mod_revision()).ok().map(FencingToken))
}

/// This client's wall clock in microseconds since 1970, the unit of tokens.
pub(crate) fn clock_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
        })
}

/// The token to grant after `newest`: the wall clock in microseconds, or one more than
/// `newest` if the clock does not read later than it.
pub(crate) fn next_token(newest: Option<FencingToken>) -> FencingToken {
    let after = newest.map_or(1, |t| t.get().saturating_add(1));
    FencingToken(clock_us().max(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_tokens_sort_like_numbers() {
        let tokens = [0, 9, 10, 99, 100, 4_294_967_296, u64::MAX];
        for pair in tokens.windows(2) {
            assert!(encode(FencingToken(pair[0])) < encode(FencingToken(pair[1])));
        }
        assert_eq!(
            parse_token(encode(FencingToken(u64::MAX)).as_bytes())
                .unwrap()
                .get(),
            u64::MAX
        );
        assert!(parse_token(b"x1").is_err());
    }

    #[test]
    fn a_lock_value_reads_back_as_its_owner_and_token() {
        let owner = OwnerId::random();
        let value = lock_value(owner, FencingToken(42));
        assert_eq!(
            parse_lock_value(value.as_bytes()),
            Some((owner, FencingToken(42)))
        );
        assert_eq!(parse_lock_value(owner.to_string().as_bytes()), None);
        assert_eq!(parse_lock_value(b"not-an-owner:1"), None);
    }

    #[test]
    fn the_next_token_is_the_clock_or_one_above_the_newest() {
        let now = next_token(None);
        let later = next_token(Some(now));
        assert!(later > now, "{later:?} after {now:?}");
        let ahead = FencingToken(u64::MAX - 5);
        assert_eq!(next_token(Some(ahead)), FencingToken(u64::MAX - 4));
        // A clock in microseconds since 1970, not a small counter.
        assert!(now.get() > 1_700_000_000_000_000, "{now:?}");
    }
}
