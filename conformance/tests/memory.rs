//! The whole conformance suite on the in-memory reference backend, directly and through
//! one more `Arc<dyn LockBackend>` layer (`lock_api::Instrumented`).

mod direct {
    conformance::conformance_tests!(async { conformance::memory::MemoryFactory::new() });
}

mod instrumented {
    conformance::conformance_tests!(async { conformance::memory::MemoryFactory::instrumented() });
}
