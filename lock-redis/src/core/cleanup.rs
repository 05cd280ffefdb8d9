//! The cleanup after an acquire whose outcome is unknown: the abandon calls of the keys
//! the attempts may have taken, sent again while that may still help, within a bound.

use std::time::Duration;

use tokio::time::Instant;

use crate::conn::{Call, Conn};
use crate::error::is_resendable;

/// The first pause before a call that did not run is sent again; it doubles each time.
pub(crate) const RESEND_PAUSE: Duration = Duration::from_millis(5);

/// How many request timeouts the cleanup after an acquire with an unknown outcome may
/// take in all.
const CLEANUP_TIMEOUTS: u32 = 2;

/// Sends the abandon `calls` over `conn` until each ran, a try finds the server silent or
/// refusing for good, or [`CLEANUP_TIMEOUTS`] request timeouts (or `ttl`, if shorter)
/// have gone by. Best effort: the keys expire on their own anyway.
pub(crate) async fn give_back(
    conn: &Conn,
    calls: Vec<Call>,
    ttl: Duration,
    node_timeout: Duration,
) {
    let mut calls = calls;
    let keys = calls.len();
    // Requests on the same connection run in order, so this runs after the
    // acquire if that ever reached the server. A hung server gets one try: the
    // cleanup must not outlive its caller by more than a few request timeouts.
    let give_up = Instant::now() + ttl.min(node_timeout * CLEANUP_TIMEOUTS);
    let mut pause = RESEND_PAUSE;
    let done = loop {
        let left = give_up.saturating_duration_since(Instant::now());
        let reply =
            tokio::time::timeout(left.min(node_timeout), conn.batch(&calls, node_timeout)).await;
        let again = match reply {
            // The items that did not run (refused for now: a replica, a dataset
            // loading, a busy script; or their connection dropped) are sent again.
            Ok(Ok(replies)) => {
                calls = calls
                    .into_iter()
                    .zip(replies)
                    .filter_map(|(call, reply)| {
                        matches!(&reply, Err(e) if is_resendable(e)).then_some(call)
                    })
                    .collect();
                if calls.is_empty() {
                    break true;
                }
                true
            }
            // A connection that dropped: the one made again may serve the next try.
            Ok(Err(e)) => is_resendable(&e),
            Err(_) => false,
        };
        if !again || Instant::now() + pause >= give_up {
            break false;
        }
        tokio::time::sleep(pause).await;
        pause *= 2;
    };
    tracing::debug!(
        keys,
        done,
        "cleanup after an acquire with an unknown outcome"
    );
}
