//! The macro that stamps one test per case for a backend, and the one list of case
//! names it and [`crate::CASES`] are both built from.

/// Calls the macro named inside the brackets with `[args] case, case, ...`: the single
/// list of every case, so the registry and the stamped tests cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+ ! {
            [$($args)*]
            acquire_excludes_others,
            release_frees_the_key,
            keys_are_independent,
            tokens_increase_across_releases,
            tokens_increase_across_expiries,
            ttl_expiry_frees_the_key,
            release_by_non_owner_is_not_held,
            renew_by_non_owner_is_lost,
            release_after_expiry_leaves_new_holder,
            renew_after_expiry_leaves_new_holder,
            second_release_is_not_held,
            renew_extends_and_keeps_token,
            renew_never_resurrects,
            fence_current_while_held,
            fence_stale_after_expiry,
            fence_stale_after_takeover,
            paused_holder_is_fenced,
            inspect_reports_holder,
            contention_loses_no_update,
            watchdog_keeps_long_job_alive,
            watchdog_reports_loss_by_valid_until,
            with_lock_aborts_job_on_loss,
            guard_release_frees_the_key,
            locker_builder_rejects_bad_ttl,
            acquire_many_agrees_with_acquire,
            renew_many_agrees_with_renew,
            release_many_agrees_with_release,
            invalid_keys_are_rejected,
            invalid_ttls_change_nothing,
            foreign_lease_is_refused,
            lost_reply_is_not_a_lease,
            validity_counts_from_the_send_instant,
        }
    };
}

/// Stamps one test per conformance case for a backend.
///
/// The argument is an expression producing a future whose output implements
/// [`crate::Factory`] (usually an `async` block). It is evaluated afresh in every test,
/// so each test gets its own factory. Each test runs on its own multi-threaded tokio
/// runtime with two workers (what `#[tokio::test(flavor = "multi_thread",
/// worker_threads = 2)]` would build); a failing case panics with its [`crate::Failure`]
/// message, a skipped one prints why. Only `$crate::` paths are used, so a backend needs
/// nothing but `conformance` as a dev-dependency:
///
/// ```no_run
/// mod suite {
///     conformance::conformance_tests!(async { conformance::memory::MemoryFactory::new() });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::__conformance_cases!([$crate::__stamp_conformance_tests] $factory);
    };
}

/// Stamps the tests for [`conformance_tests`]; not a stable API.
#[doc(hidden)]
#[macro_export]
macro_rules! __stamp_conformance_tests {
    ([$factory:expr] $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::suite::macro_support::run_case(::std::stringify!($case), $factory);
            }
        )*
    };
}
