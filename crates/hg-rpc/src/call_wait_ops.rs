//! The origin side of the engine, waiting: the outcomes of calls handed
//! to callers ([`Engine::take_response`], the finished log, abandoning),
//! and the blocking calls that drive the engine until their response or
//! timeout ([`Engine::call`], [`Engine::call_one_way_within`]).

use std::time::{Duration, Instant};

use na_core::hint::cold_path;
use na_core::Addr;

use super::{CallId, Engine};
use crate::codec::Codec;
use crate::error::{Result, RpcError};
use crate::rpc::Rpc;

impl<C: Codec> Engine<C> {
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
        } else {
            self.stats.succeeded += 1;
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
    /// A call whose target answered with a spilled output that waits for
    /// room in the pull budget is forgotten, and the target told to let
    /// the output go.
    ///
    /// Counted once in [`RpcStats::abandoned`](super::RpcStats::abandoned)
    /// if the call was still the caller's (not taken, not given up before).
    pub fn abandon(&mut self, id: CallId) {
        if self.calls.get(id.0).is_some_and(|c| c.abandoned.is_none()) {
            self.stats.abandoned += 1;
        }
        self.give_up(id);
    }

    /// [`abandon`](Self::abandon) for a call whose end is counted in
    /// `errors` instead (a timeout, a failed wait): not counted as
    /// abandoned.
    pub(crate) fn give_up(&mut self, id: CallId) {
        if !self.output_waits.is_empty() && self.drop_waiting_output(id.0) {
            // Its spilled output waited for room to be pulled: released.
            return;
        }
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
    /// come back only as it is driven (their targets answer or go away,
    /// which wakes `progress`; or their TTL ends in `trigger`, which
    /// `progress`'s sleep is bounded by, through `next_expiry`), never
    /// from another thread, so each sleep lasts until one of those (or
    /// other traffic), not a fixed recheck. Waiting for room rather than
    /// refusing at once lets a caller that retries make progress. A
    /// failure is counted once in `errors`.
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
                    if let Err(e) = self.progress(Some(left)).and_then(|_| self.trigger()) {
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
    /// most `timeout`. On timeout the call is given up (counted in
    /// [`RpcStats::errors`](crate::RpcStats::errors), not in `abandoned`,
    /// which counts [`abandon`](Self::abandon)): a late response is
    /// discarded. A spilled input refused for the inputs held for abandoned
    /// calls ([`RpcError::InputsHeld`], see
    /// [`set_max_abandoned_bytes`](Self::set_max_abandoned_bytes)) waits for
    /// room within the same timeout, each refused attempt counted in
    /// `inputs_refused`.
    ///
    /// A zero timeout waits for nothing, as
    /// [`AsyncEngine::call`](crate::AsyncEngine::call)'s does: the request
    /// is sent and the call answers only if its answer is there already
    /// (a call to this engine's own address that a plain handler answered
    /// in place); otherwise it fails at once with [`RpcError::Timeout`],
    /// given up (a late response is discarded).
    pub fn call<R: Rpc>(&mut self, dest: &Addr, input: &R::Input, timeout: Duration) -> Result<R::Output> {
        // The timeout covers the whole call, sending included, and a response
        // counts only if it is taken before the deadline: a caller that was
        // descheduled past it gets the timeout, not a late answer.
        let deadline = na_core::deadline_after(timeout);
        let id = self.with_room(deadline, |e| e.forward::<R>(dest, input))?;
        if timeout.is_zero() {
            cold_path();
            // No wait: only an answer already filed counts (below, the
            // deadline has passed before anything is looked at).
            if let Some(r) = self.take_response::<R>(id) {
                return r;
            }
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Forgets the call, or marks it so that a late response is
                // discarded when it comes.
                self.give_up(id);
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
                self.give_up(id);
                self.stats.errors += 1;
                return Err(e);
            }
        }
    }
}
