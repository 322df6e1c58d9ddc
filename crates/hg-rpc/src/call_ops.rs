//! The origin side of the engine: forwarding calls (and one-way calls),
//! watching the peers they went to, filing their responses, and handing
//! the outcomes to callers.

use std::time::{Duration, Instant};

use na_core::hint::cold_path;
use na_core::{Addr, MemHandle, NaError, OpId, Report, Tag};

use super::{
    header, logged_at, response_outcome, Call, CallId, DebugSpan, Engine, OpRole, REQUEST_TAG, WATCH_OP,
    WATCH_TAG,
};
use crate::call_table::NO_CALL;
use crate::codec::Codec;
use crate::error::{Result, RpcError};
use crate::header::{Header, Status, FLAG_CHECKSUM, FLAG_ONE_WAY, FLAG_SPILL, HEADER_LEN};
use crate::rpc::{rpc_id, Rpc};
use crate::spill;

/// How long a blocking `call` refused for held inputs drives the engine
/// before it asks again.
const INPUTS_HELD_RETRY: Duration = Duration::from_millis(10);

/// The local bulk handles a request's input lent to its target.
type Lent = Box<[MemHandle]>;

impl<C: Codec> Engine<C> {
    /// Encodes a request's input into `self.scratch` and returns its
    /// header. An input too large for an eager message (and not for
    /// ourselves) is exposed read-only and its descriptor takes its place
    /// in `scratch`: the returned handle must live until the target
    /// answered. The message is the header, encoded when it is sent, and
    /// `scratch` (see [`send_scratch`](Self::send_scratch)).
    fn encode_request<R: Rpc>(
        &mut self,
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
        if to_self || HEADER_LEN + self.scratch.len() <= self.max_msg {
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
        if len > self.max_msg {
            return Err(RpcError::TooLarge {
                rpc: R::NAME.into(),
                what: "input descriptor",
                len,
                max: self.max_msg,
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
    pub(super) fn send_scratch(&mut self, dest: &Addr, tag: Tag, h: Header) -> Result<()> {
        let head = h.encode_head(&self.scratch);
        let op = self.send_op();
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
        let (h, spill, lent) = self.encode_request::<R>(input, self.checksum_flag, cookie, to_self)?;
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
        self.send_scratch(dest, REQUEST_TAG, h)?;
        let call = Call {
            rpc,
            peer: Some(peer),
            outcome: None,
            abandoned: abandoned.then(Instant::now),
            spill,
            one_way: abandoned,
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
    fn watch(&mut self, dest: &Addr) -> Result<()> {
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
    /// gone: every call to it fails with that error. A message matching it
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
                        reason: format!("cannot watch it again: {e}"),
                    },
                }
            }
            Err(e) => e,
        };
        let (peer, reason) = match err {
            NaError::PeerGone { peer, reason } => (peer, reason),
            other => (addr.to_string(), other.to_string()),
        };
        let failed: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, c)| c.peer == Some(token) && c.outcome.is_none())
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
            self.encode_request::<R>(input, self.checksum_flag | FLAG_ONE_WAY, cookie, to_self)?;
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
            self.send_scratch(dest, REQUEST_TAG, h)?;
        }
        self.stats.calls += 1;
        Ok(())
    }

    /// The result of call `id` if its response arrived (then the call is
    /// finished and forgotten), `None` if it is still in flight.
    pub fn take_response<R: Rpc>(&mut self, id: CallId) -> Option<Result<R::Output>> {
        let outcome = self.calls.remove_if(id.0, |c| c.outcome.is_some())?.outcome?;
        self.forget_lent(id.0);
        // A self-forward's cookie marks work for `progress` until `trigger`;
        // taken here, it is done (the async API never triggers for it).
        if !self.finished_self.is_empty() {
            cold_path();
            if let Some(i) = self.finished_self.iter().rposition(|&c| c == id.0) {
                self.finished_self.remove(i);
            }
        }
        let r = match outcome {
            Ok(payload) => {
                let r = self
                    .codec
                    .decode::<R::Output>(&payload)
                    .map_err(|reason| RpcError::Decode {
                        rpc: R::NAME.into(),
                        what: "output",
                        reason,
                    });
                // A pulled (spilled) output's buffer serves the next pull: a
                // fresh one costs a page fault per page it is written.
                if payload.capacity() > self.max_msg {
                    cold_path();
                    self.keep_spare_buffer(payload);
                }
                r
            }
            Err(e) => Err(*e),
        };
        if r.is_err() {
            cold_path();
            self.stats.errors += 1;
        }
        Some(r)
    }

