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
