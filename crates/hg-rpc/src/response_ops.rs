//! The origin side of the engine, receiving: responses filed for the
//! calls in flight to the peers they came from (late ones discarded),
//! spilled outputs pulled (or, with no room in the pull budget, waiting
//! for it), and the outcomes kept for callers.

use na_core::hint::cold_path;
use na_core::{Addr, MemHandle, NaError};

use super::serve_spill_ops::{PullRefused, Refusal};
use super::{logged_at, response_outcome, Call, CallId, Engine, WaitingOutput};

use crate::codec::Codec;
use crate::error::{Result, RpcError};
use crate::header::{Header, Status, FLAG_SPILL};

/// Entries the emptied queue of waiting outputs keeps room for: a burst
/// of waiting outputs (thousands of spilled responses at once) gives the
/// rest of its memory back once the queue is empty.
const KEPT_OUTPUT_WAITS: usize = 16;

impl<C: Codec> Engine<C> {
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
        // A second response while the first one's spilled output is pulled
        // or waits for room (`response_in_hand`) is dropped as malformed, as
        // is one from another peer, or after the outcome.
        if call.peer != Some(src.token()) || call.outcome.is_some() || call.response_in_hand {
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

    /// [`on_response`](Self::on_response) of a response whose output
    /// spilled: its output is pulled before the call has its outcome. One
    /// that finds no room in the pull budget now (other outputs or inputs
    /// being pulled) waits for it: the handler ran, and the target keeps
    /// the output exposed, so it is pulled as soon as pulls end (see
    /// [`pull_waiting_outputs`](Self::pull_waiting_outputs)), within the
    /// call's timeout (a call given up on lets it go at once).
    #[inline(never)]
    fn on_spilled_response(&mut self, src: &Addr, h: &Header, p: &[u8]) {
        let cookie = h.cookie;
        if h.status != Status::Ok {
            // Error messages are cut to fit a message (see `respond`); only
            // a broken target spills one. Its output is not wanted.
            self.stats.malformed += 1;
            self.release_output(src, cookie);
            let outcome = Err(RpcError::Malformed {
                reason: "a spilled response must have status ok".into(),
            });
            return self.file_outcome(cookie, outcome);
        }
        // From now on a second response (a confused or hostile target, of
        // this protocol version or another) is a duplicate, while the
        // output is pulled or waits for room: it would start another pull,
        // or end the call with its own outcome (`on_response`).
        if let Some(call) = self.calls.get_mut(cookie) {
            call.response_in_hand = true;
        }
        if !self.output_waits.is_empty() {
            // Behind those that wait: the first to come is pulled first.
            self.wait_for_room(src, h, p);
            return self.pull_waiting_outputs();
        }
        if let Err(refused) = self.start_pull(src, h, p, true, None) {
            match self.refused_output(src, cookie, refused) {
                Some(e) => self.file_outcome(cookie, Err(e)),
                None => self.wait_for_room(src, h, p),
            }
        }
        // Else the outcome is filed when the pull completes.
    }

    /// Queues spilled response `h` (payload `p`, from `src`) behind the
    /// outputs that wait for room in the pull budget.
    #[cold]
    fn wait_for_room(&mut self, src: &Addr, h: &Header, p: &[u8]) {
        self.stats.outputs_waited += 1;
        tracing::debug!(peer = %src, cookie = h.cookie, "spilled output waits for room in the pull budget");
        self.output_waits.push_back(WaitingOutput {
            src: src.clone(),
            header: *h,
            payload: p.to_vec(),
        });
    }

    /// The error a call gets for the pull of its spilled output (from
    /// `src`) refused, or `None` when the pull may start later (no room
    /// in the budget now).
    #[cold]
    fn refused_output(&mut self, src: &Addr, cookie: u64, refused: PullRefused) -> Option<RpcError> {
        let rpc = self.call_name(cookie);
        let e = match refused.why {
            Refusal::NoRoom => return None,
            // The target is gone (it answered, then exited): its death is
            // the outcome, as for its other calls.
            Refusal::Transport(e @ NaError::PeerGone { .. }) => return Some(RpcError::Transport(e)),
            Refusal::Transport(e) => RpcError::Transport(e),
            // No retry can fit it: the handler did run, but its output
            // cannot be had with this origin's bounds.
            Refusal::TooLarge { len, max, setting } => RpcError::OutputTooLarge {
                rpc: rpc.into(),
                len,
                max,
                bound: setting,
            },
            Refusal::Malformed => {
                self.stats.malformed += 1;
                RpcError::Malformed {
                    reason: format!("spilled response of {rpc}: {}", refused.reason),
                }
            }
        };
        self.release_output(src, cookie);
        Some(e)
    }

    /// Room in the pull budget may have come back: a pull ended, the
    /// budget was set anew, or a deferred request that held a pulled
    /// input was answered (or dropped unanswered: its drop wakes the
    /// sleeper, see `register_ops::ReturnWake`, and `try_wait` and
    /// `progress` notice it). The
    /// spilled outputs that wait for room are tried again. Every place
    /// that gives pull budget back calls this one helper, so that no
    /// waiting output is left for an unrelated pull's end or its call's
    /// timeout; with none waiting it costs one check.
    #[inline(always)]
    pub(super) fn pull_budget_freed(&mut self) {
        if !self.output_waits.is_empty() {
            cold_path();
            self.pull_waiting_outputs();
        }
    }

    /// Tries the waiting spilled outputs again (see
    /// [`pull_budget_freed`](Self::pull_budget_freed)); true if any left
    /// the queue (its pull started, or it was released or failed).
    #[cold]
    #[inline(never)]
    pub(super) fn retry_waiting_outputs(&mut self) -> bool {
        let before = self.output_waits.len();
        self.pull_waiting_outputs();
        self.output_waits.len() < before
    }

    /// Starts the pulls of the spilled outputs that wait for room in the
    /// pull budget, oldest first, until one finds none (it stays first).
    /// Called through [`pull_budget_freed`](Self::pull_budget_freed) when
    /// room may have come back. An output whose
    /// call no longer wants it (given up on, or ended by its target's
    /// death) is released instead.
    #[cold]
    #[inline(never)]
    pub(super) fn pull_waiting_outputs(&mut self) {
        while let Some(w) = self.output_waits.pop_front() {
            let cookie = w.header.cookie;
            let wanted = self
                .calls
                .get(cookie)
                .is_some_and(|c| c.outcome.is_none() && c.abandoned.is_none());
            if !wanted {
                self.release_output(&w.src, cookie);
                continue;
            }
            if let Err(refused) = self.start_pull(&w.src, &w.header, &w.payload, true, None) {
                match self.refused_output(&w.src, cookie, refused) {
                    Some(e) => self.file_outcome(cookie, Err(e)),
                    None => {
                        self.output_waits.push_front(w);
                        break;
                    }
                }
            }
        }
        self.shrink_emptied_output_waits();
    }

    /// Peer `token` is gone (its watch failed, and its calls with it):
    /// the spilled outputs of its calls that wait for room leave the queue
    /// now, their descriptors freed, wherever they stand in it (behind a
    /// head that still finds no room, they would stay until room came).
    /// No release is sent: the target's memory went with it. (A call given
    /// up on leaves at once too: [`abandon`](Self::abandon),
    /// `drop_waiting_output`. Nothing else makes a waiting output
    /// unwanted: the origin is this engine, and a call in the queue has
    /// no outcome until its pull, its target's death, or its refusal.)
    #[cold]
    #[inline(never)]
    pub(super) fn drop_waiting_outputs_of(&mut self, token: u64) {
        let before = self.output_waits.len();
        self.output_waits.retain(|w| w.src.token() != token);
        self.stats.outputs_target_gone += (before - self.output_waits.len()) as u64;
        self.output_waits_left();
    }

    /// Outputs left the queue outside a retry.
    #[inline]
    fn output_waits_left(&mut self) {
        self.shrink_emptied_output_waits();
    }

    /// An emptied queue of waiting outputs keeps room for
    /// [`KEPT_OUTPUT_WAITS`] entries, no more (capacity grown by a burst
    /// goes back).
    fn shrink_emptied_output_waits(&mut self) {
        if self.output_waits.is_empty() && self.output_waits.capacity() > KEPT_OUTPUT_WAITS {
            self.output_waits.shrink_to(KEPT_OUTPUT_WAITS);
        }
    }

    /// Call `cookie` is given up on: if its spilled output waits for room
    /// to be pulled, the target is told to let it go, and the call, which
    /// its target answered (so is done with its input and lent handles),
    /// is forgotten. False if its output does not wait. (Those behind it
    /// are tried at the next `try_wait`: the release notice's send
    /// completion wakes a sleeping driver.)
    #[cold]
    #[inline(never)]
    pub(super) fn drop_waiting_output(&mut self, cookie: u64) -> bool {
        let Some(i) = self.output_waits.iter().position(|w| w.header.cookie == cookie) else {
            return false;
        };
        if let Some(w) = self.output_waits.remove(i) {
            self.release_output(&w.src, cookie);
        }
        self.output_waits_left();
        if let Some(call) = self.calls.remove(cookie) {
            if let Some(mem) = call.spill {
                self.recycle(mem);
            }
        }
        self.forget_lent(cookie);
        true
    }

    /// Spilled outputs of calls in flight that wait for room in the pull
    /// budget now (for tests; not a stable API).
    #[doc(hidden)]
    pub fn outputs_waiting(&self) -> usize {
        self.output_waits.len()
    }

    /// Bytes the spilled outputs that wait for room hold in this engine
    /// (their descriptors, as the responses brought them), for tests; not
    /// a stable API.
    #[doc(hidden)]
    pub fn output_wait_bytes(&self) -> usize {
        self.output_waits.iter().map(|w| w.payload.capacity()).sum()
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

#[cfg(test)]
mod tests {
    use super::KEPT_OUTPUT_WAITS;
    use crate::engine::test_support::{queue_unwanted_output, sm_pair};

    /// A burst of waiting outputs that all leave the queue gives its
    /// memory back: the emptied queue keeps room for a few only.
    #[test]
    fn an_emptied_queue_of_waiting_outputs_gives_a_burst_s_room_back() {
        let (dir, _srv, mut c, s) = sm_pair("output-waits-shrink");
        for cookie in 0..1_000 {
            queue_unwanted_output(&mut c, &s, 0x5eed_0000 + cookie);
        }
        assert!(c.output_waits.capacity() >= 1_000);
        // Budget back: every one of them is unwanted (no call of ours),
        // released, and the queue empties.
        c.pull_waiting_outputs();
        assert_eq!(c.output_waits.len(), 0);
        assert!(
            c.output_waits.capacity() <= KEPT_OUTPUT_WAITS,
            "the emptied queue still holds room for {} outputs",
            c.output_waits.capacity()
        );
        // And a queue emptied outside a retry (its target gone) too.
        for cookie in 0..1_000 {
            queue_unwanted_output(&mut c, &s, 0x5eed_1000 + cookie);
        }
        c.drop_waiting_outputs_of(s.token());
        assert_eq!(c.output_waits.len(), 0);
        assert!(c.output_waits.capacity() <= KEPT_OUTPUT_WAITS);
        drop(c);
        let _ = std::fs::remove_dir_all(dir);
    }
}