    /// True if call `id` has its outcome (its response arrived, or it failed).
    pub fn is_finished(&self, id: CallId) -> bool {
        self.calls.get(id.0).is_some_and(|c| c.outcome.is_some())
    }

    /// From now on, keeps the id of every call whose outcome is filed (its
    /// response came, or it failed) for [`take_finished`](Self::take_finished),
    /// so that a caller with many calls in flight learns which finished
    /// without asking [`is_finished`](Self::is_finished) of each. Whoever
    /// turns it on must drain it, or it grows with every call.
    pub fn log_finished(&mut self) {
        self.finished_log.get_or_insert_with(Vec::new);
    }

    /// Moves the calls finished since the last call into `out` (oldest
    /// first), when [`log_finished`](Self::log_finished) is on. An id may
    /// name a call whose response was taken meanwhile, or that was
    /// abandoned: [`take_response`](Self::take_response) then says `None`.
    pub fn take_finished(&mut self, out: &mut Vec<CallId>) {
        if let Some(log) = &mut self.finished_log {
            out.append(log);
        }
    }

    /// Gives up on call `id`: its response, if it ever comes, is discarded.
    /// The call is forgotten at once, unless the target may still be
    /// pulling its spilled input, or transferring to or from bulk handles
    /// its input carried (then it stays, marked, holding them, until the
    /// response or the target's end says they are no longer needed, at
    /// most the abandoned-input TTL: see [`RpcStats::abandoned_inputs`](super::RpcStats::abandoned_inputs)).
    pub fn abandon(&mut self, id: CallId) {
        if let Some(c) = self.calls.get_mut(id.0) {
            if c.outcome.is_some() || (c.spill.is_none() && !self.lent.contains_key(&id.0)) {
                self.calls.remove(id.0);
                self.forget_lent(id.0);
            } else if c.abandoned.is_none() {
                let now = Instant::now();
                c.abandoned = Some(now);
                self.abandoned_bytes += c.spill_len();
                self.abandoned_order.push_back((now, id.0));
            }
        }
    }

    /// Sends a one-way request as [`forward_one_way`](Self::forward_one_way)
    /// does, but a spilled input refused for the inputs held for abandoned
    /// calls ([`RpcError::InputsHeld`]) waits for room, driving the engine,
    /// at most `timeout`, as [`call`](Self::call) does (each refused
    /// attempt counted in `inputs_refused`, a final failure once in
    /// `errors`). A request that is not refused is sent without waiting:
    /// `timeout` bounds only the wait for room (nothing answers a one-way
    /// request).
    pub fn call_one_way_within<R: Rpc>(
        &mut self,
        dest: &Addr,
        input: &R::Input,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = na_core::deadline_after(timeout);
        self.with_room(deadline, |e| e.forward_one_way::<R>(dest, input))
    }

