#![doc = include_str!("../README.md")]

mod backend;
pub mod chore;
mod claim;
mod election;
mod env;
mod error;
mod failure;
mod faults;
mod fencing;
mod guard;
mod instrumented;
mod key;
mod layer;
mod lease;
mod locker;
pub mod memory;
mod redact;
mod semaphore;
pub mod telemetry;
mod waiting;
pub mod wake;
mod watchdog;

pub use backend::LockBackend;
pub use claim::Claim;
pub use election::{ELECTION_PREFIX, Election, ElectionBuilder, Leader, Leadership, election_key};
pub use env::{builder_from_env, url_from_env};
pub use error::{BoxError, LockError};
pub use failure::{DriverFailure, Effect, FailureKind};
pub use fencing::{Admission, EnforcementMode, FencedResource, MemoryFencedResource, decide};
pub use guard::{LeaseStatus, LockGuard};
pub use instrumented::Instrumented;
pub use key::{FencingToken, LockKey, MAX_KEY_BYTES, OwnerId};
pub use layer::{BackendLayer, Layered};
pub use lease::{
    BackendId, Capabilities, DRIFT_FACTOR, Fence, Lease, LockInfo, Release, Renewal,
    VALIDITY_MARGIN, trusted_for, valid_until,
};
pub use locker::{Locker, LockerBuilder, RetryPolicy};
pub use redact::{redact_url, url_userinfo_is_ambiguous};
pub use semaphore::{MAX_PERMITS, Permit, Permits, Semaphore};

/// Re-exported so backends implement [`LockBackend`] with the same macro version.
pub use async_trait::async_trait;
