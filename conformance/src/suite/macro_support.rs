//! Support for [`crate::conformance_tests`]; not a stable API.

use std::future::Future;

use crate::factory::Factory;
use crate::registry::CASES;
use crate::support::{Need, Outcome, missing_needs};

/// A multi-threaded runtime with two workers, like
/// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]`.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("cannot start a tokio runtime: {e}"))
}

/// Runs the case `name` on a fresh runtime and panics with the failure message if it
/// fails. A stamped case the factory cannot run fails too: the invocation declared a
/// capability the factory does not have.
pub fn run_case<F, Fut>(name: &str, make_factory: Fut)
where
    F: Factory,
    Fut: Future<Output = F>,
{
    let Some(case) = CASES.iter().find(|c| c.name == name) else {
        panic!("no conformance case is called `{name}`");
    };
    runtime().block_on(async {
        let factory = make_factory.await;
        match (case.run)(&factory).await {
            Ok(Outcome::Passed) => {}
            Ok(Outcome::Skipped { reason }) => panic!(
                "conformance case `{name}` was stamped for {} but cannot run there ({reason}): \
                 the conformance_tests! invocation declares a capability the factory lacks",
                factory.name()
            ),
            Err(failure) => panic!("{failure}"),
        }
    });
}

/// The stamped test `conformance_stamped_cases`: prints which cases the macro stamped
/// for this factory and which it did not (and why), and fails unless the declared
/// capabilities are exactly what the factory has and the stamped set is exactly the
/// cases whose needs it meets.
pub fn stamped_cases<F, Fut>(make_factory: Fut, declared: &[Need], stamped: &[(&str, bool)])
where
    F: Factory,
    Fut: Future<Output = F>,
{
    stamped_cases_needing(make_factory, declared, None, stamped);
}

/// [`stamped_cases`] for an invocation that stamps, with `only: Some(need)`, only the
/// cases that need `need`.
pub fn stamped_cases_needing<F, Fut>(
    make_factory: Fut,
    declared: &[Need],
    only: Option<Need>,
    stamped: &[(&str, bool)],
) where
    F: Factory,
    Fut: Future<Output = F>,
{
    runtime().block_on(async {
        let factory = make_factory.await;
        let mut errors = Vec::new();
        let mut has = Vec::new();
        for need in Need::ALL {
            let met = need.met_by(&factory).await;
            if met {
                has.push(need);
            }
            // With `only`, a capability none of the selected cases needs is not
            // declared: the invocation stamps nothing that depends on it.
            let relevant = only.is_none_or(|only| {
                CASES
                    .iter()
                    .any(|c| c.needs.contains(&only) && c.needs.contains(&need))
            });
            match (met, declared.contains(&need)) {
                (true, false) if relevant => errors.push(format!(
                    "the factory has `{need}` but the invocation does not declare it, so \
                     the cases that need it are not stamped"
                )),
                (false, true) => errors.push(format!(
                    "the invocation declares `{need}` but the factory does not have it"
                )),
                _ => {}
            }
        }
        let mut not_stamped = Vec::new();
        for case in CASES {
            if only.is_some_and(|need| !case.needs.contains(&need)) {
                let is_stamped = stamped.iter().any(|(n, s)| *n == case.name && *s);
                if is_stamped && errors.is_empty() {
                    errors.push(format!(
                        "`{}` is stamped although it does not need the only capability \
                         asked for",
                        case.name
                    ));
                }
                continue;
            }
            let is_stamped = stamped.iter().any(|(n, s)| *n == case.name && *s);
            let missing = missing_needs(case.needs, &factory).await;
            if !is_stamped {
                let names: Vec<_> = case.needs.iter().map(|n| n.name()).collect();
                not_stamped.push(format!("{} (needs {})", case.name, names.join(", ")));
            }
            if is_stamped != missing.is_empty() && errors.is_empty() {
                errors.push(format!(
                    "`{}` is {}stamped although the factory {} its needs",
                    case.name,
                    if is_stamped { "" } else { "not " },
                    if missing.is_empty() {
                        "meets"
                    } else {
                        "lacks some of"
                    },
                ));
            }
        }
        let count = stamped.iter().filter(|(_, s)| *s).count();
        let caps: Vec<_> = has.iter().map(|n| n.name()).collect();
        let considered = CASES
            .iter()
            .filter(|c| only.is_none_or(|need| c.needs.contains(&need)))
            .count();
        let mut summary = format!(
            "conformance on {}: {count} of {considered} cases{} stamped and run \
             (capabilities: {}; fenced counter on {})",
            factory.name(),
            only.map(|need| format!(" needing {need}"))
                .unwrap_or_default(),
            if caps.is_empty() {
                "none".to_owned()
            } else {
                caps.join(", ")
            },
            if factory.fenced_resource().is_some() {
                "the backend's own fenced resource"
            } else {
                "an in-memory fenced resource"
            },
        );
        for line in &not_stamped {
            summary.push_str(&format!("\n  not stamped: {line}"));
        }
        crate::summary::record("backends", &summary);
        assert_eq!(stamped.len(), CASES.len(), "every case is listed once");
        assert!(
            errors.is_empty(),
            "on {}: {}",
            factory.name(),
            errors.join("; ")
        );
    });
}
