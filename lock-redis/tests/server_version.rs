//! Connecting to a server older than Redis 5.0 fails with a clear `Config` error naming
//! its version, instead of a client whose every acquire takes a key and then fails.

use std::time::Duration;

use distlock_core::LockError;
use harness::redis::RedisServer;
use lock_redis::RedisBackend;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// A stand-in for an old server: answers `PING`, `INFO` and `SCRIPT LOAD` like Redis
/// 4.0.14 and refuses every other command. Returns its address.
async fn old_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut lines = BufReader::new(read).lines();
                // Requests are RESP arrays of bulk strings: `*n`, then `$len` + text per part.
                while let Ok(Some(header)) = lines.next_line().await {
                    let Some(parts) = header.strip_prefix('*').and_then(|n| n.parse().ok()) else {
                        return;
                    };
                    let mut command = Vec::new();
                    for _ in 0..parts {
                        let _len = lines.next_line().await;
                        command.push(lines.next_line().await.ok().flatten().unwrap_or_default());
                    }
                    let reply = match command.first().map(|c| c.to_ascii_uppercase()).as_deref() {
                        Some("PING") => "+PONG\r\n".to_owned(),
                        Some("INFO") => {
                            let info =
                                "# Server\r\nredis_version:4.0.14\r\nredis_mode:standalone\r\n";
                            format!("${}\r\n{info}\r\n", info.len())
                        }
                        // SCRIPT LOAD: any 40-character digest will do.
                        Some("SCRIPT") => format!("$40\r\n{}\r\n", "0".repeat(40)),
                        _ => "-ERR unknown command\r\n".to_owned(),
                    };
                    if write.write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_older_than_5_0_is_refused_with_its_version() {
    let addr = old_server().await;
    let err = RedisBackend::builder()
        .url(format!("redis://{addr}/"))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect_err("Redis 4 cannot run the lock scripts");
    assert!(
        matches!(&err, LockError::Config(m) if m.contains("4.0.14") && m.contains("5.0")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installed_server_passes_the_version_check() {
    let server = harness::require(RedisServer::start().await);
    RedisBackend::builder()
        .url(server.url())
        .build()
        .await
        .expect("a current Redis is supported");
}
