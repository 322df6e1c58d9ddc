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
//! are encoded by a [`Codec`] ([`Postcard`] by default). Postcard decodes
//! peers' bytes through a guard (nesting depth at most
//! [`codec::MAX_DEPTH`], length hints no larger than the input, elements
//! of zero-sized values bounded by [`codec::ZERO_SIZED_ALLOWANCE`]); the
//! guard protects only that default codec: a [`Codec`] of your own gets
//! no depth or length limits from hg-rpc (see the trait).
//!
//! Two ways to drive it: the blocking API ([`Engine::progress`] +
//! [`Engine::trigger`]) for code that owns its loop, or tokio
//! ([`AsyncEngine`]: calls are futures, one driver task waits on the
//! endpoint's fd). Inputs too large for one eager message spill into a
//! one-sided pull by the target (see `docs/PROTOCOL.md`).
//!
//! Bounds per origin (a caller's share of the pull budget,
//! [`Engine::set_max_pull_bytes_per_peer`]; its deferred requests,
//! [`Engine::set_max_deferred`]; its spilled outputs not yet pulled,
//! [`Engine::set_max_exposed_bytes`]) count *processes* where the
//! transport vouches for the process behind an address
//! (`na_core::Plugin::peer_process`; na-sm: the kernel's pid and its start
//! time), so one process with many connections holds one origin's share;
//! per address otherwise (na-verbs). On na-sm an engine's own process is
//! one origin to it too: its self-forwards and the calls of every other
//! engine (context) of that process share one origin's bounds (the
//! deferred one [`DEFAULT_MAX_DEFERRED_PER_PEER`], 4096, by default).
//! This engine's own calls' outputs keep a floor in the pull budget that
//! others' inputs cannot take ([`Engine::set_output_pull_floor`]).
//!
//! Counters: [`Engine::stats`] ([`RpcStats`]: every call ends in one of
//! `succeeded`, `errors`, `abandoned`; transfers in `bulk_done`,
//! `bulk_failed`, `bulk_bytes`) and [`Engine::transport_stats`]
//! ([`PluginStats`], the transport's own); on tokio the same through
//! [`AsyncEngine`], whose [`try_stats`](AsyncEngine::try_stats) answers
//! `None` where a plain handler holds the engine ([`BulkCtx::stats`]
//! reads its counted fields there, a [`CountedStats`]).
//!
//! Contexts: a context is an [`Engine`] (one per thread or core), each
//! with its own plugin instance and address; a caller picks the target
//! context by its address, and a response comes back to the engine that
//! made the call. Mercury's other form, several contexts behind one
//! address with the target chosen by an id in the header, is not built.
//!
//! Bulk handles inside arguments: the memory of a [`Bulk`] stays exposed
//! as long as the handle lives. An origin keeps the handles its input
//! carried (see [`hg_bulk::collect_lent`]) until the target answers; a
//! handler that returns a local `Bulk` in its *output* must keep a clone
//! of it until the origin is done with it (a later RPC, say): the output
//! is encoded and the handle dropped as the response goes; a pull after
//! that fails over na-verbs (the registration is gone) and, over na-sm,
//! reads whatever the target's memory at that address holds then.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod call_table;
pub mod codec;
mod codec_guard;
mod deferred;
pub mod engine;
mod env_switches;
pub mod error;
mod exposed;
pub mod header;
mod lookup_backoff;
mod notices;
mod origin;
pub mod rpc;
pub mod runtime;
mod spill;
mod stats;
#[allow(unsafe_code)]
mod sys;
pub mod transport;

pub use codec::{Codec, Postcard};
pub use engine::{
    BulkCtx, BulkId, CallId, CountedStats, DeferredRequest, Engine, RpcStats, ABANDONED_INPUT_TTL,
    BATCH_WINDOW, DEFAULT_HANDLER_TRANSFER_TIMEOUT, DEFAULT_MAX_ABANDONED_BYTES,
    DEFAULT_MAX_DEFERRED_PER_PEER, DEFAULT_MAX_DEFERRED_TOTAL, DEFAULT_MAX_EXPOSED_PER_PEER,
    DEFAULT_MAX_EXPOSED_TOTAL, MIN_EAGER_SIZE, POSTED_REQUEST_BUFFERS, SPILLED_OUTPUT_TTL,
};
pub use error::{Result, RpcError};
pub use hg_bulk::{Bulk, BulkDesc, BulkError, BulkOp, Span};
/// What a peer may do with exposed memory (`expose` takes one),
/// re-exported from na-core, as `Addr` is.
pub use na_core::Access;
/// A peer's address, as `lookup` returns it (re-exported from na-core, so
/// a user of hg-rpc can name it without depending on na-core).
pub use na_core::Addr;
/// The transport's counters ([`Engine::transport_stats`]), re-exported
/// from na-core, as `Addr` is.
pub use na_core::PluginStats;
/// How an engine's endpoint waits for work (`Engine::shared_memory`,
/// `Engine::from_spec` take one), re-exported from na-core, as `Addr` is.
pub use na_core::ProgressMode;
pub use rpc::{rpc_id, Rpc};
pub use runtime::{AsyncBulkCtx, AsyncEngine, DRAIN_RECHECK, DRIVER_FAILURE_GAP, DRIVER_FAILURE_LIMIT};
