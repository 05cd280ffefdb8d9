//! The `prometheus` example's endpoint, scraped over HTTP after its locks: every series
//! the README's "Metrics" section lists is there with the labels it lists, and the README
//! lists every metric name the crates define.

#[path = "../examples/prometheus/scenario.rs"]
mod scenario;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use distlock::telemetry;
use distlock::tower::{JOB_LOCK_MISSES_TOTAL, JOB_LOST_TOTAL, TICKS_SKIPPED_TOTAL};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const README: &str = include_str!("../../README.md");

/// Label sets: for each series name, the label names of each of its samples.
type Series = BTreeMap<String, BTreeSet<Vec<String>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_the_readme_lists_is_scraped_from_metrics() {
    let address = scenario::serve(0).unwrap();
    assert!(address.ip().is_loopback(), "{address}");
    scenario::take_locks().await.unwrap();
    let body = scrape(address).await;

    let scraped = scraped_series(&body);
    let listed = readme_series();
    for (name, labels) in &listed {
        let found = scraped
            .get(name)
            .unwrap_or_else(|| panic!("README lists {name}, /metrics has no such series:\n{body}"));
        assert!(
            found.contains(labels),
            "README lists {name} with labels {labels:?}, /metrics has {found:?}"
        );
    }
    for name in [
        telemetry::ACQUIRE_TOTAL,
        telemetry::ACQUIRE_SECONDS,
        telemetry::WAIT_SECONDS,
        telemetry::HELD_SECONDS,
        telemetry::HELD,
        telemetry::RENEW_TOTAL,
        telemetry::LOST_TOTAL,
        telemetry::FENCE_REJECTED_TOTAL,
        JOB_LOCK_MISSES_TOTAL,
        JOB_LOST_TOTAL,
        TICKS_SKIPPED_TOTAL,
    ] {
        assert!(
            listed.iter().any(|(listed, _)| listed == name),
            "README's Metrics section does not list {name}: {listed:?}"
        );
    }
    // The waited lock and the contended attempts have values, not only names.
    assert!(
        sample(&body, "distlock_wait_seconds_count", "outcome=\"acquired\"") >= 1.0,
        "{body}"
    );
    assert!(
        sample(
            &body,
            "distlock_wait_seconds_count",
            "outcome=\"timed_out\""
        ) >= 1.0,
        "{body}"
    );
    assert!(
        sample(&body, "distlock_acquire_total", "outcome=\"contended\"") >= 2.0,
        "{body}"
    );
}

/// `GET /metrics` over a plain TCP connection; the body of a `200 OK`.
async fn scrape(address: SocketAddr) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    body.to_owned()
}

/// The series of a Prometheus text exposition: each sample's family name (without the
/// `_bucket`, `_sum`, `_count` of a histogram or summary) with its label names (without
/// their `le` or `quantile`).
fn scraped_series(body: &str) -> Series {
    let families: BTreeSet<&str> = body
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    let mut series = Series::new();
    for line in body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .find(|base| families.contains(base) && !families.contains(name))
            .unwrap_or(name);
        let mut labels: Vec<String> = match line[name_end..].strip_prefix('{') {
            Some(rest) => label_names(rest),
            None => Vec::new(),
        };
        labels.retain(|l| l != "le" && l != "quantile");
        labels.sort();
        series.entry(family.to_owned()).or_default().insert(labels);
    }
    series
}

/// The label names of `a="x",b="y"}…`, quoted values skipped with their escapes.
fn label_names(mut rest: &str) -> Vec<String> {
    let mut names = Vec::new();
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').to_owned());
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
        if rest.starts_with('}') {
            break;
        }
    }
    names
}

/// The value of the first sample of `name` whose labels contain `label`; 0 if none.
fn sample(body: &str, name: &str, label: &str) -> f64 {
    body.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The series the README's "## Metrics" section lists, as `` `name{label,label}` `` (or
/// `` `name` `` for none) in its text, label names sorted. Code blocks are skipped.
fn readme_series() -> Vec<(String, Vec<String>)> {
    let section = README
        .split_once("\n## Metrics\n")
        .expect("README has a Metrics section")
        .1;
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut text = String::new();
    let mut in_block = false;
    for line in section.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
        } else if !in_block {
            text.push_str(line);
            text.push('\n');
        }
    }
    // Inline code may wrap across lines, so the text is split as a whole.
    let listed: Vec<_> = text
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(declared_series)
        .collect();
    assert!(!listed.is_empty(), "no series in README's Metrics section");
    listed
}

/// `distlock_name{a,b}` or `distlock_name` as a name and its sorted label names; `None`
/// for other inline code (a selector with values, a span name).
fn declared_series(code: &str) -> Option<(String, Vec<String>)> {
    let is_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_');
    let (name, labels) = match code.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (code, ""),
    };
    if !name.starts_with("distlock_") || !is_name(name) {
        return None;
    }
    let mut labels: Vec<String> = labels
        .split(',')
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if !labels.iter().all(|l| is_name(l)) {
        return None;
    }
    labels.sort();
    Some((name.to_owned(), labels))
}
