//! How the command-line programs (hg-perf, hg-soak, the demo and blobstore
//! examples) end on an error: its message and each cause on stderr, in
//! words (`main` returning `Err` would print the error's `Debug` form,
//! escaped quotes and all), and a failure exit status.

use std::error::Error;
use std::process::ExitCode;

/// Runs a program's body: success, or its error on stderr (prefixed by
/// `program`, one "caused by" line per source the message does not
/// already hold) and exit status 1.
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
/// for each source whose text is not already in the lines before it (an
/// error that writes its source into its own message, as
/// `RpcError::Transport` does, and also returns it as its source, would
/// otherwise print the same words twice).
fn report(program: &str, e: &dyn Error) -> Vec<String> {
    let mut said = e.to_string();
    let mut lines = vec![format!("{program}: error: {said}")];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !said.contains(&text) {
            lines.push(format!("  caused by: {text}"));
            said.push('\n');
            said.push_str(&text);
        }
        source = s.source();
    }
    lines
}

#[cfg(test)]
mod exit_tests {
    use super::report;

    /// An error that writes its source into its message, or not.
    #[derive(Debug)]
    struct Wrap(&'static str, bool, std::io::Error);

    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self.1 {
                true => write!(f, "{}: {}", self.0, self.2),
                false => f.write_str(self.0),
            }
        }
    }

    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.2)
        }
    }

    #[test]
    fn a_cause_the_message_already_holds_is_not_printed_again() {
        let inner = || std::io::Error::other("disk on fire");
        assert_eq!(
            report("p", &Wrap("transport", true, inner())),
            ["p: error: transport: disk on fire"]
        );
        assert_eq!(
            report("p", &Wrap("saving", false, inner())),
            ["p: error: saving", "  caused by: disk on fire"]
        );
    }
}
