//! `lockctl check URL`: the conformance suite against a live store.
//!
//! Every case works under its own random key prefix (`conformance:<random>:<case>:…`)
//! and releases what it takes, so a live deployment is touched only under that prefix.
//! When the cases are done, every key they sent to the store is purged, fencing counters
//! included (see [`crate::used_keys`]), so the store is left as it was found.
//! Cases that need fault injection run where the URL allows it (the in-memory store)
//! and are skipped, by declared capability, elsewhere.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use conformance::memory::MemoryFactory;
use conformance::{CASES, Factory, Outcome};

use crate::used_keys::{Cleanup, RecordingFactory, UsedKeys};
use distlock::backend::async_trait;
use distlock::{LockBackend, LockError};
use serde_json::json;
use tokio::time::Instant;

/// Clients of the store a URL names, each from its own `connect`.
struct UrlFactory {
    url: String,
    shown: String,
    /// The client opened to check the URL; stands in if a later connect fails, so a
    /// store that went away fails the cases that use it rather than the whole run.
    first: Arc<dyn LockBackend>,
}

#[async_trait]
impl Factory for UrlFactory {
    fn name(&self) -> &str {
        &self.shown
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        match distlock::connect(&self.url).await {
            Ok(backend) => backend,
            Err(_) => self.first.clone(),
        }
    }
}

/// Runs the conformance cases whose name contains `filter` against `url`, printing a
/// line per case (or, with `json`, one JSON object at the end); the exit code is 1 if any
/// case failed or the cleanup did.
pub async fn run(url: &str, filter: &str, json: bool) -> Result<ExitCode, LockError> {
    let first = distlock::connect(url).await?;
    let memory = crate::keys::is_memory(url);
    // Every `connect("memory://")` is a separate store, but the cases need clients that
    // share one, as clients of one server do: the suite's memory factory gives that.
    let factory: Box<dyn Factory> = if memory {
        Box::new(MemoryFactory::new())
    } else {
        Box::new(UrlFactory {
            url: url.to_owned(),
            shown: distlock::redact_url(url),
            first,
        })
    };
    run_suite(factory.as_ref(), filter, json, &mut std::io::stdout()).await
}

