//! The suite's clock case on etcd, whose tokens are the granting client's wall clock when
//! that is above the name's newest token: the clients' clock steps back. The case runs in
//! a child process of this test started under a [`ShiftedClock`] (an `LD_PRELOAD` shim on
//! its wall clock), so the backend reads the stepped clock as any client process would.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use conformance::factory::{ClockFaults, Factory, LinkFaults};
use conformance::suite::macro_support::run_case;
use distlock_core::LockBackend;
use harness::ShiftedClock;

/// [`common::EtcdFactory`] whose clients run under `clock`: this process's.
struct UnderClientClock {
    inner: common::EtcdFactory,
    clock: Arc<ShiftedClock>,
}

#[async_trait]
impl Factory for UnderClientClock {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.inner.backend().await
    }

    fn link(&self) -> Option<Arc<dyn LinkFaults>> {
        self.inner.link()
    }

    fn clock(&self) -> Option<Arc<dyn ClockFaults>> {
        // What the clients read: this process's wall clock.
        let probe: suite_faults::ClockProbe =
            Box::new(|| Box::pin(async { std::time::SystemTime::now() }));
        Some(suite_faults::clock(self.clock.clone(), vec![probe]))
    }
}

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
        UnderClientClock {
            inner: common::EtcdFactory::single().await,
            clock: Arc::new(clock),
        }
    });
}
