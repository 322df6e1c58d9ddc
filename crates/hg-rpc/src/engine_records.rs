//! What the engine keeps per posted operation ([`OpRole`], and the id
//! bits and tags of the operations that keep their role in the id
//! instead) and per call ([`Call`], the call table [`Calls`], and
//! [`PendingPull`], a request whose spilled input is being pulled, and
//! [`WaitingOutput`], a spilled output waiting for room to be pulled).

use std::time::Instant;

use na_core::{Addr, MemHandle, PluginId, Tag};

use crate::call_table::CallTable;
use crate::deferred::DeferredTicket;
use crate::error::RpcError;
use crate::header::Header;
/// What a posted operation is for, kept in `Engine::ops` by its id.
/// Sends and posted message receives, one or two per message, keep their
/// role in the id instead ([`SEND_OP`], [`REQUEST_OP`]) and have no entry.
pub(super) enum OpRole {
    /// The pull of a spilled request's input (key into `pulls`).
    Pull(u64),
    /// The pull of a spilled response's output (key into `pulls`; cookie).
    PullOutput(u64, u64),
    /// A transfer started with `bulk_start` (its id is the op id), posted
    /// through this plugin, where a cancel goes; its length in bytes (for
    /// `RpcStats::bulk_bytes`).
    Bulk(PluginId, u64),
    /// Such a transfer, given up (`forget_bulk`): its outcome is dropped
    /// (but counted); its length.
    ForgottenBulk(u64),
    /// The watch on a peer we call (its token; see `Engine::watches`).
    Watch(u64),
}

/// Bit of an [`OpId`](na_core::OpId) that marks a send (nothing to do on success).
pub(super) const SEND_OP: u64 = 1 << 63;
/// With [`SEND_OP`]: the send of a call's request, whose id is the call's
/// cookie (its generation cut to the bits left, see [`request_send_op`])
/// instead of a count, so that a send that fails at its completion ends
/// its call (`Engine::send_failed`) without a table entry per send.
pub(super) const CALL_SEND_OP: u64 = 1 << 62;
/// The bits of a cookie a request send's id keeps: the slot index (low 32
/// bits) and the generation's low 30 bits.
pub(super) const CALL_SEND_COOKIE: u64 = CALL_SEND_OP - 1;

/// The id of the send of call `cookie`'s request. Unique among operations
/// in flight: counted ids stay far below bit 62, and two request sends
/// share one only if a slot was reused 2^30 times while the first was in
/// flight.
#[inline(always)]
pub(super) fn request_send_op(cookie: u64) -> na_core::OpId {
    na_core::OpId(SEND_OP | CALL_SEND_OP | (cookie & CALL_SEND_COOKIE))
}

/// With [`SEND_OP`] (and not [`CALL_SEND_OP`]): a send in place of a
/// response that was not sent (the `ResponseNotSent` error, or an answer
/// from no handler sent again, see `unsent_response_ops`). If it fails at
/// its completion too, nothing more is sent for it: no loop, whatever its
/// status. Counted ids stay far below this bit too.
pub(super) const RESENT_OP: u64 = 1 << 61;

/// With [`SEND_OP`] (and not [`CALL_SEND_OP`]): the send of a notice
/// that came back before (failed at its completion, see
/// `UnsentNotices::came_back`). Its send being accepted says nothing of
/// its delivery; its successful completion does (the peer got it), and
/// brings the notices' short retry gap back
/// (`UnsentNotices::delivered`). Counted ids stay far below this bit too.
pub(super) const NOTICE_AGAIN_OP: u64 = 1 << 60;

/// Bit of an [`OpId`](na_core::OpId) that marks a posted unexpected receive (requests
/// for us, and responses to our calls).
pub(super) const REQUEST_OP: u64 = 1 << 62;
/// Bit of an [`OpId`](na_core::OpId) that marks the watch receive on a called peer.
pub(super) const WATCH_OP: u64 = 1 << 61;

/// Tag of request messages (unexpected messages; receivers route on the
/// header's response flag, the tag only helps a reader of traces).
pub(super) const REQUEST_TAG: Tag = 0;
/// Tag of response messages (unexpected messages too).
pub(super) const RESPONSE_TAG: Tag = 1;
/// Tag of the watch receive: an expected receive that no message ever
/// matches; it exists to fail when its peer goes away.
pub(super) const WATCH_TAG: Tag = 0;

