//! The origin side of the engine, sending: forwarding calls (and one-way
//! calls), encoding and spilling their inputs, and watching the peers
//! they went to. The outcomes handed to callers and the blocking calls
//! are in `call_wait_ops.rs`; the responses filed in `response_ops.rs`.

use std::time::Instant;

use na_core::hint::cold_path;
use na_core::{Addr, MemHandle, NaError, OpId, Report, Tag};

use super::unsent_response_ops::{returned, Returned};
use super::{
    header, logged_at, request_send_op, response_outcome, Call, CallId, DebugSpan, Engine, OpRole,
    CALL_SEND_COOKIE, CALL_SEND_OP, REQUEST_TAG, RESENT_OP, WATCH_OP, WATCH_TAG,
};
use crate::call_table::NO_CALL;
use crate::codec::Codec;
use crate::error::{Result, RpcError};
use crate::header::{Header, Status, FLAG_CHECKSUM, FLAG_ONE_WAY, FLAG_SPILL, HEADER_LEN};
use crate::notices::Notice;
use crate::rpc::{rpc_id, Rpc};
use crate::spill;

/// The local bulk handles a request's input lent to its target.
type Lent = Box<[MemHandle]>;

impl<C: Codec> Engine<C> {
    /// Encodes a request's input into `self.scratch` and returns its
    /// header. An input too large for an eager message to `dest` (ours
    /// or `dest`'s limit: see `fits_eager`; and not for ourselves) is
    /// exposed read-only and its descriptor takes its place
    /// in `scratch`: the returned handle must live until the target
    /// answered. The message is the header, encoded when it is sent, and
    /// `scratch` (see [`send_scratch`](Self::send_scratch)).
    fn encode_request<R: Rpc>(
        &mut self,
        dest: &Addr,
        input: &R::Input,
        flags: u8,
        cookie: u64,
        to_self: bool,
    ) -> Result<(Header, Option<MemHandle>, Option<Lent>)> {
        // After a spilled input the scratch is the small descriptor: take
        // a large spare buffer instead of growing it again step by step.
        if self.scratch.capacity() < self.max_msg && !self.spare_bufs.is_empty() {
            cold_path();
            if let Some(buf) = self.spare_bufs.pop() {
                self.scratch = buf;
            }
        }
        self.scratch.clear();
        // The local bulk handles the input lends (see `lent`).
        let (encoded, lent) = hg_bulk::collect_lent(|| self.codec.encode(input, &mut self.scratch));
        if let Err(reason) = encoded {
            cold_path();
            return Err(RpcError::Encode {
                rpc: R::NAME.into(),
                what: "input",
                reason,
            });
        }
        let id = rpc_id(R::NAME);
        if to_self || self.fits_eager(dest, HEADER_LEN + self.scratch.len()) {
            // A self-forward never leaves the process: any size goes.
            // A one-way request that fits never becomes a call: its cookie
            // must not be one a later call will have.
            let cookie = if flags & FLAG_ONE_WAY != 0 {
                NO_CALL
            } else {
                cookie
            };
            return Ok((header(flags, Status::Ok, id, cookie), None, lent));
        }
        if let Err(e) = self.admit_spill::<R>(self.scratch.len() as u64) {
            // The refused input must not stay in the scratch at its size.
            self.release_large_scratch();
            return Err(e);
        }
        let payload = std::mem::take(&mut self.scratch);
        let payload = self.fit_for_exposure(payload);
        let seal = self.next_seal();
        let (mem, spilled) = spill::expose(
            &mut self.ep,
            self.plugin,
            payload,
            flags & FLAG_CHECKSUM != 0,
            seal,
        )?;
        let len = HEADER_LEN + spilled.len();
        if !self.fits_eager(dest, len) {
            return Err(RpcError::TooLarge {
                rpc: R::NAME.into(),
                what: "input descriptor",
                len,
                max: self.limit_to(dest),
            });
        }
        self.scratch = spilled;
        Ok((
            header(flags | FLAG_SPILL, Status::Ok, id, cookie),
            Some(mem),
            lent,
        ))
    }

