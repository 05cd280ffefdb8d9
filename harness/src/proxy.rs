//! A TCP fault-injection proxy that runs inside the test process: clients connect to
//! [`FaultProxy::addr`] instead of the server, and the test cuts, delays or resets their
//! traffic. Controls apply at once to existing and new connections, except
//! [`FaultProxy::blackhole_connections`] (the connections it names) and
//! [`FaultProxy::retarget`] (new connections only, as a virtual IP or a DNS name moved to
//! another server would).
//!
//! # Blackhole semantics
//!
//! [`FaultProxy::blackhole`] models a network partition: **no byte flows in either
//! direction** while it lasts, and sockets stay open (no FIN, no RST), so clients see only
//! silence and must rely on their own timeouts. Bytes are *held back*, not dropped: the
//! proxy stops reading, so the data waits in socket buffers (plus at most one chunk per
//! direction already read), and is delivered in order after [`FaultProxy::heal`] — exactly
//! what TCP does when a partition heals before the sender gives up retransmitting. A
//! test that wants the connection gone after a partition calls [`FaultProxy::reset`]
//! before healing. A connection accepted while blackholed is held open without contacting
//! the upstream until healed (the kernel completes the client's handshake, unlike a real
//! partition where `connect` itself would hang).
//!
//! [`FaultProxy::blackhole_connections`] (and [`FaultProxy::blackhole_existing`]) does the
//! same to some connections only, numbered in the order the proxy accepted them: a
//! connection that died silently (a NAT or balancer that dropped its flow) while a new one
//! gets through.
//!
//! If the upstream refuses the connection, the client's connection is reset, as if it had
//! been refused.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::error::HarnessError;

/// Size of one forwarded chunk.
const CHUNK: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Faults {
    blackholed: bool,
    /// The numbers of the connections blackholed on their own, `start..end`.
    held: (u64, u64),
    delay: Duration,
    /// Bumped by [`FaultProxy::reset`]; connections accepted before the bump are reset.
    reset_generation: u64,
    /// Where connections accepted from now on go.
    upstream: SocketAddr,
}

impl Faults {
    /// Whether connection `id` may pass bytes now.
    fn open_for(&self, id: u64) -> bool {
        !self.blackholed && !(self.held.0..self.held.1).contains(&id)
    }
}

