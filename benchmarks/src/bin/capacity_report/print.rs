//! How the modes print a target and the values of their rounds.

use benchmarks::target::Target;
use capacity::full_semaphore::Full;
use capacity::waited::Side;

/// Prints one target with its verdict (a miss with how far short of its goal it fell).
pub(crate) fn print_target(t: &Target) {
    let verdict = match (t.met, t.short_by) {
        (Some(true), _) => "met".to_owned(),
        (Some(false), Some(short)) => format!("MISSED ({:.1} % short)", short * 100.0),
        (Some(false), None) => "MISSED".to_owned(),
        (None, _) => "not measured".to_owned(),
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

/// A median ratio of alternating rounds, or `-` where a side measured nothing.
pub(crate) fn ratio(value: Option<f64>) -> String {
    value.map_or("-".into(), |r| format!("{r:.2}x"))
}

/// Two sides of alternating rounds, each named, with its cycles/s and its rounds on a line
/// of its own.
pub(crate) fn sides((a_name, a): (&str, &Side), (b_name, b): (&str, &Side)) -> String {
    format!(
        "  {a_name} {:.0} cycles/s (rounds {})\n  {b_name} {:.0} cycles/s (rounds {})\n",
        a.rate(),
        rounds(&a.per_sec, 0),
        b.rate(),
        rounds(&b.per_sec, 0)
    )
}

/// The CPU µs per cycle of two sides, the client's and the server's.
pub(crate) fn cpu(a: &Side, b: &Side) -> String {
    format!(
        "client {} / {}, server {} / {}",
        us(a.client()),
        us(b.client()),
        us(a.server()),
        us(b.server())
    )
}

/// One case of a full semaphore (`name`: the lock, or N): the median and the rounds of
/// its waits and its refusals, their CPU, and the Redis server's µs per refusal.
pub(crate) fn full_rows(name: &str, full: &Full) -> String {
    let (w, r) = (&full.waits.side, &full.refusals.side);
    let server = full.refusals.command().map_or(String::new(), |us| {
        format!(
            ", server {us:.1} µs per refusal (rounds {})",
            rounds(&full.refusals.command_us, 1)
        )
    });
    format!(
        "  {name:>6}: waits {:.0} grants/s (rounds {}), CPU {} / {}; refusals {:.0}/s \
         (rounds {}), CPU {} / {}{server}",
        w.rate(),
        rounds(&w.per_sec, 0),
        us(w.client()),
        us(w.server()),
        r.rate(),
        rounds(&r.per_sec, 0),
        us(r.client()),
        us(r.server()),
    )
}