    /// Refuses a spilled input of `len` bytes that would pass the bound of
    /// inputs held for abandoned calls (see `set_max_abandoned_bytes`):
    /// any call may become one, and a one-way call is one at once.
    fn admit_spill<R: Rpc>(&mut self, len: u64) -> Result<()> {
        let held = self.abandoned_bytes;
        if held.saturating_add(len) <= self.max_abandoned_bytes {
            return Ok(());
        }
        self.stats.inputs_refused += 1;
        if len > self.max_abandoned_bytes {
            // Never fits, however many held inputs come back: say so now,
            // not after a caller waited its whole timeout for room.
            return Err(RpcError::TooLarge {
                rpc: R::NAME.into(),
                what: "spilled input (bound: Engine::set_max_abandoned_bytes)",
                len: usize::try_from(len).unwrap_or(usize::MAX),
                max: usize::try_from(self.max_abandoned_bytes).unwrap_or(usize::MAX),
            });
        }
        if logged_at(self.stats.inputs_refused) {
            tracing::warn!(
                rpc = R::NAME,
                len,
                held,
                refused = self.stats.inputs_refused,
                "spilled input refused: too many bytes held for abandoned calls"
            );
        }
        Err(RpcError::InputsHeld {
            rpc: R::NAME.into(),
            len,
            held,
            max: self.max_abandoned_bytes,
        })
    }

    /// Sends header `h` and the payload in `self.scratch` to `dest` as one
    /// unexpected message, written by the transport straight into place.
    /// `op` is the send's id: [`request_send_op`] for a call's request,
    /// a counted `send_op` otherwise.
    pub(super) fn send_scratch(&mut self, dest: &Addr, tag: Tag, h: Header, op: OpId) -> Result<()> {
        let head = h.encode_head(&self.scratch);
        self.ep
            .send_unexpected_parts(dest, tag, &[&head, &self.scratch], op, Report::FailuresOnly)?;
        self.stats.bytes_sent += (HEADER_LEN + self.scratch.len()) as u64;
        Ok(())
    }

    /// Runs a self-forwarded request (header `h`, input in `self.scratch`)
    /// here, without the network; `None` if its handler is deferred.
    fn run_self(&mut self, h: &Header) -> Option<(Header, Vec<u8>)> {
        let input = std::mem::take(&mut self.scratch);
        let me = self.me.clone();
        let r = self.run_decoded(&me, h, &input);
        self.scratch = input;
        // A self-forward's input may be of any size: not kept at it.
        self.release_large_scratch();
        r
    }

    /// Gives a scratch grown past the largest message back (to the spare
    /// buffers, within their bound, else freed) and starts a new one of
    /// message size: only a spilled input may grow it, and that one
    /// leaves it. Called on the cold paths that keep a large input in it
    /// (a self-forward, a spilled input refused).
    fn release_large_scratch(&mut self) {
        if self.scratch.capacity() > self.max_msg {
            let big = std::mem::replace(&mut self.scratch, Vec::with_capacity(self.max_msg));
            self.keep_spare_buffer(big);
        }
    }

    /// Starts a call of `R` on `dest`; see [`take_response`](Self::take_response).
    pub fn forward<R: Rpc>(&mut self, dest: &Addr, input: &R::Input) -> Result<CallId> {
        self.check_plugin::<R>(dest)?;
        // The call is stored (under this cookie) once its request is out.
        let cookie = self.calls.next_cookie();
        let to_self = *dest == self.me;
        let (h, spill, lent) = self.encode_request::<R>(dest, input, self.checksum_flag, cookie, to_self)?;
        let _span =
            DebugSpan::enter(|| tracing::debug_span!("rpc forward", rpc = R::NAME, cookie, dest = %dest));
        if to_self {
            cold_path();
            self.stats.calls += 1;
            // Self-forward: run the handler here, no network (a deferred
            // handler answers later, through `answer`).
            let stored = self.calls.insert(Call {
                rpc: R::NAME,
                peer: None,
                outcome: None,
                abandoned: None,
                spill: None,
                one_way: false,
                response_in_hand: false,
            });
            debug_assert_eq!(stored, cookie);
            if let Some(lent) = lent {
                cold_path();
                self.lent.insert(cookie, lent);
            }
            if let Some((h, p)) = self.run_self(&h) {
                self.file_outcome(cookie, response_outcome(R::NAME, rpc_id(R::NAME), h, p));
                self.finished_self.push_back(cookie);
            }
            return Ok(CallId(cookie));
        }
        self.send_request(dest, R::NAME, cookie, h, spill, false)?;
        self.stats.calls += 1;
        if let Some(lent) = lent {
            cold_path();
            self.lent.insert(cookie, lent);
        }
        Ok(CallId(cookie))
    }

