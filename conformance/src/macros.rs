//! The macro that stamps one test per case for a backend, and the one list of case
//! names (with what each needs) it and [`crate::CASES`] are both built from.

/// Calls the macro named inside the brackets with `[args] case: [needs], ...`: the single
/// list of every case and what it needs from a factory (see [`crate::suite::Need`]), so
/// the registry and the stamped tests cannot drift apart.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ([$($callback:tt)+] $($args:tt)*) => {
        $($callback)+ ! {
            [$($args)*]
            acquire_excludes_others: [],
            release_frees_the_key: [],
            keys_are_independent: [],
            tokens_increase_across_releases: [],
            tokens_increase_across_expiries: [],
            tokens_increase_across_restarts: [server_faults],
            tokens_keep_rising_across_a_clock_step: [clock_step],
            restart_leaves_old_holder_fenced: [server_faults],
            server_paused_past_ttl_keeps_holders_apart: [server_faults],
            terminated_sessions_leave_old_holder_fenced: [server_faults, session_kill],
            failover_keeps_live_leases: [failover],
            switchover_keeps_live_leases: [failover],
            ttl_expiry_frees_the_key: [],
            release_by_non_owner_is_not_held: [],
            renew_by_non_owner_is_lost: [],
            release_after_expiry_leaves_new_holder: [],
            renew_after_expiry_leaves_new_holder: [],
            second_release_is_not_held: [],
            renew_extends_and_keeps_token: [],
            renew_never_resurrects: [],
            fence_current_while_held: [],
            fence_stale_after_expiry: [],
            fence_stale_after_takeover: [],
            paused_holder_is_fenced: [],
            inspect_reports_holder: [inspect],
            contention_loses_no_update: [],
            watchdog_keeps_long_job_alive: [],
            watchdog_reports_loss_by_valid_until: [link_faults],
            with_lock_aborts_job_on_loss: [],
            guard_release_frees_the_key: [],
            locker_builder_rejects_bad_ttl: [],
            acquire_many_agrees_with_acquire: [],
            renew_many_agrees_with_renew: [],
            release_many_agrees_with_release: [],
            invalid_keys_are_rejected: [],
            invalid_ttls_change_nothing: [],
            foreign_lease_is_refused: [],
            leases_stay_with_their_client: [distinct_clients],
            lost_reply_is_not_a_lease: [link_faults],
            validity_counts_from_the_send_instant: [link_faults],
            dropped_acquire_leaves_no_orphan: [],
            dropped_renew_keeps_the_lease: [],
            dropped_release_frees_the_key_by_its_ttl: [],
            dropped_acquire_many_leaves_no_orphan: [],
            dropped_renew_many_keeps_the_leases: [],
            dropped_release_many_frees_the_keys_by_their_ttl: [],
            dropped_lock_leaves_no_orphan: [],
            dropped_try_lock_leaves_no_orphan: [],
            dropped_with_lock_frees_the_key: [],
            dropped_guard_release_frees_the_key_by_its_ttl: [],
            runtime_shutdown_spares_the_other_runtime: [],
            election_one_leader_at_a_time: [],
            election_hands_over_after_resign: [],
            election_loss_after_pause: [],
            election_tokens_increase_across_leaders: [],
            election_observe_follows_the_leader: [inspect],
            a_release_wakes_a_waiter: [wakes_waiters],
            a_resignation_wakes_a_campaigning_standby: [wakes_waiters],
            a_waiter_whose_wake_is_lost_still_acquires: [wakes_waiters],
            a_cancelled_waiter_leaves_no_subscription: [wakes_waiters],
            semaphore_never_grants_more_than_its_permits: [],
            semaphores_naming_different_permits_share_their_slots: [],
            semaphore_permit_release_is_owner_checked: [],
            semaphore_expired_permit_is_freed: [],
            a_permit_release_wakes_a_waiter: [wakes_waiters],
            a_full_semaphore_keeps_its_permits_across_a_restart: [server_faults],
            dropped_permit_acquire_leaves_no_orphan: [],
            dropped_permit_acquire_mid_wait_leaves_no_permit_held: [],
            timed_out_permit_acquire_leaves_no_permit_held: [],
            semaphore_grants_many_permits_all_or_none: [],
        }
    };
}

