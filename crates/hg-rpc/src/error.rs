//! The one error type of `hg-rpc`.
//!
//! As in every crate of the workspace, an error either returns its cause
//! from `source()` or writes it in its message, never both:
//! [`RpcError::Transport`] says "transport error" and leaves the
//! [`NaError`] to `source()`. Print errors with their chain
//! ([`na_core::ErrorChain`], anyhow's `{:#}`, `std::error::Report`).

use na_core::NaError;

/// Everything an RPC can fail with. At the origin, each failure has its
/// own variant: the handler's error, a decode error, an unknown RPC, a
/// timeout, or a transport error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The target's handler returned an error.
    #[error("handler of {rpc} failed: {message}")]
    Handler {
        /// The RPC name.
        rpc: String,
        /// The handler's message.
        message: String,
    },
    /// The target has no handler for this RPC.
    #[error("target has no RPC with id {id:#018x} ({rpc})")]
    UnknownRpc {
        /// The RPC name as known at the origin.
        rpc: String,
        /// Its id.
        id: u64,
    },
    /// The target refused the call before running its handler, for lack of
    /// room: too many requests already wait for its async handlers, or
    /// its spilled inputs being pulled would pass its budget. Nothing ran;
    /// the same call may succeed later.
    #[error("target is busy and did not run {rpc}: {reason}")]
    Busy {
        /// The RPC name.
        rpc: String,
        /// The target's message (which bound).
        reason: String,
    },
    /// The target could not send its response to the call (the transport
    /// refused or failed that message while the caller stayed reachable:
    /// its send backlog to the caller full, the caller not reading; a
    /// message too large for the caller's buffers; na-verbs, a post
    /// error) and sent this short error in its place
    /// ([`Status::ResponseNotSent`](crate::header::Status::ResponseNotSent)).
    /// The handler may have run: its output (or its error) is lost. (An
    /// answer given without running the handler, `Busy`, `UnknownRpc` or
    /// `Decode`, is sent again as itself instead, its reason cut short.)
    #[error("{rpc}: the target could not send its response: {reason}")]
    ResponseNotSent {
        /// The RPC name.
        rpc: String,
        /// The target's message: what it failed to send, and why.
        reason: String,
    },
    /// Arguments or results could not be decoded (at either end).
    #[error("decoding {what} of {rpc} failed: {reason}")]
    Decode {
        /// The RPC name.
        rpc: String,
        /// `input` or `output`.
        what: &'static str,
        /// The codec's message.
        reason: String,
    },
    /// Arguments or results could not be encoded.
    #[error("encoding {what} of {rpc} failed: {reason}")]
    Encode {
        /// The RPC name.
        rpc: String,
        /// `input` or `output`.
        what: &'static str,
        /// The codec's message.
        reason: String,
    },
    /// The encoded message does not fit an eager message; or, spilled,
    /// it is larger than the inputs an origin may hold for calls it gave
    /// up on (`Engine::set_max_abandoned_bytes`), so it could never be sent.
    #[error("{what} of {rpc} is {len} bytes encoded; the eager limit is {max}")]
    TooLarge {
        /// The RPC name.
        rpc: String,
        /// `input` or `output`.
        what: &'static str,
        /// Encoded size with header.
        len: usize,
        /// The transport's limit.
        max: usize,
    },
    /// The call's handler ran, but its output spilled (too large for an
    /// eager message) and is larger than this origin ever pulls: than the
    /// largest spilled output it accepts (`Engine::set_max_spill`) or than
    /// its whole pull budget (`Engine::set_max_pull_bytes`). No retry can
    /// fetch it, so it was not pulled (the target was told to let it go);
    /// raise that bound on the calling side to receive such outputs. (An
    /// output that fits the budget but finds no room in it now waits for
    /// room within the call's timeout instead.)
    #[error(
        "{rpc}: the handler ran, but its spilled output of {len} bytes exceeds {bound} of this origin \
         ({max} bytes), so it was not pulled"
    )]
    OutputTooLarge {
        /// The RPC name.
        rpc: String,
        /// Bytes of the output.
        len: u64,
        /// The bound it passes.
        max: u64,
        /// Which bound: the setting that raises it.
        bound: &'static str,
    },
    /// A call was not started: its spilled input, added to the inputs this
    /// origin still holds for calls it gave up on (and one-way calls),
    /// would pass the bound of `Engine::set_max_abandoned_bytes`. Their
    /// targets have not taken them yet; the bytes come back as they answer,
    /// go away, or the abandoned-input TTL ends. `Engine::call`,
    /// `AsyncEngine::call` and `AsyncEngine::call_one_way_within` wait for
    /// that room within their timeout (the async ones woken when the
    /// driver gives bytes back) and give this error, not `Timeout`, only if
    /// none came; `forward`, `forward_one_way` and
    /// `AsyncEngine::call_one_way` give it at once.
    #[error(
        "{rpc}: a spilled input of {len} bytes was refused: {held} bytes of inputs of calls given up on \
         still wait for their targets (bound {max}); try again later"
    )]
    InputsHeld {
        /// The RPC name.
        rpc: String,
        /// Bytes of the refused input.
        len: u64,
        /// Bytes held for abandoned calls.
        held: u64,
        /// The bound.
        max: u64,
    },
    /// A plain handler of an `AsyncEngine` called that engine (`what`). It
    /// runs with the engine locked, so the call would have waited on
    /// itself forever; register it with `register_async` instead.
    #[error(
        "{what} was called from a plain handler of the same AsyncEngine, which runs with the engine locked; \
         register the handler with register_async to call its engine"
    )]
    HandlerReentry {
        /// The method called.
        what: &'static str,
    },
    /// The `AsyncEngine`'s driver task stopped (its tokio runtime shut
    /// down, waiting on the endpoint's fd failed, or
    /// `AsyncEngine::shutdown` was called): nothing moves calls any more,
    /// so this call failed at once instead of at its timeout (and a
    /// registration is refused).
    #[error("{rpc} failed: the engine's driver stopped: {reason}")]
    DriverStopped {
        /// The RPC name.
        rpc: String,
        /// Why it stopped.
        reason: String,
    },
    /// The target speaks another version of the wire protocol
    /// (`docs/PROTOCOL.md`): it answered that it cannot read the request,
    /// so its handler did not run. Upgrade one side.
    #[error(
        "{rpc}: the target speaks RPC protocol version {theirs}, this process version {ours}; nothing ran"
    )]
    VersionMismatch {
        /// The RPC name.
        rpc: String,
        /// The version this crate speaks.
        ours: u8,
        /// The version the target's answer carried.
        theirs: u8,
    },
    /// No response within the call's timeout.
    #[error("{rpc} timed out after {millis} ms")]
    Timeout {
        /// The RPC name.
        rpc: String,
        /// The timeout.
        millis: u128,
    },
    /// The NA layer failed (peer gone, bad address, a transfer the peer's
    /// memory could not take, ...). A bulk transfer's own mistakes (bounds,
    /// access) are [`RpcError::BulkRefused`] instead, never this. The
    /// [`NaError`] is the `source()`, not part of the message: print the
    /// chain ([`na_core::ErrorChain`]).
    #[error("transport error")]
    Transport(#[from] NaError),
    /// The address is of another plugin of the endpoint than the
    /// engine's own: its response would arrive where the engine never
    /// receives. Look addresses up with
    /// [`Engine::lookup`](crate::Engine::lookup), which uses the engine's
    /// plugin.
    #[error("{rpc}: address {addr} is of plugin {addr_plugin}, this engine runs on plugin {engine_plugin}")]
    ForeignAddress {
        /// The RPC name.
        rpc: String,
        /// The address.
        addr: String,
        /// The plugin the address belongs to.
        addr_plugin: u32,
        /// The engine's plugin.
        engine_plugin: u32,
    },
    /// A message from a peer was not a valid RPC message.
    #[error("malformed RPC message: {reason}")]
    Malformed {
        /// What is wrong with it.
        reason: String,
    },
    /// A bulk transfer (or the exposing of memory for one) was refused
    /// before anything moved, for the caller's own arguments, which the
    /// same call will never get past: a range out of either handle's
    /// bounds, an access mode that forbids the direction (pushing from a
    /// write-only handle, pulling into a read-only one, writing a peer's
    /// read-only handle), a local side that is not a handle of this
    /// process, more buffers than one handle can name, a handler's
    /// transfer with a handle its caller does not own, or one through a
    /// handler's context after the handler returned. Do not retry it: fix
    /// the call. (A failure of the transport itself, a peer gone or its
    /// memory not there, is [`RpcError::Transport`].)
    #[error("bulk transfer refused: {reason}")]
    BulkRefused {
        /// Why.
        reason: String,
    },
    /// Registering an RPC failed.
    #[error("cannot register {name}: {reason}")]
    Registration {
        /// The RPC name.
        name: String,
        /// Why.
        reason: String,
    },
}

