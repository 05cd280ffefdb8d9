//! The TCP options of every connection the backend opens.

use std::time::Duration;

/// The TCP options of every connection (the node's or each cluster node's, the release
/// listener's, those of `replica_acks`): `TCP_NODELAY`, since a request is one small write
/// whose reply the caller waits for (Nagle's algorithm would hold it back behind an
/// unacknowledged one), and keepalive. The backend finds a dead connection itself where
/// a caller waits (the request timeout on every request, the listener's ping after a
/// quiet request timeout); keepalive keeps a connection that carries nothing for long
/// in the tables of NATs and firewalls, and has the kernel close one whose peer is gone,
/// within 30 s (15 s idle, then 3 probes 5 s apart).
pub(crate) fn tcp_settings() -> redis::io::tcp::TcpSettings {
    // How long a connection may carry nothing before TCP probes its peer.
    let keepalive = redis::io::tcp::socket2::TcpKeepalive::new().with_time(Duration::from_secs(15));
    // The pause between two unanswered probes, where the platform lets it be set.
    #[cfg(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "freebsd",
        target_os = "windows"
    ))]
    let keepalive = keepalive.with_interval(Duration::from_secs(5));
    // Unanswered probes before the kernel closes the connection, where the platform lets
    // them be set.
    #[cfg(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "freebsd"
    ))]
    let keepalive = keepalive.with_retries(3);
    redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
}