/// Runs the matching cases on `factory`, writing a line per case to `out` (with `json`,
/// one object once they are done), then purges the keys they used.
async fn run_suite(
    factory: &dyn Factory,
    filter: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<ExitCode, LockError> {
    let print = |out: &mut dyn Write, line: String| {
        // A closed stdout (a pager quit early) must not stop the suite or hide its verdict.
        if !json {
            let _ = writeln!(out, "{line}");
        }
    };
    let mut cases = Vec::new();
    print(out, format!("conformance suite on {}", factory.name()));
    let used = Arc::new(UsedKeys::default());
    let recording = RecordingFactory::new(factory, used.clone());
    let (mut passed, mut failed, mut skipped) = (0u32, 0u32, 0u32);
    for case in CASES.iter().filter(|case| case.name.contains(filter)) {
        let started = Instant::now();
        let result = (case.run)(&recording).await;
        let took = millis(started.elapsed());
        let ms = started.elapsed().as_millis();
        match result {
            Ok(Outcome::Passed) => {
                passed += 1;
                print(out, format!("ok    {} ({took})", case.name));
                cases.push(json!({"case": case.name, "outcome": "passed", "ms": ms}));
            }
            Ok(Outcome::Skipped { reason }) => {
                skipped += 1;
                print(out, format!("skip  {}: {reason}", case.name));
                cases.push(json!({"case": case.name, "outcome": "skipped", "reason": reason}));
            }
            Err(failure) => {
                failed += 1;
                print(out, format!("FAIL  {} ({took})", case.name));
                print(out, format!("        expected: {}", failure.expected));
                print(out, format!("        got:      {}", failure.got));
                cases.push(json!({
                    "case": case.name,
                    "outcome": "failed",
                    "ms": ms,
                    "expected": failure.expected,
                    "got": failure.got,
                }));
            }
        }
    }
    if passed + failed + skipped == 0 {
        return Err(LockError::Config(format!(
            "no conformance case matches the filter {filter:?}"
        )));
    }
    let cleanup = used.purge(factory.backend().await.as_ref()).await;
    let cleanup_json = match &cleanup {
        Cleanup::Purged(n) => json!({"purged": n}),
        Cleanup::Unsupported { left, .. } => {
            json!({"purged": 0, "left": left, "unsupported": true})
        }
        Cleanup::Failed {
            purged,
            left,
            error,
        } => {
            json!({"purged": purged, "left": left, "error": error.to_string()})
        }
    };
    let cleaned = match cleanup {
        Cleanup::Purged(n) => {
            print(
                out,
                format!("\ncleanup: purged the {n} keys the cases used"),
            );
            true
        }
        Cleanup::Unsupported { backend, left } => {
            print(
                out,
                format!(
                    "\ncleanup: the {backend} backend cannot purge keys; {left} keys under \
                     conformance:<random>: prefixes stay (their leases end with their TTL, \
                     their token counters stay)"
                ),
            );
            true
        }
        Cleanup::Failed {
            purged,
            error,
            left,
        } => {
            print(
                out,
                format!(
                    "\ncleanup FAILED: purged {purged} keys, {left} under conformance:<random>: \
                     prefixes stay: {error}"
                ),
            );
            false
        }
    };
    print(
        out,
        format!("{passed} cases passed, {failed} failed, {skipped} skipped"),
    );
    if json {
        let report = json!({
            "store": factory.name(),
            "cases": cases,
            "passed": passed,
            "failed": failed,
            "skipped": skipped,
            "cleanup": cleanup_json,
        });
        let _ = writeln!(out, "{report}");
    }
    Ok(if failed == 0 && cleaned {
        ExitCode::SUCCESS
    } else {
        crate::exit::no()
    })
}

fn millis(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

#[cfg(test)]
mod tests {
    use super::*;
    use conformance::broken::BrokenFactory;

    #[tokio::test]
    async fn a_failing_case_fails_the_check_and_says_why() {
        let mut out = Vec::new();
        let code = run_suite(&BrokenFactory::new(), "", false, &mut out)
            .await
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(code, ExitCode::FAILURE, "{text}");
        assert!(text.contains("FAIL  "), "{text}");
        assert!(text.contains("expected: "), "{text}");
    }

    #[tokio::test]
    async fn the_reference_backend_passes_every_case() {
        let mut out = Vec::new();
        let code = run_suite(&MemoryFactory::new(), "release", false, &mut out)
            .await
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(code, ExitCode::SUCCESS, "{text}");
        assert!(!text.contains("FAIL"), "{text}");
        assert!(text.contains("cleanup: purged the "), "{text}");
    }

    #[tokio::test]
    async fn json_is_one_object_with_every_case_and_the_counts() {
        let mut out = Vec::new();
        let code = run_suite(&BrokenFactory::new(), "", true, &mut out)
            .await
            .unwrap();
        assert_eq!(code, ExitCode::FAILURE);
        let report: serde_json::Value = serde_json::from_slice(&out).expect("one JSON object");
        let cases = report["cases"].as_array().unwrap();
        let count = |outcome: &str| cases.iter().filter(|c| c["outcome"] == outcome).count();
        assert_eq!(report["failed"], count("failed"), "{report}");
        assert_eq!(report["passed"], count("passed"), "{report}");
        assert_eq!(report["skipped"], count("skipped"), "{report}");
        assert!(count("failed") > 0, "{report}");
        let failure = cases.iter().find(|c| c["outcome"] == "failed").unwrap();
        assert!(
            failure["expected"].is_string() && failure["got"].is_string(),
            "{failure}"
        );
    }

    #[tokio::test]
    async fn a_filter_that_matches_nothing_is_an_error() {
        let mut out = Vec::new();
        let err = run_suite(&MemoryFactory::new(), "no-such-case", false, &mut out)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("no-such-case"), "{err}");
    }
}
