//! The lines a CI run shows at its end: per backend, the cases stamped and run; per
//! broken variant, the cases that caught it. Tests print them (visible with
//! `--nocapture`) and, when `DISTLOCK_SUMMARY_DIR` names a directory, also append them
//! to a file there, which `scripts/test.sh` prints after the whole suite ran.

use std::io::Write as _;
use std::path::PathBuf;

/// The environment variable naming the directory summaries are appended to.
pub const SUMMARY_DIR: &str = "DISTLOCK_SUMMARY_DIR";

/// Prints `text` and appends it to `<DISTLOCK_SUMMARY_DIR>/<section>.txt` when set.
/// A file that cannot be written is reported on stderr, never fails the test.
pub fn record(section: &str, text: &str) {
    println!("{text}");
    let Some(dir) = std::env::var_os(SUMMARY_DIR).map(PathBuf::from) else {
        return;
    };
    let path = dir.join(format!("{section}.txt"));
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        // One write per record, so lines of tests running at once do not interleave.
        file.write_all(format!("{text}\n").as_bytes())
    });
    if let Err(e) = written {
        eprintln!("summary: cannot append to {}: {e}", path.display());
    }
}
