//! Proves the suite can fail: every case runs against a deliberately broken backend (no
//! owner check on release, a constant token), and the cases that guard those rules must
//! fail on it while passing on the reference backend.

use conformance::broken::BrokenFactory;
use conformance::memory::MemoryFactory;
use conformance::{CASES, Factory, Failure, Outcome};
use futures::future::join_all;

/// The cases that must catch the broken backend, and a phrase of what each expected:
/// they must fail for the rule they guard, not by accident.
const MUST_FAIL: &[(&str, &str)] = &[
    (
        "release_by_non_owner_is_not_held",
        "non-owner to be NotHeld",
    ),
    ("release_after_expiry_leaves_new_holder", "to be NotHeld"),
    ("tokens_increase_across_releases", "a token above"),
    ("tokens_increase_across_expiries", "a token above"),
    ("paused_holder_is_fenced", "late write"),
    ("fence_stale_after_takeover", "Stale"),
    ("contention_loses_no_update", "I1-I5"),
];

/// Runs every case, each on a fresh factory from `make`, all at once (each case uses its
/// own keys); returns the name and result of each.
async fn run_each<F: Factory>(make: fn() -> F) -> Vec<(&'static str, Result<Outcome, Failure>)> {
    join_all(CASES.iter().map(|case| async move {
        let factory = make();
        (case.name, (case.run)(&factory).await)
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_fails_on_a_broken_backend() {
    let results = run_each(BrokenFactory::new).await;
    let failed: Vec<&str> = results
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|(name, _)| *name)
        .collect();
    for (name, expected) in MUST_FAIL {
        let failure = results
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, r)| r.as_ref().err())
            .unwrap_or_else(|| {
                panic!("case `{name}` should fail on the broken backend; failed: {failed:?}")
            });
        assert!(
            failure.expected.contains(expected),
            "case `{name}` failed for another reason than expected ({expected:?}): {failure}"
        );
    }
    // Each failure names its case and says what was expected.
    for (name, result) in &results {
        if let Err(failure) = result {
            println!("{failure}\n");
            assert_eq!(failure.case, *name);
            let text = failure.to_string();
            assert!(text.contains(name) && text.contains("expected"), "{text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_cases_pass_on_the_reference_backend() {
    let results = run_each(MemoryFactory::new).await;
    for (name, _) in MUST_FAIL {
        let (_, result) = results
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no case `{name}`"));
        if let Err(failure) = result {
            panic!("{failure}");
        }
        assert_eq!(result.as_ref().ok(), Some(&Outcome::Passed), "{name}");
    }
}