/// A request whose spilled input is being pulled from its origin.
pub(super) struct PendingPull {
    pub(super) src: Addr,
    pub(super) header: Header,
    pub(super) mem: MemHandle,
    /// The seal its sender exposed after the data (see `spill`).
    pub(super) seal: u64,
    /// The data's CRC-32C, when its message carried a checksum.
    pub(super) crc: Option<u32>,
    /// A request for a deferred handler: its place under
    /// `set_max_deferred`'s bounds, taken before the pull started.
    pub(super) ticket: Option<DeferredTicket>,
    /// Whose share of the pull budget an input's pull is charged to (see
    /// `pull_share_ops.rs`), kept from its start: the peer may be gone
    /// (and its transport unable to name its process) when it ends.
    /// `None` for an output's pull.
    pub(super) origin: Option<crate::origin::Origin>,
}

impl PendingPull {
    /// The bytes `start_pull` charged to `pull_bytes`: the data, not the
    /// seal pulled after it.
    pub(super) fn charged(&self) -> u64 {
        self.mem.size().saturating_sub(crate::spill::SEAL_LEN)
    }
}

/// A spilled response whose output found no room in this origin's pull
/// budget: its pull waits (in `Engine::output_waits`) until pulls end.
pub(super) struct WaitingOutput {
    /// The target, which keeps the output exposed meanwhile.
    pub(super) src: Addr,
    /// The response's header (its cookie names the call).
    pub(super) header: Header,
    /// The response's payload: the spilled output's descriptor.
    pub(super) payload: Vec<u8>,
}

pub(super) struct Call {
    pub(super) rpc: &'static str,
    /// Token of the target; `None` for a self-forward. A response counts
    /// only if it comes from this peer.
    pub(super) peer: Option<u64>,
    /// The response payload or error, once it arrived. The error is boxed:
    /// an `RpcError` in place would make every call (and every move of
    /// one into the table) several times larger than a payload.
    pub(super) outcome: Option<std::result::Result<Vec<u8>, Box<RpcError>>>,
    /// When the caller gave up (or sent it one-way), if it did. The call
    /// stays until its response comes, since its spilled input is still
    /// exposed to the target, but at most the abandoned-input TTL. The
    /// response is then discarded.
    pub(super) abandoned: Option<Instant>,
    /// The exposed input of a spilled request, kept until the response.
    pub(super) spill: Option<MemHandle>,
    /// A one-way request (spilled): its response is the target's
    /// acknowledgement, expected, not a late answer.
    pub(super) one_way: bool,
    /// A spilled response to it is in hand: its output is being pulled,
    /// or waits for room in the pull budget. Any later response is a
    /// duplicate (a confused or hostile target) and is dropped: it must
    /// neither end the call nor start a second pull.
    pub(super) response_in_hand: bool,
}

/// The call table. Dropped (with the engine) while calls still hold
/// spilled inputs exposed, it breaks their seals first: a pull still to
/// come fails its check instead of taking what the memory holds next.
/// (Every other path that lets an unpulled input go breaks it itself;
/// a `Drop` on `Call` would cost each call out-of-line drop glue.)
#[derive(Default)]
pub(super) struct Calls(CallTable<Call>);

impl std::ops::Deref for Calls {
    type Target = CallTable<Call>;
    fn deref(&self) -> &CallTable<Call> {
        &self.0
    }
}

impl std::ops::DerefMut for Calls {
    fn deref_mut(&mut self) -> &mut CallTable<Call> {
        &mut self.0
    }
}

impl Drop for Calls {
    fn drop(&mut self) {
        for (_, call) in self.0.iter() {
            if let Some(mem) = &call.spill {
                crate::spill::break_seal(mem);
            }
        }
    }
}

impl Call {
    /// Bytes of its exposed input (0 if it did not spill).
    pub(super) fn spill_len(&self) -> u64 {
        // The data; not the seal exposed after it.
        self.spill
            .as_ref()
            .map_or(0, |m| m.size().saturating_sub(crate::spill::SEAL_LEN))
    }
}
