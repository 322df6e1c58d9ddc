//! How the command-line programs (hg-perf, hg-soak, hg-rpc-testpeer, the
//! examples except codec_compare, which has no error to report) end on an
//! error: its message and each cause on stderr, in
//! words (`main` returning `Err` would print the error's `Debug` form,
//! escaped quotes and all), and a failure exit status.

use std::error::Error;
use std::process::ExitCode;

/// Runs a program's body: success, or its error on stderr (prefixed by
/// `program`, then one "caused by" line per source) and exit status 1.
pub fn run(program: &str, body: impl FnOnce() -> Result<(), Box<dyn Error>>) -> ExitCode {
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            for line in report(program, &*e) {
                eprintln!("{line}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The lines [`run`] prints for `e`: its message, then a "caused by" line
/// for each error of its chain. The workspace's errors write their own
/// context only and leave their cause to `source()` (see
/// `na_core::ErrorChain`), so each cause is said once.
fn report(program: &str, e: &dyn Error) -> Vec<String> {
    let mut lines = vec![format!("{program}: error: {e}")];
    let mut source = e.source();
    while let Some(s) = source {
        lines.push(format!("  caused by: {s}"));
        source = s.source();
    }
    lines
}

#[cfg(test)]
mod exit_tests {
    use super::report;

    /// An error with a source that keeps its text out of its message.
    #[derive(Debug)]
    struct Wrap(&'static str, std::io::Error);

    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.1)
        }
    }

    #[test]
    fn each_cause_of_the_chain_is_printed_once() {
        let e = Wrap("saving", std::io::Error::other("disk on fire"));
        assert_eq!(report("p", &e), ["p: error: saving", "  caused by: disk on fire"]);
        // The RPC layer's errors: a transport error over a failed lookup
        // over the OS error, each said once.
        let e = hg_rpc::RpcError::Transport(na_core::NaError::Lookup {
            uri: "sm://7-0".into(),
            source: std::io::Error::other("no socket file"),
        });
        assert_eq!(
            report("p", &e),
            [
                "p: error: transport error",
                "  caused by: lookup of sm://7-0 failed",
                "  caused by: no socket file",
            ]
        );
    }
}
