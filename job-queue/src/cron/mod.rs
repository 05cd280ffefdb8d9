//! Once-only cron on apalis: every instance of a scheduler runs apalis-cron's ticks, and
//! [`distlock::tower::LeaderLayer`] lets only the elected leader of the role run each one,
//! its write admitted by the leadership's fencing token, and
//! [`distlock::tower::TickLayer`] on it runs each tick once whatever the instances' clocks.
//!
//! [`scenario::run`] starts three instances, stops the leader with SIGSTOP past its
//! lease's TTL, resumes it, and counts from the tick table: which instance ran each tick,
//! whether any tick ran twice, and how long the role was without a leader.
//! [`rolling::run`] restarts instances whose clocks disagree one after the other and
//! counts the ticks run twice and the ticks lost.

pub mod instance;
pub mod rolling;
pub mod scenario;
pub mod ticks;
