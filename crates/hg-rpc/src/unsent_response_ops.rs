//! The target side of a response that could not be sent: at the send
//! call, or at its completion (na-verbs gives the message and its
//! destination back in the failed completion, see
//! [`Completion::buf`](na_core::Completion::buf)). Unless its caller is
//! gone, something goes to the same call in its place, so that the caller
//! learns now, not at its deadline (nor never, without one): an answer
//! from no handler (busy, unknown RPC, decode error: small, and telling
//! the caller that nothing ran) goes again as it was, its reason cut to
//! [`RESENT_REASON_MAX`] (unless it was refused at the send call for a
//! full backlog and would go unchanged: refused again for certain, it is
//! dropped at once); any other (a handler's output or error) is
//! replaced by the short [`Status::ResponseNotSent`] error ("the handler
//! may have run"). If that send fails too, it is counted and logged, and
//! nothing else is sent (no loop: its id carries [`RESENT_OP`]). A
//! spilled output the lost response described is let go.
//!
//! Nothing here costs the busy path: a response's send keeps a counted id
//! and no record. What goes in its place (the destination, the cookie,
//! the RPC id, the status, an answer's reason) is read back from the
//! failed message itself, on the failure: [`returned`] tells what a
//! message given back was, decoding its header once.

use na_core::{Addr, NaError, OpId, Report};

use super::serve_spill_ops::truncate_message;
use super::{logged_at, response_header, Engine, RESENT_OP, RESPONSE_TAG};
use crate::codec::Codec;
use crate::header::{Header, Status, FLAG_SPILL, HEADER_LEN};
use crate::rpc::rpc_id;
use crate::spill::RELEASE_RPC;

/// Most bytes of the reason a [`Status::ResponseNotSent`] error carries:
/// the error must fit where its response did not (a peer's buffer
/// smaller than an engine's, say), so it stays far under any message
/// limit.
pub(super) const NOT_SENT_REASON_MAX: usize = 192;

/// Most bytes of the reason an answer from no handler keeps when it goes
/// again (see [`Status::ran_no_handler`]): under the reasons the engine
/// gives for most of them (a busy answer names its bound in 70 to 170
/// bytes), so that the second try is a shorter message than the first,
/// as the error in an output's place is; the status, which the caller
/// acts on, is kept whole.
///
/// Public (hidden) only so that the tests of the cut
/// (`tests/full_backlog.rs`) read this value instead of a copy that a
/// change of it would leave stale; not a stable API.
#[doc(hidden)]
pub const RESENT_REASON_MAX: usize = 96;

/// What a message the transport gave back (a send that failed at its
/// completion) was, told from its header, decoded once.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Returned<'a> {
    /// A target's acknowledgement of a pulled spilled one-way request (a
    /// response header with the one-way flag and no payload, see
    /// [`acknowledge_one_way`](Engine::acknowledge_one_way)): a notice,
    /// sent again as one. Told apart first: it is a response header too.
    Ack(Header),
    /// A response of ours (a response's flags never carry the one-way
    /// bit), with its payload (an output, a reason, or a spilled output's
    /// descriptor).
    Response(Header, &'a [u8]),
    /// A release notice of ours, with the cookie it releases.
    Release(u64),
    /// Anything else: a request, or bytes that are not a message of this
    /// version.
    Other,
}

/// Tells what `msg`, a message the transport gave back, was: one decode
/// of its header, then the flags.
pub(super) fn returned(msg: &[u8]) -> Returned<'_> {
    let Ok((h, payload)) = Header::decode(msg) else {
        return Returned::Other;
    };
    let one_way = h.is_one_way();
    if h.is_response() {
        if one_way && payload.is_empty() {
            Returned::Ack(h)
        } else {
            Returned::Response(h, payload)
        }
    } else if one_way && h.rpc_id == rpc_id(RELEASE_RPC) {
        Returned::Release(h.cookie)
    } else {
        Returned::Other
    }
}

