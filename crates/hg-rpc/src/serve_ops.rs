//! The target side of the engine: running handlers (now or deferred) and
//! sending responses. Spilled inputs pulled, large outputs exposed and
//! the buffers kept for them are in `serve_spill_ops.rs`.

use na_core::hint::cold_path;
use na_core::{Addr, Report};

use super::{
    logged_at, response_header, response_outcome, BulkCtx, DebugSpan, DeferredRequest, Engine, Handler,
    RESPONSE_TAG,
};
use crate::codec::Codec;
use crate::deferred::DeferredTicket;
use crate::header::{ForeignHeader, Header, Status, FLAG_RESPONSE, FLAG_SPILL, HEADER_LEN, VERSION};
use crate::origin::Origin;
use crate::rpc::rpc_id;
use crate::spill::RELEASE_RPC;
impl<C: Codec> Engine<C> {
    /// Sends a response to `dest`, or files it directly when `dest` is us
    /// (a self-forwarded call answered by a deferred handler).
    pub(super) fn answer(&mut self, dest: &Addr, h: Header, out: Vec<u8>) {
        if *dest != self.me {
            return self.respond(dest, h, out);
        }
        match self.calls.get(h.cookie) {
            Some(c) if c.abandoned.is_none() => {}
            abandoned => {
                // Its caller gave up (a timeout, a dropped future): late, as
                // a response from the network would be, and counted the
                // same. A call kept for the bulk handles its input lent
                // goes now, with them.
                self.stats.stray_responses += 1;
                if abandoned.is_some() {
                    self.file_outcome(h.cookie, Ok(Vec::new()));
                }
                return;
            }
        }
        let outcome = response_outcome(self.call_name(h.cookie), h.rpc_id, h, out);
        self.file_outcome(h.cookie, outcome);
        self.finished_self.push_back(h.cookie);
    }

    /// [`run_decoded`](Self::run_decoded) on an input the engine owns (a
    /// pulled spill): a deferred handler's request takes it as it is,
    /// otherwise its buffer serves the next spill. `origin`: the one its
    /// pull was charged to, which the request's hold is charged to as
    /// well (the transport may name no process for `src` by now: its
    /// connection may have gone since the pull started).
    pub(super) fn run_decoded_owned(
        &mut self,
        src: &Addr,
        h: &Header,
        data: Vec<u8>,
        ticket: Option<DeferredTicket>,
        origin: Option<Origin>,
    ) -> Option<(Header, Vec<u8>)> {
        if let Some(Handler { run: None, .. }) = self.handlers.get(&h.rpc_id) {
            self.stats.handled += 1;
            // Taken before the pull (a handler registered deferred since
            // then has none yet).
            let origin = origin.unwrap_or_else(|| self.origin_of(src));
            let ticket = match ticket.map_or_else(|| self.admit_deferred(origin), Ok) {
                Ok(t) => t,
                Err(why) => {
                    self.keep_spare_buffer(data);
                    return Some((response_header(h, Status::Busy), why.into_bytes()));
                }
            };
            // The pull may have filled a spare far larger than this input;
            // the request would hold all of it for as long as its handler
            // runs, while the budget charges the length. Keep the large
            // buffer as a spare and hand the handler one that fits.
            let (data, spare) = crate::spill::fit_to_len(data);
            if let Some(spare) = spare {
                self.keep_spare_buffer(spare);
            }
            let charge = self.charge_deferred(origin, data.len() as u64);
            self.deferred_requests
                .push_back(DeferredRequest::new(src, h, data, ticket, Some(charge)));
            return None;
        }
        let answer = self.run_decoded(src, h, &data);
        self.keep_spare_buffer(data);
        answer
    }

