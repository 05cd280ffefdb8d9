//! How the modes print a target and the values of their rounds.

use benchmarks::target::Target;

/// Prints one target with its verdict.
pub(crate) fn print_target(t: &Target) {
    let verdict = match t.met {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "not measured",
    };
    println!(
        "  {:<72} goal {:<12} measured {:<14} {verdict}",
        t.what, t.goal, t.measured
    );
}

/// Round-by-round values, `decimals` digits after the point, for the `--*-only` printouts.
pub(crate) fn rounds(values: &[f64], decimals: usize) -> String {
    values
        .iter()
        .map(|v| format!("{v:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// CPU µs per cycle, or `-` where it could not be read.
pub(crate) fn us(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.1}"))
}
