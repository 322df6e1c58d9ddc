//! A helper for the test suites of Quicksilver's crates.

use std::io::Write;

/// Environment variable naming a file that collects the "not run here"
/// reports of a test run (`scripts/test-all.sh` sets it and prints the
/// file at the end).
pub const SKIP_LOG_ENV: &str = "QS_SKIP_LOG";

/// Reports that a test, or a part of it, could not run on this machine and
/// why: on stderr (written directly, so libtest does not swallow it), and
/// appended as one line to the file [`SKIP_LOG_ENV`] names, because test
/// harnesses hide a passing test's output. A test that calls this must
/// still check what it can (an error message, say) and never pass silently.
pub fn report_not_run(what: &str) {
    let line = what.split_whitespace().collect::<Vec<_>>().join(" ");
    let _ = writeln!(std::io::stderr(), "\n*** NOT RUN: {what}\n");
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV) {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path);
        if let Ok(mut f) = file {
            let _ = writeln!(f, "{line}");
        }
    }
}
