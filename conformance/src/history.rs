//! The history of a case run, and the checker for the invariants I1–I6 of the design.
//!
//! Cases talk to the store through a [`RecordingBackend`], which appends one [`Event`]
//! per call (and one per element of a batch call) to a shared [`History`], with the
//! instants the call was invoked and completed on tokio's clock. Writes to the fenced
//! resource go through a [`FencedCounter`], which records them too. [`check`] then reads
//! the events after the fact and reports every [`Violation`] of:
//!
//! - **I1** tokens are unique and strictly increasing in real-time grant order, per key;
//! - **I2** the fenced resource admits tokens in non-decreasing order only, and the
//!   read-modify-write workload under the lock loses no update;
//! - **I3** the client validity windows of different grants never overlap (no-fault runs),
//!   and no grant or renewal claims validity beyond its reply plus the TTL (the history
//!   cannot see the send instant it counts from; a case over a delayed link checks that);
//! - **I4** release or renewal of a lost lease (or of a lease nobody was granted) returns
//!   `NotHeld`/`Lost`, and leaves the holder untouched: a holder's renewals and fence
//!   checks succeed while its validity window lasts;
//! - **I5** renewal extends and keeps the token, and never resurrects an expired lease;
//! - **I6** a semaphore's permits (leases on its slots `<name>:permit:<i>`): at no
//!   instant do more of their validity windows overlap than it has permits (no-fault
//!   runs).
//!
//! The checker only draws conclusions the instants prove: two calls are ordered only
//! when one completed before the other was invoked, and a store-side expiry is bounded
//! from the instants the client saw, never from a guess about the store's clock.
//!
//! One idea per file: [`Event`]s and the [`History`] that keeps them (`event`), the
//! checker (`check`), the [`RecordingBackend`] layer (`record`), and the
//! [`FencedCounter`] (`counter`).

mod check;
mod counter;
mod event;
mod record;

pub use check::{CheckOptions, Invariant, SemaphoreSpec, Violation, check};
pub use counter::FencedCounter;
pub use event::{Event, History, Op, Reply, timeline};
pub use record::RecordingBackend;