impl<C: Codec> Engine<C> {
    /// Response `h` with `payload` to `dest` was not sent: `e` refused it
    /// at the send call, or failed it at its completion. Its spilled
    /// output, if it had one, is let go (its seal broken: nobody learned
    /// of it). A caller that is gone (`PeerGone`: its engine's watch on us
    /// fails its calls) or a send that was itself in a lost response's
    /// place (`resent`, or a `ResponseNotSent` error) gets nothing more:
    /// the response counts as dropped ([`RpcStats::responses_dropped`]).
    /// Any other gets a send in its place (see the module's doc;
    /// [`RpcStats::responses_replaced`]).
    ///
    /// [`RpcStats::responses_dropped`]: crate::RpcStats::responses_dropped
    /// [`RpcStats::responses_replaced`]: crate::RpcStats::responses_replaced
    #[cold]
    #[inline(never)]
    pub(super) fn response_not_sent(
        &mut self,
        dest: &Addr,
        h: &Header,
        payload: &[u8],
        e: NaError,
        resent: bool,
    ) {
        if h.flags & FLAG_SPILL != 0 {
            // Should a transport ever publish before it fails, a pull
            // still to come is refused, as on every other way out.
            if let Some(mem) = self.exposed.remove((dest.token(), h.cookie)) {
                crate::spill::break_seal(&mem);
            }
        }
        let gone = matches!(e, NaError::PeerGone { .. });
        let resent = resent || h.status == Status::ResponseNotSent;
        let len = HEADER_LEN + payload.len();
        let replaced = !gone && !resent && self.send_in_place(dest, h, payload, &e);
        if replaced {
            self.stats.responses_replaced += 1;
            let n = self.stats.responses_replaced;
            if logged_at(n) {
                tracing::warn!(peer = %dest, error = %na_core::ErrorChain(&e), len, cookie = h.cookie, status = ?h.status, replaced = n,
                    "cannot send RPC response; told its caller instead");
            }
            return;
        }
        self.stats.responses_dropped += 1;
        // A caller that stopped reading makes every response fail: warn
        // at 1, 2, 4, 8... of them, not once per request.
        let dropped = self.stats.responses_dropped;
        if logged_at(dropped) {
            tracing::warn!(peer = %dest, error = %na_core::ErrorChain(&e), dropped, status = ?h.status, "cannot send RPC response");
        } else {
            tracing::debug!(peer = %dest, error = %na_core::ErrorChain(&e), dropped, status = ?h.status, "cannot send RPC response");
        }
    }

    /// Sends `dest` what goes in place of response `h` with `payload`,
    /// which failed with `e`: the same answer, its reason cut to
    /// [`RESENT_REASON_MAX`], if no handler ran; else the
    /// [`Status::ResponseNotSent`] error. False if the transport refused
    /// it too (its failure at completion comes back to
    /// [`response_not_sent`](Self::response_not_sent) with the
    /// [`RESENT_OP`] bit in its id, which sends nothing for it).
    ///
    /// An answer from no handler whose reason is short already would go
    /// again unchanged: refused at the send call for a full backlog
    /// ([`NaError::SendBacklogFull`]), the same message is refused again
    /// (the backlog and its bound are as they were), so it is not tried.
    fn send_in_place(&mut self, dest: &Addr, h: &Header, payload: &[u8], e: &NaError) -> bool {
        if h.status.ran_no_handler()
            && payload.len() <= RESENT_REASON_MAX
            && matches!(e, NaError::SendBacklogFull { .. })
        {
            tracing::debug!(peer = %dest, status = ?h.status,
                "an answer refused for a full backlog would go again unchanged; not tried");
            return false;
        }
        let (status, reason) = if h.status.ran_no_handler() {
            let mut reason = payload.to_vec();
            if reason.len() > RESENT_REASON_MAX {
                truncate_message(&mut reason, RESENT_REASON_MAX);
            }
            (h.status, reason)
        } else {
            let len = HEADER_LEN + payload.len();
            let mut reason = format!(
                "its response ({:?}, {len} bytes) failed: {}",
                h.status,
                na_core::ErrorChain(&e)
            )
            .into_bytes();
            if reason.len() > NOT_SENT_REASON_MAX {
                truncate_message(&mut reason, NOT_SENT_REASON_MAX);
            }
            (Status::ResponseNotSent, reason)
        };
        // `response_header` keeps the checksum flag of the header it is
        // given, as the lost response had it from its request.
        let head = response_header(h, status).encode_head(&reason);
        let op = OpId(self.send_op().0 | RESENT_OP);
        let sent =
            self.ep
                .send_unexpected_parts(dest, RESPONSE_TAG, &[&head, &reason], op, Report::FailuresOnly);
        match sent {
            Ok(()) => {
                self.stats.bytes_sent += (HEADER_LEN + reason.len()) as u64;
                true
            }
            Err(e2) => {
                tracing::debug!(peer = %dest, error = %na_core::ErrorChain(&e2), ?status,
                    "cannot send what goes in place of a lost response either");
                false
            }
        }
    }
}

#[cfg(test)]
#[path = "unsent_response_tests.rs"]
mod tests;
