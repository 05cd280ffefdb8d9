#![doc = include_str!("../README.md")]

// The user API: `Locker` and what is built on it.
mod locker;
// The backend interface: the trait, what it deals in, and what backends share.
mod backend;
// Middleware around a backend.
mod layer;
// The reference store.
pub mod memory;

mod error;
mod fencing;
mod key;
pub mod telemetry;

pub use backend::env::{builder_from_env, url_from_env};
pub use backend::failure::{DriverFailure, Effect, FailureKind};
pub use backend::lease::{
    BackendId, Capabilities, DRIFT_FACTOR, Fence, Lease, LockInfo, Release, Renewal,
    VALIDITY_MARGIN, trusted_for, valid_until,
};
pub use backend::redact::{redact_url, url_userinfo_is_ambiguous};
pub use backend::{LockBackend, acquire_each, acquire_first_free};
pub use backend::{chore, wake};
pub use error::{BoxError, LockError};
pub use fencing::{
    Admission, EnforcementMode, FencedResource, FencedResourceExt, MemoryFencedResource,
    WriteFence, decide,
};
pub use key::{FencingToken, LockKey, MAX_KEY_BYTES, OwnerId};
pub use layer::instrumented::Instrumented;
pub use layer::{BackendLayer, Layered};
pub use locker::claim::{Claim, QUEUE_KEY_PREFIX};
pub use locker::election::{
    ELECTION_PREFIX, Election, ElectionBuilder, Leader, Leadership, election_key,
};
pub use locker::guard::{LeaseStatus, LockGuard};
/// The slot a semaphore's attempt asks for first on a backend (for benchmarks that take
/// permits as [`Semaphore`] does).
#[doc(hidden)]
pub use locker::semaphore::first_asked as permit_first_asked;
pub use locker::semaphore::{MAX_PERMITS, Permit, Permits, Semaphore};
pub use locker::{Locker, LockerBuilder, RetryPolicy};

/// Re-exported so backends implement [`LockBackend`] with the same macro version.
pub use async_trait::async_trait;
