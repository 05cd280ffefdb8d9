//! One target of the capacity report: what is compared, the goal, the value measured
//! and whether this run met it.

/// One target of the issue, judged on this run.
#[derive(Clone, Debug)]
pub struct Target {
    /// What is compared, e.g. `Redis acquire p50 / raw SET NX PX p50 (1 task)`.
    pub what: String,
    /// The goal, e.g. `<= 1.15`.
    pub goal: String,
    /// The measured value, formatted, or why it was not measured.
    pub measured: String,
    /// Met, missed, or not measured in this run.
    pub met: Option<bool>,
}