/// The [`crate::suite::Need`] a capability name in the case list or the macro stands for.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_need {
    (link_faults) => {
        $crate::suite::Need::LinkFaults
    };
    (server_faults) => {
        $crate::suite::Need::ServerFaults
    };
    (inspect) => {
        $crate::suite::Need::Inspect
    };
    (distinct_clients) => {
        $crate::suite::Need::DistinctClients
    };
    (wakes_waiters) => {
        $crate::suite::Need::WakesWaiters
    };
    (session_kill) => {
        $crate::suite::Need::SessionKill
    };
    (failover) => {
        $crate::suite::Need::Failover
    };
    (clock_step) => {
        $crate::suite::Need::ClockStep
    };
}

/// Stamps one test per conformance case the backend can run, and one test,
/// `conformance_stamped_cases`, that prints how many cases were stamped and which were
/// not (and why).
///
/// The first argument is an expression producing a future whose output implements
/// [`crate::Factory`] (usually an `async` block). It is evaluated afresh in every test,
/// so each test gets its own factory. The optional `capabilities: [...]` list declares
/// what the factory has beyond a store: `link_faults` ([`crate::Factory::link`]),
/// `server_faults` ([`crate::Factory::server`]), `inspect` (the backend implements
/// `inspect`), `distinct_clients` (each `backend()` call is a separate instance),
/// `wakes_waiters` (the backend announces releases to waiters), `session_kill`
/// ([`crate::Factory::sessions`]), `failover` ([`crate::Factory::failover`]), `clock_step`
/// ([`crate::Factory::clock`]). A case
/// is stamped only when every capability it needs is declared, so nothing is skipped at
/// run time; `conformance_stamped_cases` fails if the declaration differs from what the
/// factory has, either way.
///
/// Each test runs on its own multi-threaded tokio runtime with two workers (what
/// `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` would build); a failing
/// case panics with its [`crate::Failure`] message. Only `$crate::` paths are used, so a
/// backend needs nothing but `conformance` as a dev-dependency:
///
/// ```no_run
/// mod suite {
///     conformance::conformance_tests!(
///         async { conformance::memory::MemoryFactory::new() },
///         capabilities: [link_faults, inspect, distinct_clients],
///     );
/// }
/// # fn main() {}
/// ```
///
/// `only_needing: capability` stamps only the cases that need that capability: a second
/// invocation for a factory that has it at a cost the rest of the suite need not pay (a
/// private server per test, for the server-fault cases).
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::conformance_tests!($factory, capabilities: []);
    };
    ($factory:expr, capabilities: [$($capability:ident),* $(,)?] $(,)?) => {
        $crate::__conformance_cases!(
            [$crate::__stamp_conformance_tests] $factory; $($capability),*
        );
    };
    ($factory:expr, capabilities: [$($capability:ident),* $(,)?], only_needing: $only:ident $(,)?) => {
        $crate::__conformance_cases!(
            [$crate::__stamp_conformance_tests] $factory; $($capability),*; only $only
        );
    };
}

