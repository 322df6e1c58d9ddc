//! # hg-rpc: typed RPCs over the NA layer
//!
//! Define an RPC once ([`Rpc`]: name, input and output serde types),
//! register a handler for it by name on the target ([`Engine::register`]),
//! and call it from the origin ([`Engine::call`], or [`Engine::forward`] and
//! [`Engine::take_response`]). Requests and responses both travel as NA
//! unexpected messages with the versioned header of [`header`]; a response
//! is filed by its cookie, for a call to the peer it came from, and one
//! watch receive per called peer fails its calls when it goes away (see
//! `docs/PROTOCOL.md`). Arguments
//! are encoded by a [`Codec`] ([`Postcard`] by default).
//!
//! Two ways to drive it: the blocking API ([`Engine::progress`] +
//! [`Engine::trigger`]) for code that owns its loop, or tokio
//! ([`AsyncEngine`]: calls are futures, one driver task waits on the
//! endpoint's fd). Inputs too large for one eager message spill into a
//! one-sided pull by the target (see `docs/PROTOCOL.md`). Not yet here (see
//! the issue tracker): several contexts in one engine (today: one engine
//! per context, each with its own plugin instance and address).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod call_table;
pub mod codec;
mod deferred;
pub mod engine;
mod env_switches;
pub mod error;
mod exposed;
pub mod header;
mod lookup_backoff;
mod notices;
pub mod rpc;
pub mod runtime;
mod spill;
mod stats;
#[allow(unsafe_code)]
mod sys;
pub mod transport;

pub use codec::{Codec, Postcard};
pub use engine::{
    BulkCtx, BulkId, CallId, DeferredRequest, Engine, RpcStats, ABANDONED_INPUT_TTL, BATCH_WINDOW,
    DEFAULT_HANDLER_TRANSFER_TIMEOUT, DEFAULT_MAX_ABANDONED_BYTES, DEFAULT_MAX_DEFERRED_PER_PEER,
    DEFAULT_MAX_DEFERRED_TOTAL, DEFAULT_MAX_EXPOSED_PER_PEER, DEFAULT_MAX_EXPOSED_TOTAL,
    POSTED_REQUEST_BUFFERS, SPILLED_OUTPUT_TTL,
};
pub use error::{Result, RpcError};
pub use hg_bulk::{Bulk, BulkDesc, BulkOp, Span};
/// A peer's address, as `lookup` returns it (re-exported from na-core, so
/// a user of hg-rpc can name it without depending on na-core).
pub use na_core::Addr;
pub use rpc::{rpc_id, Rpc};
pub use runtime::{AsyncBulkCtx, AsyncEngine, DRAIN_RECHECK, DRIVER_FAILURE_GAP, DRIVER_FAILURE_LIMIT};