    /// Refuses an address of another plugin than the engine's: the engine
    /// receives on its own plugin only, so the call would never be
    /// answered (and watches, keyed by the plugin's tokens, would mix
    /// peers up).
    #[inline(always)]
    fn check_plugin<R: Rpc>(&self, dest: &Addr) -> Result<()> {
        if dest.plugin() == self.plugin {
            return Ok(());
        }
        cold_path();
        Err(RpcError::ForeignAddress {
            rpc: R::NAME.into(),
            addr: dest.to_string(),
            addr_plugin: dest.plugin().0,
            engine_plugin: self.plugin.0,
        })
    }

    /// Watches `dest` (if not yet), sends the request (header `h`, payload
    /// in `self.scratch`) and records the call.
    #[inline(always)]
    fn send_request(
        &mut self,
        dest: &Addr,
        rpc: &'static str,
        cookie: u64,
        h: Header,
        spill: Option<MemHandle>,
        abandoned: bool,
    ) -> Result<()> {
        let peer = dest.token();
        if self.last_watched != Some(peer) {
            self.watch(dest)?;
        }
        self.send_scratch(dest, REQUEST_TAG, h, request_send_op(cookie))?;
        let call = Call {
            rpc,
            peer: Some(peer),
            outcome: None,
            abandoned: abandoned.then(Instant::now),
            spill,
            one_way: abandoned,
            response_in_hand: false,
        };
        let abandoned_at = call.abandoned;
        if abandoned {
            self.abandoned_bytes += call.spill_len();
        }
        let stored = self.calls.insert(call);
        if let Some(t) = abandoned_at {
            self.abandoned_order.push_back((t, stored));
        }
        debug_assert_eq!(stored, cookie, "cookie announced in the request");
        Ok(())
    }

    /// Posts the watch on `dest` unless it has one (see `watches`).
    pub(super) fn watch(&mut self, dest: &Addr) -> Result<()> {
        let peer = dest.token();
        if !self.watches.contains_key(&peer) {
            let op = OpId(self.op().0 | WATCH_OP);
            self.ep.post_recv_expected(dest, WATCH_TAG, Vec::new(), op)?;
            self.ops.insert(op, OpRole::Watch(peer));
            self.watches.insert(peer, dest.clone());
        }
        self.last_watched = Some(peer);
        Ok(())
    }

    /// The watch on peer `token` completed. A failure means the peer is
    /// gone: every call to it fails with that error (but those whose
    /// spilled output is being read: the read's completion ends them),
    /// and the spilled outputs exposed for it go. A message matching it
    /// is a protocol violation (we never announced the tag): the watch is
    /// posted again.
    pub(super) fn watch_ended(&mut self, token: u64, status: std::result::Result<(), NaError>) {
        let Some(addr) = self.watches.remove(&token) else {
            return;
        };
        if self.last_watched == Some(token) {
            self.last_watched = None;
        }
        let err = match status {
            Ok(()) => {
                self.stats.malformed += 1;
                if logged_at(self.stats.malformed) {
                    tracing::warn!(peer = %addr, malformed = self.stats.malformed, "peer sent a message matching no call; ignored");
                }
                match self.watch(&addr) {
                    Ok(()) => return,
                    Err(e) => NaError::PeerGone {
                        peer: addr.to_string(),
                        reason: format!("cannot watch it again: {}", na_core::ErrorChain(&e)),
                    },
                }
            }
            Err(e) => e,
        };
        let (peer, reason) = match err {
            NaError::PeerGone { peer, reason } => (peer, reason),
            other => (addr.to_string(), other.to_string()),
        };
        // As a target: outputs it will never pull.
        self.release_outputs_of(token, &peer);
        // A call whose spilled output is being read is left to that
        // read: it completes, whatever the peer does (the plugin's
        // contract: every posted operation completes once; na-verbs
        // flushes a dead connection's reads, or fails them when its grace
        // ends; na-sm's reads end in the call), and its own error (the
        // remote key refused, say) is the one to give the caller, not
        // `PeerGone` with that error in its reason only.
        let pulling: Vec<u64> = self
            .ops
            .values()
            .filter_map(|role| match role {
                OpRole::PullOutput(_, cookie) => Some(*cookie),
                _ => None,
            })
            .collect();
        let failed: Vec<u64> = self
            .calls
            .iter()
            .filter(|(cookie, c)| c.peer == Some(token) && c.outcome.is_none() && !pulling.contains(cookie))
            .map(|(cookie, _)| cookie)
            .collect();
        tracing::debug!(%peer, %reason, calls = failed.len(), "peer gone; failing its calls");
        for cookie in failed {
            let e = NaError::PeerGone {
                peer: peer.clone(),
                reason: reason.clone(),
            };
            self.file_outcome(cookie, Err(RpcError::Transport(e)));
        }
        // As an origin: spilled outputs of those calls that waited for
        // room will never be pulled (they no longer wait behind a head
        // that finds none).
        if !self.output_waits.is_empty() {
            self.drop_waiting_outputs_of(token);
        }
    }