/// Lets a handler (whose error is a `String`) use `?` on a call that
/// fails with an [`RpcError`]: a [`BulkCtx`](crate::BulkCtx) or
/// [`AsyncBulkCtx`](crate::AsyncBulkCtx) transfer, a nested
/// [`AsyncEngine::call`](crate::AsyncEngine::call), with no
/// `.map_err(|e| e.to_string())`. The string is what the handler's
/// caller receives ([`RpcError::Handler`]), so it is the whole chain
/// ([`na_core::ErrorChain`]: the error and each cause), not the error's
/// message alone.
impl From<RpcError> for String {
    fn from(e: RpcError) -> String {
        na_core::ErrorChain(&e).to_string()
    }
}

/// Result alias of `hg-rpc`.
pub type Result<T, E = RpcError> = std::result::Result<T, E>;

/// Keeps the failure of a batch's first failed span in the spans' order
/// (`at`: the span's index), whatever order the spans end in: the answer
/// of [`Engine::bulk_batch`](crate::Engine::bulk_batch) and
/// [`AsyncEngine::bulk_batch`](crate::AsyncEngine::bulk_batch).
pub(crate) fn keep_first_failure(failure: &mut Option<(usize, RpcError)>, at: usize, r: Result<()>) {
    if let Err(e) = r {
        if failure.as_ref().is_none_or(|(first, _)| at < *first) {
            *failure = Some((at, e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RpcError;
    use na_core::{ErrorChain, NaError};

    /// `Transport` leaves its `NaError` to `source()`; the chain, and the
    /// string a handler's `?` makes of it (all its caller sees), say it
    /// once.
    #[test]
    fn transport_leaves_its_cause_to_the_chain_and_the_string_carries_it() {
        let gone = || {
            RpcError::from(NaError::Rma {
                op: "get",
                len: 64,
                peer: "sm://7-0".into(),
                source: std::io::Error::other("no such process"),
            })
        };
        let e = gone();
        assert_eq!(e.to_string(), "transport error");
        let chain = ErrorChain(&e).to_string();
        assert_eq!(
            chain,
            "transport error: RMA get of 64 bytes to sm://7-0 failed: no such process"
        );
        assert_eq!(String::from(gone()), chain);
    }
}
