//! The macro stamps a case only where the factory is declared to have what it needs, and
//! the stamped `conformance_stamped_cases` test fails when a declaration is wrong.

use conformance::CASES;
use conformance::memory::MemoryFactory;
use conformance::suite::macro_support::{run_case, stamped_cases};

/// The bug-free control store has every capability, so every case is stamped for it.
mod control {
    conformance::conformance_tests!(
        async { conformance::broken::BrokenFactory::control() },
        capabilities: [
            link_faults, server_faults, inspect, distinct_clients, wakes_waiters, session_kill,
            failover, clock_step,
        ],
    );
}

/// `only_needing` stamps the cases that need server faults and no other.
mod server_faults_only {
    conformance::conformance_tests!(
        async { conformance::broken::BrokenFactory::control() },
        capabilities: [link_faults, server_faults, inspect, distinct_clients, session_kill],
        only_needing: server_faults,
    );

    #[test]
    fn only_the_cases_needing_server_faults_are_stamped() {
        let stamped = [
            restart_leaves_old_holder_fenced::STAMPED,
            acquire_excludes_others::STAMPED,
            watchdog_reports_loss_by_valid_until::STAMPED,
        ];
        assert_eq!(stamped, [true, false, false]);
    }
}

/// What the macro stamps for a factory declared with no capabilities.
fn stamped_without_capabilities() -> Vec<(&'static str, bool)> {
    CASES.iter().map(|c| (c.name, c.needs.is_empty())).collect()
}

#[test]
#[should_panic(expected = "the factory has `link_faults` but the invocation does not declare it")]
fn an_undeclared_capability_fails_the_stamped_count() {
    stamped_cases(
        async { MemoryFactory::new() },
        &[],
        &stamped_without_capabilities(),
    );
}

#[test]
#[should_panic(
    expected = "the invocation declares `server_faults` but the factory does not have it"
)]
fn a_declared_capability_the_factory_lacks_fails_the_stamped_count() {
    let stamped: Vec<_> = CASES.iter().map(|c| (c.name, true)).collect();
    stamped_cases(
        async { MemoryFactory::new() },
        &conformance::suite::Need::ALL,
        &stamped,
    );
}

#[test]
#[should_panic(expected = "was stamped for memory but cannot run there")]
fn a_stamped_case_the_factory_cannot_run_fails() {
    run_case("tokens_increase_across_restarts", async {
        MemoryFactory::new()
    });
}
