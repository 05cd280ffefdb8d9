//! A distlock backend over a store of its own, built the way a backend in another
//! repository would be: it depends on the published `distlock` crate only (the
//! `LockBackend` trait and what `distlock::backend` gives implementers), and its tests run
//! distlock's conformance suite on it with the public `conformance_tests!` macro.
//!
//! # The store
//!
//! [`TableStore`] keeps every key in one table behind one lock, in this process. A key's
//! row holds the newest token granted for it and, while someone holds the key, the
//! holder: a random owner id, the token, and the millisecond at which the lease runs out.
//! The store has a clock of its own, whole milliseconds since it began, read under the
//! lock, so calls see time move forward in the order they reach the table. Each
//! [`TableClient`] is one client of the store, with a backend id of its own.
//!
//! How it meets the [`LockBackend`](distlock::LockBackend) contract:
//!
//! - **Input.** A TTL outside 3 ms to one day, or not in whole milliseconds, is refused
//!   by [`Capabilities::check_ttl`](distlock::Capabilities::check_ttl) before the store
//!   is touched; a lease of another client is refused by its backend id.
//! - **Mutual exclusion and bounded ownership.** A grant needs a row without a live
//!   holder; a holder is live while the clock is before its deadline, so a lease that
//!   ran out frees the key with no sweeper (the next call finds it gone).
//! - **Fencing.** The row's counter grows by one per grant and stays when the holder
//!   releases or expires; only [`purge`](distlock::LockBackend::purge) removes it. The
//!   store keeps nothing across a restart of the process, and claims nothing about one.
//! - **Owner-checked release, renewal, fence.** Each compares the owner id and token
//!   with the live holder's; renewal moves the deadline of a live holder only, so an
//!   expired lease never comes back.
//! - **Validity.** Leases and renewals count `valid_until` from the instant before the
//!   store was asked. The store's deadline, counted from its clock reading (which may be
//!   up to a millisecond behind), is still later: `valid_until` keeps 1% of the TTL and
//!   2 ms in reserve.
//! - **Unknown outcomes.** There is no link to lose a reply on, and nothing inside a call
//!   awaits: a call does all of its work at its first poll, so a dropped call did either
//!   nothing or everything.
//! - **Batches.** The trait's default forms, one call per item.
//!
//! Beyond the contract it implements [`inspect`](distlock::LockBackend::inspect),
//! [`adopt`](distlock::LockBackend::adopt) and wakes waiters: a release wakes a waiter
//! of that key on any client through one [`ReleaseHub`](distlock::backend::wake::ReleaseHub);
//! a lease that runs out is not announced, and waiters find it by their backoff.
//!
//! # Tested
//!
//! `tests/conformance.rs` stamps the whole suite with the capabilities the store has
//! (`inspect`, `distinct_clients`, `wakes_waiters`); the cases that need link or server
//! faults, session kills or fail-over are not stamped, and its
//! `conformance_stamped_cases` test says which. `tests/broken.rs` runs the suite on a
//! client with one bug, a release that frees a key held by someone else, and checks that
//! the cases the suite names for that bug fail on it while the store without the bug
//! passes them.

mod client;
mod store;
mod table;

pub use client::TableClient;
pub use store::TableStore;