    /// Runs the handler of request `h` from `src` on its input `payload`;
    /// `None` if the handler is deferred (the request was queued).
    #[inline(always)]
    pub(super) fn run_decoded(
        &mut self,
        src: &Addr,
        h: &Header,
        payload: &[u8],
    ) -> Option<(Header, Vec<u8>)> {
        self.stats.handled += 1;
        let mut ctx = BulkCtx {
            ep: &mut self.ep,
            plugin: self.plugin,
            next_op: &mut self.next_op,
            deferred: &mut self.deferred,
            origin: src,
            any_owner: false,
            transfer_timeout: self.handler_transfer_timeout,
            stats: &mut self.stats,
        };
        let (status, out) = match self.handlers.get_mut(&h.rpc_id) {
            None => {
                cold_path();
                (Status::UnknownRpc, Vec::new())
            }
            Some(Handler { run: None, .. }) => {
                cold_path();
                match self.admit_deferred(self.origin_of(src)) {
                    Ok(ticket) => {
                        self.deferred_requests.push_back(DeferredRequest::new(
                            src,
                            h,
                            payload.to_vec(),
                            ticket,
                            None,
                        ));
                        return None;
                    }
                    Err(why) => (Status::Busy, why.into_bytes()),
                }
            }
            Some(Handler {
                run: Some(run), name, ..
            }) => {
                let _span =
                    DebugSpan::enter(|| tracing::debug_span!("rpc handle", rpc = *name, cookie = h.cookie));
                // A panic becomes a handler error: the caller is answered,
                // and the engine (and a tokio driver running it) lives on.
                // AssertUnwindSafe: the handler stays registered; state it
                // left half-updated is its own (as with a std thread pool).
                // A spare buffer (a released output's, say) takes the
                // output if there is one: a large output then lands in
                // pages already mapped. None on a path of small calls.
                let mut out = self.spare_bufs.pop().unwrap_or_default();
                out.clear();
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&mut ctx, payload, &mut out)
                }));
                let failed = match ran {
                    Ok(Ok(())) => None,
                    Ok(Err(failure)) => Some(failure),
                    Err(p) => {
                        cold_path();
                        Some((
                            Status::HandlerError,
                            format!("the handler of {name} panicked: {}", panic_text(&*p)),
                        ))
                    }
                };
                match failed {
                    None => (Status::Ok, out),
                    // The message goes in the buffer the output would
                    // have: a spare stays one (`respond` keeps it again).
                    Some((status, message)) => {
                        out.clear();
                        out.extend_from_slice(message.as_bytes());
                        (status, out)
                    }
                }
            }
        };
        Some((response_header(h, status), out))
    }

    /// A message arrived (taken in pull mode, or in one of our posted
    /// unexpected receives): a request to serve, or the response to one
    /// of our calls. Returns true for a response.
    #[inline(always)]
    pub(super) fn on_message(&mut self, src: &Addr, msg: &[u8]) -> bool {
        let (h, payload) = match Header::decode(msg) {
            Ok(r) => r,
            Err(e) => {
                cold_path();
                if let Some(f) = ForeignHeader::parse(msg) {
                    return self.on_foreign(src, f);
                }
                // Garbage is not answered (we cannot trust its cookie); count it.
                self.stats.malformed += 1;
                if logged_at(self.stats.malformed) {
                    tracing::warn!(peer = %src, error = %na_core::ErrorChain(&e), malformed = self.stats.malformed, "dropping malformed RPC message");
                }
                return false;
            }
        };
        if h.is_response() {
            self.on_response(src, &h, payload);
            return true;
        }
        if h.rpc_id == rpc_id(RELEASE_RPC) {
            cold_path();
            self.on_release(src, payload);
            return false;
        }
        if self.draining {
            cold_path();
            self.refuse_draining(src, &h);
            return false;
        }
        if h.flags & FLAG_SPILL != 0 {
            cold_path();
            self.on_spilled_request(src, &h, payload);
            return false;
        }
        if let Some((rh, out)) = self.run_decoded(src, &h, payload) {
            if h.is_one_way() {
                // No answer: the buffer (a spare, maybe) stays one, as
                // `respond` would keep it.
                self.keep_if_large(out);
            } else {
                self.respond(src, rh, out);
            }
        }
        false
    }

    /// A message of another protocol version (see `docs/PROTOCOL.md`,
    /// "Other versions"): a request is answered with a decode error that
    /// names both versions; a response ends its call with
    /// [`RpcError::VersionMismatch`](crate::RpcError::VersionMismatch),
    /// if it comes from that call's target. Returns true for a response.
    #[inline(never)]
    fn on_foreign(&mut self, src: &Addr, f: ForeignHeader) -> bool {
        self.stats.version_mismatches += 1;
        let n = self.stats.version_mismatches;
        if logged_at(n) {
            tracing::warn!(peer = %src, theirs = f.version, ours = VERSION, mismatches = n,
                "a peer speaks another RPC protocol version");
        }
        if !f.response {
            let h = Header {
                flags: FLAG_RESPONSE,
                status: Status::DecodeError,
                rpc_id: f.rpc_id,
                cookie: f.cookie,
                payload_len: 0,
                checksum: 0,
            };
            let why = format!(
                "this target speaks RPC protocol version {VERSION}, not version {}",
                f.version
            );
            self.respond(src, h, why.into_bytes());
            return false;
        }
        let cookie = f.cookie;
        let Some(call) = self.calls.get(cookie) else {
            return true;
        };
        // Only the call's target may end it (as for any response), and not
        // while the output of its first response is pulled or waits to be.
        if call.peer != Some(src.token()) || call.outcome.is_some() || call.response_in_hand {
            return true;
        }
        let outcome = if call.abandoned.is_some() {
            // Kept for a spilled input the target will never pull.
            Ok(Vec::new())
        } else {
            Err(crate::RpcError::VersionMismatch {
                rpc: self.call_name(cookie).into(),
                ours: VERSION,
                theirs: f.version,
            })
        };
        self.file_outcome(cookie, outcome);
        true
    }

    /// A release: the origin pulled the spilled output `payload` names,
    /// whose buffer then serves the next large output or pull.
    #[inline(never)]
    fn on_release(&mut self, src: &Addr, payload: &[u8]) {
        if let Ok(c) = <[u8; 8]>::try_from(payload) {
            if let Some(mem) = self.exposed.remove((src.token(), u64::from_le_bytes(c))) {
                self.recycle(mem);
            }
        }
    }

    /// Sends a response. An output over the eager limit is exposed and
    /// described instead (the origin pulls it, then releases it).
    /// An error message over the limit is cut to fit instead (the origin
    /// takes a spilled response as an output only).
    #[inline(always)]
    pub(super) fn respond(&mut self, src: &Addr, h: Header, out: Vec<u8>) {
        let (h, out) = if self.fits_eager(src, HEADER_LEN + out.len()) {
            (h, out)
        } else {
            cold_path();
            self.fit_output(src, h, out)
        };
        // The transport writes header and output straight into place (na-sm:
        // the ring slot; a registered buffer on RDMA).
        let head = h.encode_head(&out);
        let op = self.send_op();
        let sent = self
            .ep
            .send_unexpected_parts(src, RESPONSE_TAG, &[&head, &out], op, Report::FailuresOnly);
        let sent_len = HEADER_LEN + out.len();
        match sent {
            Ok(()) => {
                // A spare that took a small output (copied into the
                // message now).
                self.keep_if_large(out);
                self.stats.bytes_sent += sent_len as u64;
            }
            Err(e) => {
                cold_path();
                self.response_refused(src, &h, out, e);
            }
        }
    }

    /// [`respond`](Self::respond)'s send of response `h` with `out` was
    /// refused by `e`: what goes in its place needs the output (an
    /// answer's reason), which is then kept as a spare if large. Out of
    /// line, so that the busy path keeps no more than before.
    #[cold]
    #[inline(never)]
    fn response_refused(&mut self, src: &Addr, h: &Header, out: Vec<u8>, e: na_core::NaError) {
        self.response_not_sent(src, h, &out, e, false);
        self.keep_if_large(out);
    }
}

/// The text of a panic's payload (what `panic!` was given).
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".into())
}