/// A TCP proxy on a free 127.0.0.1 port forwarding to one upstream, with fault controls.
/// Dropping it closes the listener and every proxied connection.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: watch::Sender<Faults>,
    active: Arc<AtomicUsize>,
    accepted: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards every accepted connection to `upstream`.
    /// Must be called within a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> Result<Self, HarnessError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::io("binding the fault proxy on 127.0.0.1:0", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| HarnessError::io("reading the fault proxy address", e))?;
        let (faults, rx) = watch::channel(Faults {
            blackholed: false,
            held: (0, 0),
            delay: Duration::ZERO,
            reset_generation: 0,
            upstream,
        });
        let active = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept_loop(listener, rx, active.clone(), accepted.clone()));
        Ok(FaultProxy {
            addr,
            faults,
            active,
            accepted,
            task,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the proxy forwards new connections to.
    pub fn upstream(&self) -> SocketAddr {
        self.faults.borrow().upstream
    }

    /// Forwards the connections accepted from now on to `upstream`; those open now stay
    /// with the server they reached, as when a virtual IP or a DNS name moves to another
    /// server.
    pub fn retarget(&self, upstream: SocketAddr) {
        self.faults.send_modify(|f| f.upstream = upstream);
    }

    /// Stops every byte in both directions, on existing and new connections, keeping the
    /// sockets open; data is held back until [`heal`](Self::heal) (see the module docs).
    pub fn blackhole(&self) {
        self.faults.send_modify(|f| f.blackholed = true);
    }

    /// Blackholes the connections numbered `numbers` (counted from 0 in the order they were
    /// accepted; see [`accepted`](Self::accepted)) as [`blackhole`](Self::blackhole) does
    /// every connection, until [`heal`](Self::heal); the others, and connections accepted
    /// later, keep flowing.
    pub fn blackhole_connections(&self, numbers: Range<u64>) {
        self.faults
            .send_modify(|f| f.held = (numbers.start, numbers.end));
    }

    /// Blackholes every connection accepted so far, open or not; connections accepted
    /// later flow: the existing connections died silently, and a new one gets through.
    pub fn blackhole_existing(&self) {
        self.blackhole_connections(0..self.accepted());
    }

    /// How many connections the proxy has accepted so far; the next one is numbered this.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Adds `delay` of latency to every chunk forwarded in either direction (so a round
    /// trip gets at least twice `delay`). Chunks are delayed from the moment they were
    /// read, keeping their order; `Duration::ZERO` removes the delay.
    pub fn delay(&self, delay: Duration) {
        self.faults.send_modify(|f| f.delay = delay);
    }

    /// Resets (`RST`) every connection open now, both the client side and the upstream
    /// side; connections made afterwards work normally. The reset happens asynchronously,
    /// within a scheduler tick.
    pub fn reset(&self) {
        self.faults.send_modify(|f| f.reset_generation += 1);
    }

    /// Removes the blackholes (of every connection or some) and the delay; held-back
    /// bytes flow again.
    pub fn heal(&self) {
        self.faults.send_modify(|f| {
            f.blackholed = false;
            f.held = (0, 0);
            f.delay = Duration::ZERO;
        });
    }

    /// True while blackholed.
    pub fn is_blackholed(&self) -> bool {
        self.faults.borrow().blackholed
    }

    /// The current added latency per direction.
    pub fn current_delay(&self) -> Duration {
        self.faults.borrow().delay
    }

    /// How many client connections the proxy holds now.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Dropping the accept task drops its JoinSet, which aborts every connection task.
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    faults: watch::Receiver<Faults>,
    active: Arc<AtomicUsize>,
    accepted: Arc<AtomicU64>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            client = listener.accept() => match client {
                Ok((client, _)) => {
                    let (generation, upstream) = {
                        let f = faults.borrow();
                        (f.reset_generation, f.upstream)
                    };
                    let link = Link {
                        id: accepted.fetch_add(1, Ordering::SeqCst),
                        upstream,
                        generation,
                    };
                    connections.spawn(serve(client, link, faults.clone(), active.clone()));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Decrements the active-connection count when a connection task ends or is aborted.
struct ActiveGuard(Arc<AtomicUsize>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits until `reset()` has been called since `generation` (or the proxy is gone).
async fn reset_since(mut faults: watch::Receiver<Faults>, generation: u64) {
    let _ = faults.wait_for(|f| f.reset_generation != generation).await;
}

/// Waits until connection `id` is not blackholed; `false` when the proxy is gone.
async fn open(faults: &mut watch::Receiver<Faults>, id: u64) -> bool {
    faults.wait_for(|f| f.open_for(id)).await.is_ok()
}

/// What a connection was given when it was accepted.
#[derive(Clone, Copy)]
struct Link {
    /// Its number, in the order connections were accepted.
    id: u64,
    /// Where it goes.
    upstream: SocketAddr,
    /// The reset generation it was accepted in.
    generation: u64,
}

/// Closes with `RST` instead of `FIN` when the stream is dropped.
#[allow(deprecated)] // `set_linger` is deprecated only because a non-zero linger blocks on drop.
fn abort_on_drop(stream: &TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
}

async fn serve(
    mut client: TcpStream,
    link: Link,
    faults: watch::Receiver<Faults>,
    active: Arc<AtomicUsize>,
) {
    active.fetch_add(1, Ordering::SeqCst);
    let _guard = ActiveGuard(active);
    let Link {
        id,
        upstream,
        generation,
    } = link;
    let mut connect_faults = faults.clone();
    let connect = async {
        if !open(&mut connect_faults, id).await {
            return None;
        }
        TcpStream::connect(upstream).await.ok()
    };
    let server = tokio::select! {
        server = connect => server,
        () = reset_since(faults.clone(), generation) => None,
    };
    let Some(mut server) = server else {
        abort_on_drop(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let clean = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let forward = async {
            tokio::try_join!(
                pump(client_read, server_write, faults.clone(), id),
                pump(server_read, client_write, faults.clone(), id),
            )
            .is_ok()
        };
        tokio::select! {
            clean = forward => clean,
            () = reset_since(faults.clone(), generation) => false,
        }
    };
    if !clean {
        abort_on_drop(&client);
        abort_on_drop(&server);
    }
}

/// Forwards one direction until EOF (then half-closes the writer): `Err` when either side
/// failed, so the whole connection is torn down with a reset.
async fn pump<R, W>(
    mut reader: R,
    mut writer: W,
    faults: watch::Receiver<Faults>,
    id: u64,
) -> Result<(), ()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Reading runs ahead of writing by at most a few chunks, so a delay keeps data in
    // flight (latency, not bandwidth) while memory stays bounded.
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(8);
    let mut read_faults = faults.clone();
    let read_side = async move {
        loop {
            if !open(&mut read_faults, id).await {
                return Err(());
            }
            let mut buf = vec![0u8; CHUNK];
            match reader.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send((Instant::now(), buf)).await.is_err() {
                        return Err(());
                    }
                }
                Err(_) => return Err(()),
            }
        }
    };
    let mut write_faults = faults;
    let write_side = async move {
        while let Some((read_at, chunk)) = rx.recv().await {
            loop {
                if !open(&mut write_faults, id).await {
                    return Err(());
                }
                let due = read_at + write_faults.borrow().delay;
                if Instant::now() >= due {
                    break;
                }
                // Re-check after the sleep or when a control changes (blackhole, new delay).
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    changed = write_faults.changed() => if changed.is_err() { return Err(()) },
                }
            }
            writer.write_all(&chunk).await.map_err(|_| ())?;
        }
        // The reader saw EOF (or failed, and the connection is reset anyway).
        writer.shutdown().await.map_err(|_| ())
    };
    let (read_result, write_result) = tokio::join!(read_side, write_side);
    read_result.and(write_result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::require;

    /// An echo server on 127.0.0.1; the task ends with the test's runtime.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let (mut r, mut w) = sock.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(sock: &mut TcpStream, msg: &[u8], limit: Duration) -> Option<Vec<u8>> {
        sock.write_all(msg).await.ok()?;
        let mut buf = vec![0u8; msg.len()];
        match tokio::time::timeout(limit, sock.read_exact(&mut buf)).await {
            Ok(Ok(_)) => Some(buf),
            _ => None,
        }
    }

    #[tokio::test]
    async fn forwards_blackholes_and_heals() {
        let upstream = echo_server().await;
        let proxy = require(FaultProxy::start(upstream).await);
        assert_ne!(proxy.addr(), upstream);
        assert_eq!(proxy.upstream(), upstream);
        let mut sock = TcpStream::connect(proxy.addr()).await.unwrap();
        let second = Duration::from_secs(1);
        assert_eq!(
            round_trip(&mut sock, b"hello", second).await.as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(proxy.active_connections(), 1);

        proxy.blackhole();
        assert!(proxy.is_blackholed());
        assert_eq!(
            round_trip(&mut sock, b"lost?", Duration::from_millis(300)).await,
            None,
            "no byte may flow while blackholed"
        );
        // A connection made during the blackhole gets nothing either.
        let mut late = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut late, b"late", Duration::from_millis(200)).await,
            None
        );

        proxy.heal();
        // Held-back bytes are delivered after the heal, in order.
        let mut buf = [0u8; 5];
        tokio::time::timeout(second, sock.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"lost?");
        let mut buf = [0u8; 4];
        tokio::time::timeout(second, late.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"late");
        assert_eq!(
            round_trip(&mut sock, b"again", second).await.as_deref(),
            Some(&b"again"[..])
        );
    }

    #[tokio::test]
    async fn delay_adds_latency_each_way() {
        let upstream = echo_server().await;
        let proxy = require(FaultProxy::start(upstream).await);
        let mut sock = TcpStream::connect(proxy.addr()).await.unwrap();
        let limit = Duration::from_secs(5);
        assert!(round_trip(&mut sock, b"warm", limit).await.is_some());

        proxy.delay(Duration::from_millis(300));
        assert_eq!(proxy.current_delay(), Duration::from_millis(300));
        let started = Instant::now();
        assert!(round_trip(&mut sock, b"slow", limit).await.is_some());
        let slow = started.elapsed();
        assert!(
            slow >= Duration::from_millis(600),
            "round trip took {slow:?}"
        );

        proxy.heal();
        let started = Instant::now();
        assert!(round_trip(&mut sock, b"fast", limit).await.is_some());
        let fast = started.elapsed();
        assert!(
            fast < Duration::from_millis(300),
            "round trip took {fast:?}"
        );
    }

    #[tokio::test]
    async fn reset_closes_current_connections_only() {
        let upstream = echo_server().await;
        let proxy = require(FaultProxy::start(upstream).await);
        let mut sock = TcpStream::connect(proxy.addr()).await.unwrap();
        let second = Duration::from_secs(1);
        assert!(round_trip(&mut sock, b"ping", second).await.is_some());

        proxy.reset();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(second, sock.read(&mut buf))
            .await
            .expect("reset must close the connection promptly");
        match read {
            Ok(0) => {}
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
            Ok(n) => panic!("read {n} bytes from a reset connection"),
        }
        // The proxy itself still works for new connections.
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut fresh, b"new", second).await.as_deref(),
            Some(&b"new"[..])
        );
    }

    #[tokio::test]
    async fn blackholing_the_existing_connections_leaves_new_ones_flowing() {
        let upstream = echo_server().await;
        let proxy = require(FaultProxy::start(upstream).await);
        let second = Duration::from_secs(1);
        let mut first = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut second_old = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut first, b"one", second).await.is_some());
        assert!(round_trip(&mut second_old, b"two", second).await.is_some());
        assert_eq!(proxy.accepted(), 2);

        proxy.blackhole_existing();
        assert!(!proxy.is_blackholed(), "only some connections are held");
        for old in [&mut first, &mut second_old] {
            assert_eq!(
                round_trip(old, b"held", Duration::from_millis(200)).await,
                None,
                "an existing connection passes nothing"
            );
        }
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(
            round_trip(&mut fresh, b"new", second).await.as_deref(),
            Some(&b"new"[..]),
            "a connection made afterwards flows"
        );

        // One connection alone, by its number.
        proxy.heal();
        proxy.blackhole_connections(2..3);
        assert_eq!(
            round_trip(&mut fresh, b"held", Duration::from_millis(200)).await,
            None
        );
        let mut buf = [0u8; 4];
        tokio::time::timeout(second, first.read_exact(&mut buf))
            .await
            .expect("the healed connection delivers what it held back")
            .unwrap();
        assert_eq!(&buf, b"held");
    }

    #[tokio::test]
    async fn retarget_sends_new_connections_elsewhere_and_leaves_open_ones() {
        let echo = echo_server().await;
        let proxy = require(FaultProxy::start(echo).await);
        let second = Duration::from_secs(1);
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut old, b"a", second).await.is_some());

        // A listener that only accepts: a connection reaching it is one the proxy sent there.
        let other = TcpListener::bind("127.0.0.1:0").await.unwrap();
        proxy.retarget(other.local_addr().unwrap());
        assert_eq!(proxy.upstream(), other.local_addr().unwrap());
        let _new = TcpStream::connect(proxy.addr()).await.unwrap();
        tokio::time::timeout(second, other.accept())
            .await
            .expect("the connection made after the retarget reaches the new upstream")
            .unwrap();
        assert_eq!(
            round_trip(&mut old, b"still", second).await.as_deref(),
            Some(&b"still"[..]),
            "the open connection stays with the echo server"
        );
    }

    #[tokio::test]
    async fn refused_upstream_and_drop_close_connections() {
        // An upstream port with nothing listening.
        let dead = crate::ports::loopback(require(crate::ports::free_port()));
        let proxy = require(FaultProxy::start(dead).await);
        let mut sock = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(1), sock.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");

        let addr = proxy.addr();
        drop(proxy);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "the listener must be closed on drop"
        );
    }
}
