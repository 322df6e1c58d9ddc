//! How the command-line programs (hg-perf, hg-soak, the demo and blobstore
//! examples) end on an error: its message and each cause on stderr, in
//! words (`main` returning `Err` would print the error's `Debug` form,
//! escaped quotes and all), and a failure exit status.

use std::error::Error;
use std::process::ExitCode;

/// Runs a program's body: success, or its error on stderr (prefixed by
/// `program`, one "caused by" line per source) and exit status 1.
pub fn run(program: &str, body: impl FnOnce() -> Result<(), Box<dyn Error>>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: error: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
