//! Compiles the clock shim (`clock/shift.c`) into `$OUT_DIR/libdistlock_clock.so` with
//! the C compiler the `cc` crate finds, and tells the crate its path in
//! `DISTLOCK_CLOCK_SHIM` (see `src/clock.rs`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "clock/shift.c";
    println!("cargo:rerun-if-changed={source}");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shim = out_dir.join("libdistlock_clock.so");
    let mut cmd: Command = cc::Build::new()
        .cargo_metadata(false)
        .get_compiler()
        .to_command();
    cmd.args([
        "-shared",
        "-fPIC",
        "-O2",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-o",
    ])
    .arg(&shim)
    .arg(source)
    .arg("-ldl");
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler ({cmd:?}): {e}"));
    let diagnostics = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "compiling the clock shim failed ({cmd:?}, {}):\n{diagnostics}",
        output.status
    );
    for line in diagnostics.lines() {
        println!("cargo:warning={line}");
    }
    println!("cargo:rustc-env=DISTLOCK_CLOCK_SHIM={}", shim.display());
}
