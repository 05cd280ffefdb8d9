//! Benchmarks and the capacity-planning report for distlock.
//!
//! This crate is a placeholder until the benchmark work lands: it will hold the
//! criterion benches per backend, the baselines measured in the same run, and the
//! `capacity` report. It exports nothing yet.
