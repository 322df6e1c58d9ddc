//! The one error type of `na-core` and of every NA plugin, and
//! [`ErrorChain`], which displays an error with its causes.
//!
//! Every error type of the workspace keeps one rule (the Rust API
//! guideline for error chains): an error either returns its cause from
//! [`source`](std::error::Error::source) or writes the cause's text in its
//! own message, never both. Its message holds its own context (the
//! operation, the peer, the sizes) and the cause is reached through
//! `source()`, so a printer of the chain (anyhow's `{:#}`, eyre,
//! `std::error::Report`, [`ErrorChain`]) says each cause once. A log line or
//! a message that carries an error away as text (to a peer, into another
//! error's reason) uses [`ErrorChain`], not the error's `Display` alone.

use std::fmt;
use std::io;

/// Everything that can go wrong in the NA layer.
///
/// Plugins report their failures with these variants so that the RPC layer
/// above can tell them apart without knowing which plugin it talks to. Each
/// variant names the failing operation and carries the context needed to act
/// on it (the peer, the size, the `io::Error` from the kernel).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NaError {
    /// The address string could not be parsed by any plugin.
    #[error("invalid address {uri:?}: {reason}")]
    InvalidAddress {
        /// The string as given.
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No plugin of this endpoint handles the address scheme.
    #[error("no plugin for address scheme {scheme:?} (available: {available})")]
    NoPlugin {
        /// The scheme that was asked for (`sm`, `verbs`, ...).
        scheme: String,
        /// The schemes this endpoint has.
        available: String,
    },
    /// Looking up or connecting to a peer failed.
    #[error("lookup of {uri} failed")]
    Lookup {
        /// The address being looked up.
        uri: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A non-blocking lookup ([`Plugin::try_lookup`](crate::Plugin::try_lookup))
    /// could not finish without waiting (na-sm: the listener's accept queue
    /// is full). Nothing was set up; try again later with the same start
    /// time. Once the plugin's bound for a blocking lookup has passed since
    /// that start, the attempt returns the blocking lookup's error (a
    /// timeout naming the peer) instead.
    #[error("lookup of {uri} would block: {reason}")]
    WouldBlock {
        /// The address being looked up.
        uri: String,
        /// What it would wait for.
        reason: String,
    },
    /// The peer refused or broke the connection handshake.
    #[error("handshake with {uri} failed: {reason}")]
    Handshake {
        /// The peer.
        uri: String,
        /// What went wrong.
        reason: String,
    },
    /// A message is larger than the plugin's limit for its kind.
    #[error("message of {len} bytes exceeds the {kind} limit of {max} bytes")]
    MessageTooLarge {
        /// The offending length.
        len: usize,
        /// The maximum allowed.
        max: usize,
        /// `unexpected` or `expected`.
        kind: &'static str,
    },
    /// The parts of a message add up to more bytes than a `usize` holds
    /// (possible only with parts that alias one huge memory region).
    #[error("the lengths of the {parts} parts of a {kind} add up to more than usize::MAX bytes")]
    LengthOverflow {
        /// How many parts were given.
        parts: usize,
        /// What they were meant to become (`message buffer`, ...).
        kind: &'static str,
    },
    /// A receive buffer was too small for the message that arrived.
    #[error("received {len} bytes into a buffer of {capacity} bytes")]
    Truncated {
        /// Bytes that arrived.
        len: usize,
        /// Bytes the buffer could hold.
        capacity: usize,
    },
    /// An offset/length pair falls outside a memory handle.
    #[error("range {offset}+{len} is out of bounds of a {what} memory handle of {size} bytes")]
    OutOfBounds {
        /// `local` or `remote`.
        what: &'static str,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the handle.
        size: u64,
    },
    /// A memory handle does not permit the requested access.
    #[error("{what} memory handle is {has:?}, operation needs {needs}")]
    AccessDenied {
        /// `local` or `remote`.
        what: &'static str,
        /// The handle's mode.
        has: crate::Access,
        /// What the operation needed (`read` or `write`).
        needs: &'static str,
    },
    /// A serialized memory handle or address could not be decoded.
    #[error("malformed {what}: {reason}")]
    Malformed {
        /// What was being decoded.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A peer wrote something invalid into shared state or onto the wire.
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// The peer that misbehaved.
        peer: String,
        /// What it did.
        reason: String,
    },
    /// The peer is gone (exited, killed, disconnected).
    #[error("peer {peer} disconnected: {reason}")]
    PeerGone {
        /// The peer.
        peer: String,
        /// How we found out.
        reason: String,
    },
    /// The sends queued for a peer that is not reading reached the
    /// plugin's bound (see [`SendBacklog`](crate::SendBacklog)); this send
    /// was not queued. Retry once the peer has read, or raise the bound.
    #[error(
        "send to {peer} refused: {bytes} of at most {max} bytes already queued {scope} \
         ({queued} sends to this peer wait for it to read)"
    )]
    SendBacklogFull {
        /// The peer.
        peer: String,
        /// Sends queued for it.
        queued: usize,
        /// Bytes charged in the backlog that is full (this peer's, or all).
        bytes: usize,
        /// That backlog's bound.
        max: usize,
        /// Which bound: `to this peer` or `to all peers`.
        scope: &'static str,
    },
    /// The operation was canceled before it completed.
    #[error("operation canceled")]
    Canceled,
    /// The operation id given to cancel is not known (it already completed).
    #[error("no posted operation with id {0}")]
    UnknownOp(u64),
    /// An operation was started under an id that names one still in flight
    /// (ids are the caller's, unique among its operations in flight). The
    /// new operation was not started; the one in flight is untouched.
    #[error("operation id {0} is already in flight")]
    OpInFlight(u64),
    /// Remote memory access failed in the kernel or in the NIC.
    #[error("RMA {op} of {len} bytes to {peer} failed")]
    Rma {
        /// `put` or `get`.
        op: &'static str,
        /// The transfer length.
        len: u64,
        /// The peer.
        peer: String,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// A system call the plugin needs failed.
    #[error("{op} failed")]
    Sys {
        /// The operation (`epoll_wait`, `eventfd write`, ...).
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
    /// A configuration value (argument or environment variable) is invalid.
    #[error("invalid configuration {name}={value:?}: {reason}")]
    Config {
        /// The option or environment variable.
        name: String,
        /// The value given.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// The plugin does not support this operation.
    #[error("{plugin} does not support {op}")]
    Unsupported {
        /// The plugin name.
        plugin: &'static str,
        /// The operation.
        op: &'static str,
    },
    /// Any other plugin-specific failure.
    #[error("{plugin}: {message}")]
    Plugin {
        /// The plugin name.
        plugin: &'static str,
        /// What happened.
        message: String,
    },
}

impl NaError {
    /// Wraps a failed system call.
    pub fn sys(op: &'static str, source: io::Error) -> Self {
        NaError::Sys { op, source }
    }

    /// True if a non-blocking attempt only would have had to wait
    /// ([`NaError::WouldBlock`]): retry it later.
    pub fn is_would_block(&self) -> bool {
        matches!(self, NaError::WouldBlock { .. })
    }

    /// True if the error means the peer is unusable from now on.
    pub fn is_peer_fatal(&self) -> bool {
        matches!(self, NaError::PeerGone { .. } | NaError::Protocol { .. })
    }
}

/// Result alias of the NA layer.
pub type Result<T, E = NaError> = std::result::Result<T, E>;

/// Displays an error followed by each of its causes (the errors
/// [`source`](std::error::Error::source) leads to), outermost first,
/// joined with ": ": `lookup of sm://7-0 failed: No such file or
/// directory (os error 2)`.
///
/// An error's own `Display` says only its own context (see the [module
/// docs](self)); this is what a log line or a text message (one sent to a
/// peer, or kept as another error's reason) writes, so no cause is lost:
/// `tracing::warn!(error = %ErrorChain(&e), "...")`, `format!("...: {}",
/// ErrorChain(&e))`.
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'a));

impl fmt::Display for ErrorChain<'_> {
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

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::{ErrorChain, NaError};
    use std::io;

    #[test]
    fn the_chain_says_each_cause_once_and_display_only_its_own_context() {
        let e = NaError::Lookup {
            uri: "sm://7-0".into(),
            source: io::Error::new(io::ErrorKind::NotFound, "no socket file"),
        };
        // Display: the error's own context, not its source's text.
        assert_eq!(e.to_string(), "lookup of sm://7-0 failed");
        // The chain: the context, then the cause, once.
        assert_eq!(
            ErrorChain(&e).to_string(),
            "lookup of sm://7-0 failed: no socket file"
        );
        assert_eq!(ErrorChain(&e).to_string().matches("no socket file").count(), 1);
    }

    #[test]
    fn every_level_of_a_deeper_chain_is_written() {
        // An io::Error wrapping one of ours: its source is our error's.
        let inner = NaError::sys("epoll_wait", io::Error::from_raw_os_error(libc::EINTR));
        let outer = io::Error::other(inner);
        let chain = ErrorChain(&outer).to_string();
        assert!(chain.starts_with("epoll_wait failed: "), "{chain}");
        assert!(
            chain.contains(&io::Error::from_raw_os_error(libc::EINTR).to_string()),
            "{chain}"
        );
        // An error with no source is its Display.
        assert_eq!(ErrorChain(&NaError::Canceled).to_string(), "operation canceled");
        assert_eq!(
            format!("{:?}", ErrorChain(&NaError::Canceled)),
            "operation canceled"
        );
    }
}
