//! One target of the capacity report: what is compared, the goal, the value measured,
//! whether this run met it, and, for a target the profiles show can be missed, why.

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
    /// How far a missed target fell short of its goal, as a fraction of the goal
    /// (0.25: a quarter short); `None` when met or not measured.
    pub short_by: Option<f64>,
    /// What the measurements behind the design found the cost to come from, for a target
    /// that can be missed: the report prints it under the table when this run missed it.
    pub why: Option<&'static str>,
}

impl Target {
    /// A target on a ratio: `value` at least (`at_least`) or at most `goal`, or not
    /// measured in this run when `value` is `None`.
    pub fn ratio(what: &str, goal: f64, at_least: bool, value: Option<f64>) -> Target {
        let goal_text = format!("{} {goal:.2}x", if at_least { ">=" } else { "<=" });
        Target::judged(what, goal_text, goal, at_least, value, |v| {
            format!("{v:.3}x")
        })
    }

    /// A target on `value` (printed by `show`): at least (`at_least`) or at most `goal`,
    /// written `goal_text`; not measured in this run when `value` is `None`.
    pub fn judged(
        what: &str,
        goal_text: String,
        goal: f64,
        at_least: bool,
        value: Option<f64>,
        show: impl Fn(f64) -> String,
    ) -> Target {
        let met = value.map(|v| if at_least { v >= goal } else { v <= goal });
        let short_by = value.zip(met).and_then(|(v, met)| {
            let short = if at_least {
                1.0 - v / goal
            } else {
                v / goal - 1.0
            };
            (!met && goal > 0.0).then_some(short)
        });
        Target {
            what: what.to_owned(),
            goal: goal_text,
            measured: value.map_or_else(|| "not measured in this run".into(), show),
            met,
            short_by,
            why: None,
        }
    }

    /// The same target, with why it is not measured when it is not (a reason of this run,
    /// in place of "not measured in this run").
    pub fn unmeasured_because(mut self, reason: String) -> Target {
        if self.met.is_none() {
            self.measured = reason;
        }
        self
    }

    /// The same target, with what the profiles found a miss of it to come from (`None`:
    /// nothing found).
    pub fn because(mut self, why: impl Into<Option<&'static str>>) -> Target {
        self.why = why.into();
        self
    }
}

/// The targets of `targets` this run missed, each with how far short of its goal it fell,
/// under why (misses of one cause together, in the order of their first), as a markdown
/// list under a heading; empty when none was missed. Misses with no cause recorded are
/// listed last, as such.
pub fn misses_markdown(targets: &[Target]) -> String {
    let mut causes: Vec<(Option<&str>, Vec<&Target>)> = Vec::new();
    for t in targets.iter().filter(|t| t.met == Some(false)) {
        match causes.iter_mut().find(|(why, _)| *why == t.why) {
            Some((_, missed)) => missed.push(t),
            None => causes.push((t.why, vec![t])),
        }
    }
    if causes.is_empty() {
        return String::new();
    }
    causes.sort_by_key(|(why, _)| why.is_none());
    let mut md = String::from("\n### Missed: by how much, and why\n\n");
    for (why, missed) in causes {
        let why = why.unwrap_or(
            "No cause recorded for a miss of these: rerun them alone (the `--*-only` modes), \
             and profile them if they miss again.",
        );
        md.push_str(&format!("- {why}\n"));
        for t in missed {
            let short = t.short_by.map_or_else(String::new, |short| {
                format!(", {:.1} % short of {}", short * 100.0, t.goal)
            });
            md.push_str(&format!("  - {}: {}{short}\n", t.what, t.measured));
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_misses_say_how_far_short_they_fell_under_their_cause() {
        let targets = [
            Target::ratio("met", 1.1, true, Some(1.2)).because("not shown"),
            Target::ratio("unexplained", 2.0, false, Some(3.0)),
            Target::ratio("explained", 1.1, true, Some(0.55)).because("Two scripts."),
            Target::ratio("unmeasured", 1.1, true, None).because("not shown either"),
            Target::ratio("also explained", 0.8, true, Some(0.7992)).because("Two scripts."),
        ];
        let md = misses_markdown(&targets);
        assert_eq!(
            md,
            "\n### Missed: by how much, and why\n\n\
             - Two scripts.\n\
             \x20 - explained: 0.550x, 50.0 % short of >= 1.10x\n\
             \x20 - also explained: 0.799x, 0.1 % short of >= 0.80x\n\
             - No cause recorded for a miss of these: rerun them alone (the `--*-only` \
             modes), and profile them if they miss again.\n\
             \x20 - unexplained: 3.000x, 50.0 % short of <= 2.00x\n"
        );
        assert_eq!(misses_markdown(&targets[..1]), "");
    }

    #[test]
    fn a_miss_says_how_far_short_of_its_goal_it_fell() {
        let low = Target::ratio("x", 1.1, true, Some(0.88));
        assert_eq!(low.met, Some(false));
        assert!(
            (low.short_by.unwrap() - 0.2).abs() < 1e-9,
            "{:?}",
            low.short_by
        );
        let high = Target::ratio("x", 2.5, false, Some(3.0));
        assert_eq!(high.met, Some(false));
        assert!(
            (high.short_by.unwrap() - 0.2).abs() < 1e-9,
            "{:?}",
            high.short_by
        );
        let met = Target::ratio("x", 1.1, true, Some(1.2));
        assert_eq!((met.met, met.short_by), (Some(true), None));
        let unmeasured = Target::ratio("x", 1.1, true, None)
            .unmeasured_because("not measured: no second CPU".into());
        assert_eq!((unmeasured.met, unmeasured.short_by), (None, None));
        assert_eq!(unmeasured.measured, "not measured: no second CPU");
        let kept = Target::ratio("x", 1.1, true, Some(0.5)).unmeasured_because("no".into());
        assert_eq!(kept.measured, "0.500x");
    }
}