    /// A send failed at its completion (see [`RpcStats::sends_failed`]):
    /// the send of a call's request (its id says which, see
    /// [`request_send_op`]) ends that call with the error, as if the send
    /// had failed at once. A response the transport gave back (`msg`, to
    /// `dest`: a failure of that message alone, see
    /// [`Completion::buf`](na_core::Completion::buf)) is answered in its
    /// place, so that its caller learns at once (`response_not_sent`: an
    /// answer from no handler again, else a short error; nothing for a
    /// send that was itself in a lost response's place); a notice given back (a release, or an
    /// acknowledgement of a spilled one-way request) is sent again
    /// (`notice_returned`); any other failed response, notice or one-way
    /// request that fit a message is counted and logged (no call here
    /// waits on it; a response's caller learns of its target's loss by its
    /// watch).
    ///
    /// [`RpcStats::sends_failed`]: crate::RpcStats::sends_failed
    #[inline(never)]
    pub(super) fn send_failed(&mut self, op: OpId, e: NaError, msg: Option<Vec<u8>>, dest: Option<Addr>) {
        self.stats.sends_failed += 1;
        if op.0 & CALL_SEND_OP == 0 {
            if let (Some(msg), Some(dest)) = (msg, dest) {
                // An acknowledgement is a response header too: told apart
                // (see `returned`), it goes again as a notice (no call
                // waits on it).
                match returned(&msg) {
                    Returned::Ack(h) => return self.notice_returned(&dest, Notice::Ack(h), &e),
                    Returned::Response(h, payload) => {
                        let resent = op.0 & RESENT_OP != 0;
                        return self.response_not_sent(&dest, &h, payload, e, resent);
                    }
                    Returned::Release(cookie) => {
                        return self.notice_returned(&dest, Notice::Release(cookie), &e)
                    }
                    Returned::Other => {}
                }
            }
            tracing::debug!(error = %na_core::ErrorChain(&e), "rpc send failed (a response, notice or one-way request)");
            return;
        }
        let bits = op.0 & CALL_SEND_COOKIE;
        // The call in the slot the id names, if its generation matches
        // (one that ended and whose slot was reused is not told).
        let Some(cookie) = self.calls.cookie_in_slot(bits as u32) else {
            return;
        };
        if cookie & CALL_SEND_COOKIE != bits {
            return;
        }
        tracing::debug!(error = %na_core::ErrorChain(&e), cookie, "rpc request send failed; failing its call");
        self.file_outcome(cookie, Err(RpcError::Transport(e)));
    }

    /// Sends a one-way request: no response, no completion to wait for.
    /// Nothing tells the origin when the target is done with bulk handles
    /// the input carries: keep them (do not take their buffers back) until
    /// the application knows it is, or send them in a call instead, whose
    /// handles the engine keeps until the target answers. A spilled input
    /// refused for the inputs held for abandoned calls fails at once with
    /// [`RpcError::InputsHeld`];
    /// [`call_one_way_within`](Self::call_one_way_within) waits for room.
    pub fn forward_one_way<R: Rpc>(&mut self, dest: &Addr, input: &R::Input) -> Result<()> {
        self.check_plugin::<R>(dest)?;
        let to_self = *dest == self.me;
        // Only a spilled one-way request becomes a call (it waits for the
        // target's acknowledgement, under this cookie); one that fits
        // carries NO_CALL (see `encode_request`).
        let cookie = self.calls.next_cookie();
        // Bulk handles the input lends are not kept: nothing tells this
        // origin when the target is done with them (see the doc above).
        let (h, spill, _lent) =
            self.encode_request::<R>(dest, input, self.checksum_flag | FLAG_ONE_WAY, cookie, to_self)?;
        if to_self {
            self.stats.calls += 1;
            if let Some((_, out)) = self.run_self(&h) {
                // No answer: a spare that took the output stays one.
                self.keep_if_large(out);
            }
            return Ok(());
        }
        if spill.is_some() {
            // The target acknowledges a spilled one-way request once it has
            // pulled the input; until then the input must stay exposed.
            self.send_request(dest, R::NAME, cookie, h, spill, true)?;
        } else {
            let op = self.send_op();
            self.send_scratch(dest, REQUEST_TAG, h, op)?;
        }
        self.stats.calls += 1;
        Ok(())
    }
}
