//! The whole conformance suite on the in-memory reference backend, directly and through
//! one more `Arc<dyn LockBackend>` layer (`distlock_core::Instrumented`). Each module's
//! `conformance_stamped_cases` prints how many cases were stamped.

mod direct {
    conformance::conformance_tests!(
        async { conformance::memory::MemoryFactory::new() },
        capabilities: [link_faults, inspect, distinct_clients, wakes_waiters],
    );
}

mod instrumented {
    conformance::conformance_tests!(
        async { conformance::memory::MemoryFactory::instrumented() },
        capabilities: [link_faults, inspect, distinct_clients, wakes_waiters],
    );
}
