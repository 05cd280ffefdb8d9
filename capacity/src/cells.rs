//! How the report's tables (and the placement table) write a figure that may be missing (`-`): one format per kind
//! of figure, so every table writes the same kind alike.

/// CPU µs (per cycle, per refusal): one decimal.
pub(crate) fn micros(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

/// A ratio of two rates: two decimals and `x`.
pub(crate) fn ratio(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.2}x"))
}

/// A rate per second: whole numbers.
pub(crate) fn rate(r: Option<f64>) -> String {
    r.map_or("-".into(), |r| format!("{r:.0}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_figure_is_a_dash_and_a_present_one_keeps_its_kinds_decimals() {
        assert_eq!(micros(None), "-");
        assert_eq!(micros(Some(12.345)), "12.3");
        assert_eq!(ratio(Some(1.5)), "1.50x");
        assert_eq!(rate(Some(1234.6)), "1235");
    }
}
