//! The log lines a test's code writes through `tracing`, captured for the
//! test to read ([`CapturedLog::install_global`]).

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Every line the process logs at debug level and above, once installed.
#[derive(Clone, Default)]
pub struct CapturedLog(Arc<Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Installs the global subscriber writing to the returned log.
    ///
    /// Global, and so once per process: call it from a test binary of its
    /// own (one test). A thread-local subscriber would share tracing's
    /// per-callsite interest cache with threads that have none, and could
    /// miss lines when tests run in parallel (tokio-rs/tracing#3611).
    ///
    /// # Panics
    /// If the process has a global subscriber already.
    pub fn install_global() -> CapturedLog {
        let log = CapturedLog::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("the only global subscriber of this process");
        log
    }

    /// What was logged so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The lines logged so far at `level` (`"WARN"`, `"DEBUG"`...) that
    /// contain `text`.
    pub fn lines_at(&self, level: &str, text: &str) -> Vec<String> {
        let level = format!(" {level} ");
        self.text()
            .lines()
            .filter(|l| l.contains(&level) && l.contains(text))
            .map(str::to_owned)
            .collect()
    }

    /// Asserts the throttled-warning rule for `n` occurrences of a line
    /// containing `what`: warned at the 1st, 2nd, 4th, 8th... occurrence
    /// only, each warning carrying `{count}={k}` (the running count), and
    /// every other occurrence logged once at debug level.
    ///
    /// # Panics
    /// If the log breaks the rule (this is a test assertion).
    pub fn assert_throttled(&self, what: &str, count: &str, n: u64) {
        let warned = self.lines_at("WARN", what);
        let debug = self.lines_at("DEBUG", what).len() as u64;
        let powers: Vec<u64> = (0..64).map(|k| 1u64 << k).take_while(|&p| p <= n).collect();
        assert_eq!(
            warned.len(),
            powers.len(),
            "{n} of {what:?}: warned at {powers:?} only: {warned:#?}"
        );
        for (w, p) in warned.iter().zip(&powers) {
            assert!(w.contains(&format!("{count}={p}")), "expected {count}={p}: {w}");
        }
        assert_eq!(
            debug + warned.len() as u64,
            n,
            "every one of {what:?} logged once:\n{}",
            self.text()
        );
    }
}

impl Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
