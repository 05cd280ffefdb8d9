//! lockctl: the distlock command-line tool.
//!
//! Its commands (`demo`, `check`, `bench`, `inspect`, `acquire`, `release`) land with
//! the facade and CLI work; until then it says so and exits with an error.

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("lockctl: no commands are available in this build yet");
    ExitCode::FAILURE
}
