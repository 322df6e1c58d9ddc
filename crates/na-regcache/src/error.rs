//! The crate's error type.
//!
//! An error either returns its cause from `source()` or writes it in its
//! message, never both (the Rust error guideline): [`Error::Register`] and
//! [`Error::MonitorInit`] name what failed and leave the registrar's or
//! the OS's error to `source()`. Log lines write the whole chain
//! ([`Chain`]).

use std::fmt;
use std::io;

/// Errors of `na-regcache`, one variant per failing operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable holds a value the cache cannot use.
    #[error("invalid {var}={value:?}: {reason}")]
    Config {
        /// The variable, e.g. `QS_MR_CACHE_MAX_COUNT`.
        var: &'static str,
        /// The offending value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration passed through the API is out of range.
    #[error("invalid cache configuration: {0}")]
    InvalidConfig(String),
    /// `get` was called with an empty or overflowing range.
    #[error("invalid range: address {addr:#x}, length {len}")]
    InvalidRange {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
    },
    /// The registrar failed, also after evicting idle entries and retrying.
    #[error("registration of {len} bytes at {addr:#x} failed")]
    Register {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
        /// The registrar's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The memory monitor could not be started.
    #[error("memory monitor {monitor} unavailable")]
    MonitorInit {
        /// Which monitor.
        monitor: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The allocator monitor was requested but the binary does not use
    /// `InvalidatingAlloc` as its `#[global_allocator]`.
    #[error("QS_MR_CACHE_MONITOR=alloc needs `#[global_allocator] static A: na_regcache::InvalidatingAlloc<System>`")]
    AllocHookNotInstalled,
    /// The cache was created in another process: this is a forked child,
    /// which must build its own registrar and cache.
    #[error("registration cache used in a forked child; create a new cache in the child")]
    ForkedChild,
    /// The registration has the most handles one may have
    /// ([`MAX_HANDLES`](crate::MAX_HANDLES): 2^30 on 32-bit targets, 2^62
    /// on 64-bit ones), so a hit or a clone was refused; only leaked
    /// handles get there.
    #[error("registration of {len} bytes at {addr:#x} has {max} handles already, the most it may have (are handles leaked?)")]
    TooManyHandles {
        /// Start of the registered range.
        addr: usize,
        /// Length of the registered range.
        len: usize,
        /// The limit, [`MAX_HANDLES`](crate::MAX_HANDLES).
        max: usize,
    },
    /// The mapping changed during each of three attempts to register it:
    /// a concurrent unmap or discard of the very range (the caller raced
    /// with itself). A miss claims an exact tracking slot for its span
    /// before it pins, so invalidations of other ranges never cause it;
    /// registrations thrown away because a discard of the range was still
    /// settling do not count (they have their own bound, and end in an
    /// uncached registration).
    #[error("mapping at {addr:#x} changed during every registration attempt")]
    Unstable {
        /// Start address.
        addr: usize,
    },
}

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Displays an error and its causes, outermost first, joined with ": "
/// (as `na_core::ErrorChain` does; this crate does not depend on
/// na-core): what the cache's log lines write, so no cause is lost.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'a));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn display_leaves_the_source_to_the_chain() {
        let e = Error::Register {
            addr: 0x1000,
            len: 4096,
            source: Box::new(std::io::Error::other("pinning refused")),
        };
        let shown = e.to_string();
        assert!(!shown.contains("pinning refused"), "{shown}");
        let chain = na_core::ErrorChain(&e).to_string();
        assert_eq!(
            chain,
            "registration of 4096 bytes at 0x1000 failed: pinning refused"
        );
    }
}
