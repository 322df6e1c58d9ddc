//! # na-core: Quicksilver's network abstraction
//!
//! The NA layer moves two kinds of data between processes:
//!
//! * **messages**: small (a few KiB), two-sided. *Unexpected* messages are
//!   received by any posted unexpected receive (how a server learns about a
//!   new request); *expected* messages are matched on (source address, tag)
//!   against a posted expected receive (how a reply finds its caller).
//! * **RMA**: one-sided `put`/`get` between a local [`MemHandle`] and a
//!   peer's [`RemoteMem`], across any number of segments on either side.
//!
//! A transport is a [`Plugin`]. An [`Endpoint`] owns any number of plugin
//! instances, routes each operation by address, and drives them all through
//! one epoll set: every plugin exposes a pollable fd and a "may I block?"
//! check ([`Plugin::try_wait`]), so one thread sleeps on all transports at
//! once without busy waiting, in one of three [`ProgressMode`]s; a
//! [`Waker`] ([`Endpoint::waker`]) ends that sleep from another thread.
//!
//! Every operation completes exactly once with a [`Completion`]: success,
//! error, or [`NaError::Canceled`].
//!
//! Errors say their cause once: a variant with a cause returns it from
//! `source()` and leaves it out of its own message, so where an error
//! leaves as text (a log line, a reason kept in another error or sent to
//! a peer) write it with [`ErrorChain`], which adds each cause (see the
//! [`error`] module).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod addr;
pub mod backlog;
pub mod endpoint;
pub mod env;
pub mod error;
pub mod fasthash;
pub mod hint;
pub mod mem;
pub mod msgbuf;
pub mod op;
pub mod plugin;
pub mod progress;
pub mod rma;
pub mod slab;
#[allow(unsafe_code)]
pub mod sys;
pub mod testing;
pub mod waker;

pub use addr::{scheme_of, split_uri, Addr, PluginId};
pub use backlog::{
    BacklogTotal, SendBacklog, BACKLOG_FLOOR, DEFAULT_MAX_BACKLOG_BYTES, DEFAULT_MAX_BACKLOG_TOTAL,
};
pub use endpoint::Endpoint;
pub use env::env_var;
pub use error::{ErrorChain, NaError, Result};
pub use mem::{Access, MemHandle, RemoteMem, RemoteSegment, MAX_REMOTE_SEGMENTS};
pub use msgbuf::{MsgBuf, MsgBufPool, MsgMemory};
pub use op::{Completion, OpId, OpKind, Report, Tag};
pub use plugin::{PeerProcess, Plugin, PluginFactory, PluginRegistry, PluginStats};
pub use progress::{deadline_after, ProgressMode, DEFAULT_ADAPTIVE_SPIN};
pub use rma::{Rma, RmaDir};
pub use slab::{TokenSlab, TokenState};
pub use waker::Waker;

/// True for the counts at which a warning that a peer can cause again and
/// again is logged: 1, 2, 4, 8... A peer repeating it (at ring or connect
/// speed) cannot flood the log; a counter in the stats keeps every one.
pub fn logged_at(count: u64) -> bool {
    count.is_power_of_two()
}