    /// Runs `attempt` (a send) until it is not refused for held inputs or
    /// `deadline` passes, driving the engine between attempts: held inputs
    /// come back only as it is driven (their targets answer, or their TTL
    /// ends in `trigger`). Waiting for room rather than refusing at once
    /// lets a caller that retries make progress. A failure is counted once
    /// in `errors`.
    fn with_room<T>(
        &mut self,
        deadline: Instant,
        mut attempt: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        loop {
            match attempt(self) {
                Ok(t) => return Ok(t),
                Err(RpcError::InputsHeld { .. }) if Instant::now() < deadline => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if let Err(e) = self
                        .progress(Some(left.min(INPUTS_HELD_RETRY)))
                        .and_then(|_| self.trigger())
                    {
                        self.stats.errors += 1;
                        return Err(e);
                    }
                }
                Err(e) => {
                    self.stats.errors += 1;
                    return Err(e);
                }
            }
        }
    }

    /// Calls `R` on `dest` and waits (driving progress) for the result, at
    /// most `timeout`. On timeout the call is abandoned: a late response is
    /// discarded. A spilled input refused for the inputs held for abandoned
    /// calls ([`RpcError::InputsHeld`], see
    /// [`set_max_abandoned_bytes`](Self::set_max_abandoned_bytes)) waits for
    /// room within the same timeout, each refused attempt counted in
    /// `inputs_refused`.
    pub fn call<R: Rpc>(&mut self, dest: &Addr, input: &R::Input, timeout: Duration) -> Result<R::Output> {
        // The timeout covers the whole call, sending included, and a response
        // counts only if it is taken before the deadline: a caller that was
        // descheduled past it gets the timeout, not a late answer.
        let deadline = na_core::deadline_after(timeout);
        let id = self.with_room(deadline, |e| e.forward::<R>(dest, input))?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Forgets the call, or marks it so that a late response is
                // discarded when it comes.
                self.abandon(id);
                self.stats.errors += 1;
                return Err(RpcError::Timeout {
                    rpc: R::NAME.into(),
                    millis: timeout.as_millis(),
                });
            }
            if let Some(r) = self.take_response::<R>(id) {
                return r;
            }
            if let Err(e) = self.progress(Some(left)).and_then(|_| self.trigger()) {
                // The caller gets the error and never this call's result.
                self.abandon(id);
                self.stats.errors += 1;
                return Err(e);
            }
        }
    }

    /// A response (header `h`, payload `p`) arrived from `src`. It counts
    /// only for a call in flight to that same peer: a late one (the call
    /// timed out or its future was dropped) is discarded, and one from
    /// another peer (forged, or a confused peer) is malformed. A discarded
    /// spilled output is released at once (nobody will pull it), so the
    /// target need not keep it for [`SPILLED_OUTPUT_TTL`](super::SPILLED_OUTPUT_TTL).
    #[inline]
    pub(super) fn on_response(&mut self, src: &Addr, h: &Header, p: &[u8]) {
        let cookie = h.cookie;
        let spilled = h.flags & FLAG_SPILL != 0;
        let pulling = self.pulling_output_of(cookie);
        let Some(call) = self.calls.get_mut(cookie) else {
            cold_path();
            self.stats.stray_responses += 1;
            tracing::debug!(peer = %src, cookie, "discarding a response for no call in flight");
            if spilled {
                // Keyed by our address on the target: it can only let go
                // of an output it keeps for us.
                self.release_output(src, cookie);
            }
            return;
        };
        if call.peer != Some(src.token()) || call.outcome.is_some() || pulling {
            cold_path();
            self.stats.malformed += 1;
            if logged_at(self.stats.malformed) {
                tracing::warn!(peer = %src, cookie, malformed = self.stats.malformed, "dropping a response that does not match its call");
            }
            return;
        }
        // (The usual case in the `if`, which the compiler lays out in line:
        // an abandoned call's response is not rare enough to mark cold.)
        if call.abandoned.is_none() {
            if spilled {
                cold_path();
                return self.on_spilled_response(src, h, p);
            }
            let outcome = if h.status == Status::Ok {
                // An empty output (a `()` one) needs no allocation call.
                Ok(if p.is_empty() { Vec::new() } else { p.to_vec() })
            } else {
                cold_path();
                response_outcome(call.rpc, h.rpc_id, *h, p)
            };
            // (`file_outcome`'s filing, on the call found above.)
            if let Some(mem) = file_live(call, cookie, outcome, &mut self.finished_log) {
                cold_path();
                self.recycle(mem);
            }
            return;
        }
        // Kept only because the target might still pull its input (or a
        // one-way call's acknowledgement): the response says it is done.
        // Nobody wants the output: unless it is a one-way request's
        // acknowledgement, it is late, like a response to a call no longer
        // in the table, and counted the same.
        if !call.one_way {
            self.stats.stray_responses += 1;
        }
        if spilled {
            self.release_output(src, cookie);
        }
        // An abandoned call's outcome is dropped, not filed.
        self.file_outcome(cookie, Ok(Vec::new()));
    }

    /// True while the spilled output of call `cookie`'s response is being
    /// pulled. A second response meanwhile (a confused or hostile target,
    /// of this protocol version or another) would start another pull, or
    /// file an outcome the pull then overwrites: both are dropped.
    #[inline]
    pub(super) fn pulling_output_of(&self, cookie: u64) -> bool {
        !self.pulls.is_empty()
            && self
                .pulls
                .values()
                .any(|p| p.header.cookie == cookie && p.header.is_response())
    }

    /// [`on_response`](Self::on_response) of a response whose output
    /// spilled: its output is pulled before the call has its outcome.
    #[inline(never)]
    fn on_spilled_response(&mut self, src: &Addr, h: &Header, p: &[u8]) {
        let cookie = h.cookie;
        let outcome = if h.status != Status::Ok {
            // Error messages are cut to fit a message (see `respond`); only
            // a broken target spills one. Its output is not wanted.
            self.stats.malformed += 1;
            self.release_output(src, cookie);
            Err(RpcError::Malformed {
                reason: "a spilled response must have status ok".into(),
            })
        } else {
            match self.start_pull(src, h, p, true, None) {
                // The outcome is filed when the pull completes.
                Ok(()) => return,
                // The target is gone (it answered, then exited): its
                // death is the outcome, as for its other calls.
                Err(super::serve_ops::PullRefused { gone: Some(e), .. }) => Err(RpcError::Transport(e)),
                // Our own budget, or the target's descriptor: either way
                // the output cannot be had (the handler did run).
                Err(refused) => {
                    self.release_output(src, cookie);
                    Err(RpcError::Decode {
                        rpc: self.call_name(cookie).into(),
                        what: "output",
                        reason: refused.reason,
                    })
                }
            }
        };
        self.file_outcome(cookie, outcome);
    }

    /// The registered name of call `cookie`'s RPC, for error messages.
    pub(super) fn call_name(&self, cookie: u64) -> &'static str {
        self.calls.get(cookie).map_or("?", |k| k.rpc)
    }

    /// Gives call `cookie` its outcome (or forgets it if it was abandoned).
    #[inline(always)]
    pub(super) fn file_outcome(&mut self, cookie: u64, outcome: Result<Vec<u8>>) {
        let Some(call) = self.calls.get_mut(cookie) else {
            return;
        };
        if call.outcome.is_some() {
            // Filed already (the peer's death, then its pull's failure):
            // the first outcome stands, and is logged once.
            return;
        }
        if call.abandoned.is_some() {
            // The target is done with a spilled input: its buffer serves
            // the next large input (or pull) instead of being freed.
            self.abandoned_bytes = self.abandoned_bytes.saturating_sub(call.spill_len());
            let spill = call.spill.take();
            self.calls.remove(cookie);
            self.forget_lent(cookie);
            // `encode_request` exposed one buffer.
            if let Some(mem) = spill {
                self.recycle(mem);
            }
            return;
        }
        if let Some(mem) = file_live(call, cookie, outcome, &mut self.finished_log) {
            cold_path();
            self.recycle(mem);
        }
    }

    /// Lets go of the bulk handles call `cookie` lent, once it has left
    /// the table (a check of an empty map when it lent none).
    #[inline]
    pub(super) fn forget_lent(&mut self, cookie: u64) {
        if !self.lent.is_empty() {
            cold_path();
            self.lent.remove(&cookie);
        }
    }
}

/// Files `outcome` as the outcome of live (not abandoned) call `call`
/// (`cookie`), which has none yet, and logs it as finished for the async
/// driver if it keeps a log. Returns the exposed input of a spilled
/// request: the target is done with it, and its buffer serves the next
/// large input (or pull) instead of being freed.
#[inline(always)]
fn file_live(
    call: &mut Call,
    cookie: u64,
    outcome: Result<Vec<u8>>,
    finished_log: &mut Option<Vec<CallId>>,
) -> Option<MemHandle> {
    // None (the callers checked): nothing to drop.
    call.outcome.get_or_insert(outcome.map_err(Box::new));
    if let Some(log) = finished_log {
        log.push(CallId(cookie));
    }
    call.spill.take()
}
