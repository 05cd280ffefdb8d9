//! Redis backend for distlock.
//!
//! This crate is a placeholder until the Redis backend lands: it will hold the
//! `RedisBackend` (one-round-trip Lua scripts run with EVALSHA, pipelined batches,
//! Redis Cluster) and the Redis-side `FencedResource`. It exports nothing yet.
