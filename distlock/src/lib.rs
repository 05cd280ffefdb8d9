//! distlock: distributed locks with fencing tokens for background-job workers.
//!
//! This facade re-exports the lock API (the [`LockBackend`] trait, [`Locker`] and
//! [`LockGuard`], fencing, the in-memory backend) and opens a backend from a URL with
//! [`connect`]. Each store sits behind a cargo feature:
//!
//! | feature | default | URL schemes |
//! |---|---|---|
//! | (none) | always | `memory://` |
//! | `redis` | yes | `redis://`, `rediss://`, `redis+cluster://` |
//! | `etcd` | no | `etcd://` |
//! | `postgres` | no | `postgres://`, `postgresql://` |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::LockError> {
//! use std::time::Duration;
//! use distlock::{LockKey, Locker};
//!
//! let backend = distlock::connect("memory://").await?;
//! let locker = Locker::builder(backend).ttl(Duration::from_secs(5)).build()?;
//! let guard = locker.lock(&LockKey::new("job:42")?).await?;
//! assert!(guard.is_held());
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod connect;

pub use connect::{SCHEMES, Scheme, connect, redact};
pub use lock_api::*;
