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

impl Target {
    /// A target on a ratio: `value` at least (`at_least`) or at most `goal`, or not
    /// measured in this run when `value` is `None`.
    pub fn ratio(what: &str, goal: f64, at_least: bool, value: Option<f64>) -> Target {
        let goal_text = format!("{} {goal:.2}x", if at_least { ">=" } else { "<=" });
        match value {
            Some(v) => Target {
                what: what.to_owned(),
                goal: goal_text,
                measured: format!("{v:.3}x"),
                met: Some(if at_least { v >= goal } else { v <= goal }),
            },
            None => Target {
                what: what.to_owned(),
                goal: goal_text,
                measured: "not measured in this run".into(),
                met: None,
            },
        }
    }
}
