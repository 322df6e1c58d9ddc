//! The error type of `na-perf`.
//!
//! A variant with a cause returns it from `source()` and leaves its text
//! out of its message; `main` prints the chain.

use std::io;

/// Everything that can stop a benchmark run.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// The peer process could not be started.
    #[error("starting the peer process {exe}")]
    SpawnPeer {
        /// The executable that was run.
        exe: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The control pipe to or from the peer process failed.
    #[error("control pipe to the peer process ({what})")]
    PeerIo {
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The peer process gave an answer that makes no sense, or an error.
    #[error("peer process answered {reply:?} to {command:?}")]
    PeerReply {
        /// The command sent.
        command: String,
        /// What came back.
        reply: String,
    },
    /// A system call of a floor measurement failed.
    #[error("{op} failed")]
    Sys {
        /// The operation.
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// The NA layer or a plugin failed.
    #[error(transparent)]
    Na(#[from] na_core::NaError),
    /// A command-line value is invalid.
    #[error("invalid {name}: {reason}")]
    Arg {
        /// The option.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// The peer did not answer in time.
    #[error("timed out after {secs} s waiting for {what}")]
    Timeout {
        /// What we waited for.
        what: &'static str,
        /// How long.
        secs: u64,
    },
    /// Writing the results failed.
    #[error("writing results")]
    Output(#[source] io::Error),
}

impl PerfError {
    /// Wraps a failed system call.
    pub fn sys(op: &'static str) -> impl FnOnce(io::Error) -> PerfError {
        move |source| PerfError::Sys { op, source }
    }
}

/// Result alias of `na-perf`.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::PerfError;

    #[test]
    fn display_leaves_the_source_to_the_chain() {
        let e = PerfError::sys("mmap")(std::io::Error::other("out of memory"));
        assert_eq!(e.to_string(), "mmap failed");
        assert_eq!(na_core::ErrorChain(&e).to_string(), "mmap failed: out of memory");
    }
}
