//! etcd v3 backend for distlock.
//!
//! This crate is a placeholder until the etcd backend lands: it will hold the
//! `EtcdBackend` (leases and transactions, the key's `create_revision` as the fencing
//! token) and the etcd-side `FencedResource`. It exports nothing yet.
