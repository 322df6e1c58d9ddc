//! The one error type of `na-core` and of every NA plugin.

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
    #[error("lookup of {uri} failed: {source}")]
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
    #[error("RMA {op} of {len} bytes to {peer} failed: {source}")]
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
    #[error("{op} failed: {source}")]
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
