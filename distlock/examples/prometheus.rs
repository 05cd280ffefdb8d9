//! distlock's metrics on a Prometheus scrape endpoint: the exporter of
//! `metrics-exporter-prometheus` installed as the `metrics` recorder, serving `/metrics`
//! on a loopback port, and a few locks on the in-memory store (some contended, one
//! waited for, one timed out, a stale write, a job handed back, a job whose lease is
//! lost, a skipped tick) so that every series has a value.
//!
//! ```text
//! cargo run -p distlock --no-default-features --features tower --example prometheus
//! cargo run -p distlock --no-default-features --features tower --example prometheus -- 9464
//! curl -s http://127.0.0.1:9464/metrics
//! ```
//!
//! It takes the port from its argument (a free one without), prints the address, takes
//! the locks, and serves until Ctrl-C. It binds 127.0.0.1 only and answers only
//! loopback clients.

#[path = "prometheus/scenario.rs"]
mod scenario;

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let port = match args.as_slice() {
        [] => 0,
        [port] => match port.parse::<u16>() {
            Ok(port) => port,
            Err(_) => return usage(),
        },
        _ => return usage(),
    };
    let address = match scenario::serve(port) {
        Ok(address) => address,
        Err(e) => {
            eprintln!("prometheus: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("serving http://{address}/metrics");
    if let Err(e) = scenario::take_locks().await {
        eprintln!("prometheus: {e}");
        return ExitCode::FAILURE;
    }
    println!("took the locks; scrape http://{address}/metrics, Ctrl-C to stop");
    match tokio::signal::ctrl_c().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prometheus: waiting for Ctrl-C: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!("prometheus: usage: prometheus [PORT]");
    ExitCode::from(2)
}