/// Stamps the tests for [`conformance_tests`]; not a stable API.
///
/// The declared capabilities become eight flags, `[link_faults server_faults inspect
/// distinct_clients wakes_waiters session_kill failover clock_step]`, each `yes` or `no`; a case is stamped when every need of it finds
/// its flag `yes`.
#[doc(hidden)]
#[macro_export]
macro_rules! __stamp_conformance_tests {
    ([$factory:expr; $($capability:ident),*] $($cases:tt)*) => {
        $crate::__stamp_conformance_tests!(
            @flags [no no no no no no no no] [$($capability),*] [$factory] [$($capability),*] [] $($cases)*
        );
    };
    ([$factory:expr; $($capability:ident),*; only $only:ident] $($cases:tt)*) => {
        $crate::__stamp_conformance_tests!(
            @flags [no no no no no no no no] [$($capability),*] [$factory] [$($capability),*] [$only]
            $($cases)*
        );
    };

    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [link_faults $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [yes $s $i $d $w $k $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [server_faults $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l yes $i $d $w $k $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [inspect $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s yes $d $w $k $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [distinct_clients $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s $i yes $w $k $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [wakes_waiters $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s $i $d yes $k $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [session_kill $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s $i $d $w yes $f $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [failover $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s $i $d $w $k yes $c] [$($more),*] $($rest)*);
    };
    (@flags [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [clock_step $(, $more:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@flags [$l $s $i $d $w $k $f yes] [$($more),*] $($rest)*);
    };
    (@flags $flags:tt [$other:ident $(, $more:ident)*] $($rest:tt)*) => {
        ::std::compile_error!(::std::concat!(
            "unknown conformance capability `", ::std::stringify!($other),
            "`; expected link_faults, server_faults, inspect, distinct_clients, wakes_waiters, session_kill, failover or clock_step"
        ));
    };
    (@flags $flags:tt [] [$factory:expr] [$($capability:ident),*] $only:tt
        $($case:ident: [$($need:ident),*]),* $(,)?) => {
        $(
            $crate::__stamp_conformance_tests!(
                @select $only $flags [$($need)*] $case $factory
            );
        )*

        /// Prints the cases stamped for this backend; fails if the declared capabilities
        /// are not exactly the factory's.
        #[test]
        fn conformance_stamped_cases() {
            $crate::suite::macro_support::stamped_cases_needing(
                $factory,
                &[$($crate::__conformance_need!($capability)),*],
                $crate::__stamp_conformance_tests!(@only_need $only),
                &[$((::std::stringify!($case), $case::STAMPED)),*],
            );
        }
    };

    (@only_need []) => {
        ::std::option::Option::None
    };
    (@only_need [$only:ident]) => {
        ::std::option::Option::Some($crate::__conformance_need!($only))
    };

    // Every case, or (with `only_needing`) only a case that needs that capability.
    (@select [] $flags:tt $needs:tt $case:ident $factory:expr) => {
        $crate::__stamp_conformance_tests!(@case $flags $needs $case $factory);
    };
    (@select [$only:ident] $flags:tt $needs:tt $case:ident $factory:expr) => {
        $crate::__stamp_conformance_tests!(@only $only $needs $flags $needs $case $factory);
    };
    (@only link_faults [link_faults $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only server_faults [server_faults $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only inspect [inspect $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only distinct_clients [distinct_clients $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only wakes_waiters [wakes_waiters $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only session_kill [session_kill $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only failover [failover $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only clock_step [clock_step $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case $($rest)*);
    };
    (@only $only:ident [$other:ident $($x:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@only $only [$($x)*] $($rest)*);
    };
    (@only $only:ident [] $flags:tt $needs:tt $case:ident $factory:expr) => {
        #[doc(hidden)]
        mod $case {
            pub const STAMPED: bool = false;
        }
    };

    // A need whose flag is `yes`: check the next one.
    (@case [yes $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [link_faults $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [yes $s $i $d $w $k $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt yes $i:tt $d:tt $w:tt $k:tt $f:tt $c:tt] [server_faults $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l yes $i $d $w $k $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt yes $d:tt $w:tt $k:tt $f:tt $c:tt] [inspect $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s yes $d $w $k $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt $i:tt yes $w:tt $k:tt $f:tt $c:tt] [distinct_clients $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s $i yes $w $k $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt $i:tt $d:tt yes $k:tt $f:tt $c:tt] [wakes_waiters $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s $i $d yes $k $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt $i:tt $d:tt $w:tt yes $f:tt $c:tt] [session_kill $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s $i $d $w yes $f $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt yes $c:tt] [failover $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s $i $d $w $k yes $c] [$($need)*] $($rest)*);
    };
    (@case [$l:tt $s:tt $i:tt $d:tt $w:tt $k:tt $f:tt yes] [clock_step $($need:ident)*] $($rest:tt)*) => {
        $crate::__stamp_conformance_tests!(@case [$l $s $i $d $w $k $f yes] [$($need)*] $($rest)*);
    };
    // Every need met: the test.
    (@case $flags:tt [] $case:ident $factory:expr) => {
        #[test]
        fn $case() {
            $crate::suite::macro_support::run_case(::std::stringify!($case), $factory);
        }

        #[doc(hidden)]
        mod $case {
            pub const STAMPED: bool = true;
        }
    };
    // A need whose flag is `no`: no test.
    (@case $flags:tt [$need:ident $($more:ident)*] $case:ident $factory:expr) => {
        #[doc(hidden)]
        mod $case {
            pub const STAMPED: bool = false;
        }
    };
}
