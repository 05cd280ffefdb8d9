//! distlock: distributed locks with fencing tokens for background-job workers.
//!
//! For now this facade re-exports `lock-api` (the trait, `Locker`, guards, fencing and
//! the in-memory backend). The store backends and `connect(url)` join it behind cargo
//! features as they land.

pub use lock_api::*;
