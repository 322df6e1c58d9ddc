//! The one error type of `na-sm`, and its mapping onto [`NaError`].
//!
//! A variant with a cause returns it from `source()` and leaves its text
//! out of its own message (see [`na_core::ErrorChain`]); one turned into
//! [`NaError::Plugin`], whose message is text only, takes the whole chain.

use std::io;
use std::path::PathBuf;

use na_core::NaError;

/// Everything that can go wrong in the shared-memory plugin.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SmError {
    /// A configuration value (field or environment variable) is invalid.
    #[error("invalid configuration {name}={value:?}: {reason}")]
    Config {
        /// The field or environment variable.
        name: String,
        /// The value given.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The socket directory could not be created or inspected.
    #[error("socket directory {path}")]
    SocketDir {
        /// The directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The socket directory exists but others could use it.
    #[error("socket directory {path} is unsafe: {reason}")]
    InsecureDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong (owner, mode).
        reason: String,
    },
    /// Creating the listening socket (or its owner file) failed.
    #[error("cannot listen on {path}")]
    Listen {
        /// The socket file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Another instance of this process has the instance name (listening
    /// or not: a peer would take the two for one).
    #[error("sm instance name {uri} is already used by another instance of this process; give each its own SmConfig::name")]
    NameInUse {
        /// The address the name makes.
        uri: String,
    },
    /// A system call the plugin needs failed.
    #[error("{op} failed")]
    Sys {
        /// The operation.
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// An address string is not `sm://<pid>-<instance>`.
    #[error("invalid sm address {uri:?}: {reason}")]
    InvalidAddress {
        /// The string.
        uri: String,
        /// What is wrong.
        reason: String,
    },
    /// Connecting to a peer failed.
    #[error("lookup of {uri} failed")]
    Lookup {
        /// The address.
        uri: String,
        /// The underlying error, with a hint in its message.
        #[source]
        source: io::Error,
    },
    /// A non-blocking lookup would have had to wait (the listener's queue
    /// is full); see [`NaError::WouldBlock`].
    #[error("lookup of {uri} would block: {reason}")]
    WouldBlock {
        /// The address.
        uri: String,
        /// What it would wait for.
        reason: String,
    },
    /// The connection handshake was refused or malformed.
    #[error("handshake with {peer} failed: {reason}")]
    Handshake {
        /// The peer (address or socket credentials).
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// A peer wrote invalid data into shared memory or onto its socket.
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What it did.
        reason: String,
    },
    /// The peer is gone.
    #[error("peer {peer} disconnected: {reason}")]
    PeerGone {
        /// The peer.
        peer: String,
        /// How we found out.
        reason: String,
    },
    /// The peer exited before its exit could be watched, and its pid now
    /// names another process (told apart by start time where the kernel
    /// gives no pidfd of the peer; see the crate docs): it is gone, and
    /// that process is never taken for it.
    #[error("peer {peer} is gone: {}", pid_reused(*.pid, *.expected, *.found))]
    PidReused {
        /// The peer.
        peer: String,
        /// Its pid.
        pid: u32,
        /// Its start time, read as it connected.
        expected: u64,
        /// The start time of the process that has the pid now.
        found: u64,
    },
    /// A cross-memory-attach transfer failed.
    #[error("RMA {op} of {len} bytes to {peer} failed")]
    Rma {
        /// `put` or `get`.
        op: &'static str,
        /// Transfer length.
        len: u64,
        /// The peer.
        peer: String,
        /// The kernel's error (with a hint for EPERM).
        #[source]
        source: io::Error,
    },
    /// Removing a stale file failed.
    #[error("cleanup of {path} failed")]
    Cleanup {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Why a peer is gone whose pid was reused ([`SmError::PidReused`]).
fn pid_reused(pid: u32, expected: u64, found: u64) -> String {
    format!(
        "its process {pid} exited and the pid now names another process (started {found}, \
         the peer {expected} clock ticks after boot)"
    )
}

impl SmError {
    pub(crate) fn sys(op: &'static str, source: io::Error) -> Self {
        SmError::Sys { op, source }
    }
}

impl From<SmError> for NaError {
    fn from(e: SmError) -> Self {
        match e {
            SmError::Config { name, value, reason } => NaError::Config { name, value, reason },
            SmError::InvalidAddress { uri, reason } => NaError::InvalidAddress { uri, reason },
            SmError::Lookup { uri, source } => NaError::Lookup { uri, source },
            SmError::WouldBlock { uri, reason } => NaError::WouldBlock { uri, reason },
            SmError::Handshake { peer, reason } => NaError::Handshake { uri: peer, reason },
            SmError::Protocol { peer, reason } => NaError::Protocol { peer, reason },
            SmError::PeerGone { peer, reason } => NaError::PeerGone { peer, reason },
            SmError::PidReused {
                peer,
                pid,
                expected,
                found,
            } => NaError::PeerGone {
                peer,
                reason: pid_reused(pid, expected, found),
            },
            SmError::Rma {
                op,
                len,
                peer,
                source,
            } => NaError::Rma {
                op,
                len,
                peer,
                source,
            },
            SmError::Sys { op, source } => NaError::Sys { op, source },
            e @ (SmError::SocketDir { .. }
            | SmError::InsecureDir { .. }
            | SmError::Listen { .. }
            | SmError::NameInUse { .. }
            | SmError::Cleanup { .. }) => NaError::Plugin {
                plugin: "sm",
                message: na_core::ErrorChain(&e).to_string(),
            },
        }
    }
}

/// Result alias of this crate.
pub type SmResult<T> = std::result::Result<T, SmError>;

#[cfg(test)]
mod tests {
    use super::{NaError, SmError};
    use na_core::ErrorChain;

    #[test]
    fn display_leaves_the_source_to_the_chain_and_na_error_keeps_the_chain() {
        let listen = || SmError::Listen {
            path: "/run/qs/7-0".into(),
            source: std::io::Error::other("address in use by a live process"),
        };
        let e = listen();
        assert!(!e.to_string().contains("live process"), "{e}");
        assert_eq!(
            ErrorChain(&e).to_string(),
            "cannot listen on /run/qs/7-0: address in use by a live process"
        );
        // Through the NA API it is a plugin message, text only: the
        // chain, so the cause is not lost.
        match NaError::from(listen()) {
            NaError::Plugin { message, .. } => assert!(
                message.ends_with(": address in use by a live process"),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
