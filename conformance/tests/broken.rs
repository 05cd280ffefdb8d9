//! Proves the suite can fail: every case runs against each broken variant (one bug
//! each) and against the same store without a bug. The control passes every case; each
//! variant fails at least the cases [`conformance::broken::CAUGHT_BY`] names, with the
//! invariants it names in the history check. Run with `--nocapture` to see which cases
//! caught each variant.

use std::collections::BTreeSet;

use conformance::broken::{BrokenFactory, BrokenKind};
use conformance::history::Invariant;
use conformance::{CASES, Factory, Failure, Outcome};
use futures::future::join_all;

/// The name and result of every case, each run on a fresh factory from `make` and all at
/// once (a case's link and server faults reach only its own factory's store).
async fn run_each(
    make: impl Fn() -> BrokenFactory,
) -> Vec<(&'static str, Result<Outcome, Failure>)> {
    let runs = CASES.iter().map(|case| {
        let factory = make();
        tokio::spawn(async move { (case.name, (case.run)(&factory).await) })
    });
    join_all(runs)
        .await
        .into_iter()
        .map(|joined| joined.unwrap_or_else(|e| panic!("a case panicked: {e}")))
        .collect()
}

/// What caught one variant: the failing cases and the invariants their failures name.
struct Caught {
    cases: BTreeSet<&'static str>,
    invariants: BTreeSet<Invariant>,
}

impl Caught {
    fn of(results: &[(&'static str, Result<Outcome, Failure>)]) -> Self {
        let failures = results
            .iter()
            .filter_map(|(name, r)| Some((*name, r.as_ref().err()?)));
        let mut caught = Self {
            cases: BTreeSet::new(),
            invariants: BTreeSet::new(),
        };
        for (name, failure) in failures {
            caught.cases.insert(name);
            caught.invariants.extend(failure.invariants.iter().copied());
        }
        caught
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broken_variant_is_caught() {
    let control = run_each(BrokenFactory::control).await;
    for (name, result) in &control {
        match result {
            Ok(Outcome::Passed) => {}
            Ok(skipped) => panic!("`{name}` did not run on the control: {skipped:?}"),
            Err(failure) => panic!("the control (no bug) must pass every case:\n{failure}"),
        }
    }

    let mut problems = Vec::new();
    let mut summary = String::from("broken variants and the cases that caught them:");
    // One variant at a time: the cases of a variant already run all at once, and their
    // timing must hold on a loaded two-core machine.
    for kind in BrokenKind::ALL {
        let results = run_each(move || BrokenFactory::with_kind(kind)).await;
        let caught = Caught::of(&results);
        let must = kind.caught_by();
        summary += &format!(
            "\n  {kind:?}: {} of {} cases {:?}; invariants {:?}",
            caught.cases.len(),
            results.len(),
            caught.cases,
            caught.invariants,
        );
        if caught.cases.is_empty() {
            problems.push(format!("{kind:?} passes every case"));
        }
        for case in must.cases.iter().filter(|c| !caught.cases.contains(*c)) {
            problems.push(format!("{kind:?} is not caught by `{case}`"));
        }
        for invariant in must
            .invariants
            .iter()
            .filter(|i| !caught.invariants.contains(i))
        {
            problems.push(format!("{kind:?}: no failure names {invariant}"));
        }
        // Each failure names its case and says what was expected.
        for (name, result) in &results {
            if let Err(failure) = result {
                assert_eq!(failure.case, *name);
                let text = failure.to_string();
                assert!(text.contains(name) && text.contains("expected"), "{text}");
            }
        }
    }
    conformance::summary::record("broken-variants", &summary);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_says_what_was_expected_and_what_the_history_shows() {
    let factory = BrokenFactory::with_kind(BrokenKind::ReleaseWithoutOwnerCheck);
    let case = conformance::suite::case("release_by_non_owner_is_not_held").unwrap();
    let failure = (case.run)(&factory).await.unwrap_err();
    assert_eq!(failure.expected, "a release by a non-owner to be NotHeld");
    assert_eq!(failure.invariants, vec![Invariant::I4]);
    let text = failure.to_string();
    assert!(
        text.contains("on broken") && text.contains("got: Released"),
        "{text}"
    );
    assert!(
        text.contains("the history shows") && text.contains("I4: "),
        "{text}"
    );
    assert_eq!(factory.name(), "broken");
}

/// A fenced resource that admits every token, stale ones included.
struct AdmitsAll;

#[async_trait::async_trait]
impl distlock_core::FencedResource for AdmitsAll {
    async fn admit(
        &self,
        _resource: &str,
        _token: distlock_core::FencingToken,
    ) -> Result<distlock_core::Admission, distlock_core::LockError> {
        Ok(distlock_core::Admission::Admitted)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_writes_through_the_factorys_fenced_resource() {
    let factory =
        conformance::factory::WithFencedResource::new(BrokenFactory::control(), AdmitsAll);
    let case = conformance::suite::case("paused_holder_is_fenced").unwrap();
    let failure = (case.run)(&factory).await.unwrap_err();
    assert!(failure.expected.contains("late write"), "{failure}");
    assert_eq!(failure.invariants, vec![Invariant::I2], "{failure}");
}
