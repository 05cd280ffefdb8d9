//! Free ports on 127.0.0.1: [`free_port`] (never the same twice in one process),
//! [`free_port_with_bus`] for Redis Cluster nodes, [`loopback`] addresses, and starting a
//! server again on fresh ports when another process took its port first
//! ([`start_on_free_ports`], [`is_port_clash`]).

use std::collections::HashSet;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::error::HarnessError;

/// Ports handed out by this process, so that two servers started at the same time never
/// get the same port from [`free_port`].
fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Returns a TCP port on 127.0.0.1 that is free right now.
///
/// The port is found by binding `127.0.0.1:0` and closing the listener, so another process
/// could take it before the server binds it; the harness never hands out the same port
/// twice within one process, which removes the races between parallel tests.
pub fn free_port() -> Result<u16, HarnessError> {
    for _ in 0..100 {
        let listener = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| HarnessError::io("binding 127.0.0.1:0 to find a free port", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("reading the local address of a listener", e))?
            .port();
        drop(listener);
        if handed_out().lock().insert(port) {
            return Ok(port);
        }
    }
    Err(HarnessError::Setup(
        "no free port on 127.0.0.1 after 100 attempts".into(),
    ))
}

/// Returns a free port `p` on 127.0.0.1 such that `p + 10000` is free too, as a Redis
/// Cluster node needs for its cluster bus.
pub fn free_port_with_bus() -> Result<u16, HarnessError> {
    for _ in 0..200 {
        let port = free_port()?;
        let Some(bus) = port.checked_add(10_000) else {
            continue;
        };
        if port_is_free(bus) && handed_out().lock().insert(bus) {
            return Ok(port);
        }
    }
    Err(HarnessError::Setup(
        "no free port p on 127.0.0.1 with p + 10000 also free after 200 attempts".into(),
    ))
}

/// The loopback socket address for `port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

/// How many times a server start is retried with fresh ports when its port was taken
/// between [`free_port`] and the server's own bind (another process on the machine).
pub(crate) const START_ATTEMPTS: usize = 3;

/// Runs `start` (which picks fresh ports each time) again while it fails because another
/// process took a port first, at most [`START_ATTEMPTS`] times in all.
pub(crate) async fn start_on_free_ports<T, F, Fut>(mut start: F) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, HarnessError>>,
{
    let mut attempt = 1;
    loop {
        match start().await {
            Err(e) if is_port_clash(&e) && attempt < START_ATTEMPTS => attempt += 1,
            result => return result,
        }
    }
}

/// True when `e` says the server could not bind its port because it was taken.
pub(crate) fn is_port_clash(e: &HarnessError) -> bool {
    match e {
        HarnessError::Exited { log, .. } => log.to_lowercase().contains("address already in use"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_bindable() {
        let a = free_port().unwrap();
        let b = free_port().unwrap();
        assert_ne!(a, b);
        assert!(port_is_free(a));
        let c = free_port_with_bus().unwrap();
        assert!(c <= u16::MAX - 10_000);
        assert!(port_is_free(c) && port_is_free(c + 10_000));
    }

    #[test]
    fn port_clashes_are_recognised_from_server_logs() {
        let exited = |log: &str| HarnessError::Exited {
            what: "server".into(),
            status: "exit status: 1".into(),
            log: log.into(),
        };
        for log in [
            "# Warning: Could not create server TCP listening socket 127.0.0.1:42779: bind: Address already in use",
            "etcdmain: listen tcp 127.0.0.1:42779: bind: address already in use",
            "LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use",
        ] {
            assert!(is_port_clash(&exited(log)), "{log}");
        }
        assert!(!is_port_clash(&exited(
            "FATAL: data directory has wrong ownership"
        )));
        assert!(!is_port_clash(&HarnessError::Setup(
            "address already in use".into()
        )));
    }
}
