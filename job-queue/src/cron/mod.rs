//! Once-only cron on apalis: every instance of a scheduler runs apalis-cron's ticks, and
//! [`distlock::tower::LeaderLayer`] lets only the elected leader of the role run each one,
//! its write admitted by the leadership's fencing token.
//!
//! [`scenario::run`] starts three instances, stops the leader with SIGSTOP past its
//! lease's TTL, resumes it, and counts from the tick table: which instance ran each tick,
//! whether any tick ran twice, and how long the role was without a leader.

pub mod instance;
pub mod scenario;
pub mod ticks;
