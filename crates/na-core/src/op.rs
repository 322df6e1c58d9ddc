//! Operations and their completions.
//!
//! Every operation a plugin accepts is named by an [`OpId`] that the caller
//! chooses, unique among the caller's operations in flight on that plugin:
//! a post call under an id in flight fails with [`NaError::OpInFlight`]
//! and starts nothing (a send with [`Report::FailuresOnly`] that a plugin
//! finishes inside the call is never tracked, and may go unchecked). When
//! a post call returns `Ok`, the operation completes exactly once, later,
//! with a [`Completion`] carrying that id: success, error or
//! [`NaError::Canceled`] (a `FailuresOnly` send: see there). When a post
//! call returns `Err`, nothing was started and no completion follows.

use crate::addr::Addr;
use crate::error::NaError;

/// Caller-chosen identifier of an operation in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// Message tag: matches expected messages and is reported with unexpected ones.
pub type Tag = u32;

/// Which outcomes of a send become completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Report {
    /// Every outcome: the send completes exactly once, like any operation.
    All,
    /// Failures (and cancellations) for certain; a success may be left
    /// out. For callers with nothing to do when a send succeeds (an RPC
    /// layer, which learns of a lost peer another way): a plugin that
    /// finishes a send inside the call (na-sm, when the ring has room)
    /// then queues no completion, which saves the caller a progress turn
    /// per message. Such a caller must not wait for the completion.
    FailuresOnly,
}

/// What kind of operation completed. `#[non_exhaustive]`: a later
/// version may add kinds (an atomic, say); other crates match it with a
/// wildcard arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// An unexpected message was sent.
    SendUnexpected,
    /// An expected message was sent.
    SendExpected,
    /// An unexpected message was received into a posted buffer.
    RecvUnexpected,
    /// An expected message (matched on source and tag) was received.
    RecvExpected,
    /// A put (local to remote) finished.
    Put,
    /// A get (remote to local) finished.
    Get,
}

/// The outcome of one operation.
#[derive(Debug)]
pub struct Completion {
    /// The id given when the operation was posted.
    pub op: OpId,
    /// The kind of operation.
    pub kind: OpKind,
    /// `Ok` on success; the error (or [`NaError::Canceled`]) otherwise.
    pub status: Result<(), NaError>,
    /// For receives: the buffer that was posted, given back whatever the
    /// status. On success its length is the received length. For a send
    /// that failed for a reason of its own while its peer stays reachable
    /// (too large for the peer, a post error; not its peer's loss): the
    /// message, if the plugin gives it back (na-verbs does), so that the
    /// sender can tell what did not go (hg-rpc: which call's response).
    pub buf: Option<Vec<u8>>,
    /// For receives: the sender. For unexpected receives this is how a
    /// server learns whom to answer. For a failed send that gives its
    /// message back (see `buf`): the destination.
    pub source: Option<Addr>,
    /// For receives: the tag the message carried.
    pub tag: Tag,
}

impl Completion {
    /// A successful completion without buffer (sends and RMA).
    pub fn done(op: OpId, kind: OpKind) -> Self {
        Completion {
            op,
            kind,
            status: Ok(()),
            buf: None,
            source: None,
            tag: 0,
        }
    }

    /// A failed (or canceled) completion, giving back the receive buffer if any.
    pub fn failed(op: OpId, kind: OpKind, err: NaError, buf: Option<Vec<u8>>) -> Self {
        Completion {
            op,
            kind,
            status: Err(err),
            buf,
            source: None,
            tag: 0,
        }
    }

    /// A successful receive.
    pub fn received(op: OpId, kind: OpKind, buf: Vec<u8>, source: Addr, tag: Tag) -> Self {
        Completion {
            op,
            kind,
            status: Ok(()),
            buf: Some(buf),
            source: Some(source),
            tag,
        }
    }

    /// True if the operation was canceled.
    pub fn is_canceled(&self) -> bool {
        matches!(self.status, Err(NaError::Canceled))
    }
}
