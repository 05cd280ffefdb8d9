//! The suite's clock case on etcd, whose tokens are the granting client's wall clock when
//! that is above the name's newest token: the clients' clock steps back. The case runs in
//! a child process of this test started under a [`ShiftedClock`] (an `LD_PRELOAD` shim on
//! its wall clock), so the backend reads the stepped clock as any client process would.

mod common;

use conformance::suite::macro_support::run_case;
use harness::ShiftedClock;

#[test]
fn tokens_keep_rising_across_a_clock_step_of_the_clients() {
    let Some(clock) = ShiftedClock::of_this_process() else {
        // The parent: the case runs in a child under a clock of its own.
        let clock = harness::require(ShiftedClock::new());
        harness::require(harness::rerun_under(
            &clock,
            "tokens_keep_rising_across_a_clock_step_of_the_clients",
        ));
        return;
    };
    run_case("tokens_keep_rising_across_a_clock_step", async {
        common::EtcdFactory::single()
            .await
            .with_client_clock(clock)
            .with_fenced_resource()
            .await
    });
}
