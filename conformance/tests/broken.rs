//! Proves the suite can fail: every case runs against each broken variant (one bug
//! each) and against the same store without a bug. The control passes every case; each
//! variant fails at least the cases [`conformance::broken::CAUGHT_BY`] names, with the
//! invariants it names in the history check. Run with `--nocapture` to see which cases
//! caught each variant.

use conformance::broken::{BrokenFactory, BrokenKind, Caught, run_each};
use conformance::history::Invariant;
use conformance::{Factory, Outcome};

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
        summary += &format!("\n  {kind:?}: {caught}");
        problems.extend(
            caught
                .lacks(must.cases, must.invariants)
                .into_iter()
                .map(|lack| format!("{kind:?}: {lack}")),
        );
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

/// A fenced resource that admits every token, stale ones included, and stores every
/// value.
#[derive(Default)]
struct AdmitsAll(parking_lot::Mutex<std::collections::HashMap<String, Vec<u8>>>);

#[async_trait::async_trait]
impl distlock_core::FencedResource for AdmitsAll {
    async fn write(
        &self,
        resource: &str,
        _token: distlock_core::FencingToken,
        value: &[u8],
    ) -> Result<distlock_core::Admission, distlock_core::LockError> {
        self.0.lock().insert(resource.to_owned(), value.to_vec());
        Ok(distlock_core::Admission::Admitted)
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, distlock_core::LockError> {
        Ok(self.0.lock().get(resource).cloned())
    }

    async fn check_only(
        &self,
        _resource: &str,
        _token: distlock_core::FencingToken,
    ) -> Result<distlock_core::Admission, distlock_core::LockError> {
        Ok(distlock_core::Admission::Admitted)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_writes_through_the_factorys_fenced_resource() {
    let factory = conformance::factory::WithFencedResource::new(
        BrokenFactory::control(),
        AdmitsAll::default(),
    );
    let case = conformance::suite::case("paused_holder_is_fenced").unwrap();
    let failure = (case.run)(&factory).await.unwrap_err();
    assert!(failure.expected.contains("late write"), "{failure}");
    assert_eq!(failure.invariants, vec![Invariant::I2], "{failure}");
}

/// A fenced resource that judges tokens right but stores every value, a refused one too:
/// a check and a write that are not one step.
#[derive(Default)]
struct StoresRefusedWrites {
    fence: distlock_core::MemoryFencedResource,
    values: parking_lot::Mutex<std::collections::HashMap<String, Vec<u8>>>,
}

#[async_trait::async_trait]
impl distlock_core::FencedResource for StoresRefusedWrites {
    async fn write(
        &self,
        resource: &str,
        token: distlock_core::FencingToken,
        value: &[u8],
    ) -> Result<distlock_core::Admission, distlock_core::LockError> {
        let admission = self.fence.check_only_now(resource, token);
        self.values
            .lock()
            .insert(resource.to_owned(), value.to_vec());
        Ok(admission)
    }

    async fn read(&self, resource: &str) -> Result<Option<Vec<u8>>, distlock_core::LockError> {
        Ok(self.values.lock().get(resource).cloned())
    }

    async fn check_only(
        &self,
        resource: &str,
        token: distlock_core::FencingToken,
    ) -> Result<distlock_core::Admission, distlock_core::LockError> {
        Ok(self.fence.check_only_now(resource, token))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workload_sees_a_refused_write_the_resource_stored() {
    let factory = conformance::factory::WithFencedResource::new(
        BrokenFactory::control(),
        StoresRefusedWrites::default(),
    );
    let case = conformance::suite::case("paused_holder_is_fenced").unwrap();
    let failure = (case.run)(&factory).await.unwrap_err();
    assert!(
        failure
            .expected
            .contains("the counter to hold the new holder's value 2"),
        "{failure}"
    );
}
