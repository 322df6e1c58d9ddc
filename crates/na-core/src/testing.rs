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

/// A seeded, reproducible source of test inputs (a 64-bit linear
/// congruential generator, the upper 31 bits of each state): the same
/// seed gives the same layouts on every run. Not for anything but tests.
#[derive(Clone, Debug)]
pub struct TestRng(u64);

impl TestRng {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        TestRng(seed)
    }

    /// The next value, below 2^31.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// The next value below `n` (0 if `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}
