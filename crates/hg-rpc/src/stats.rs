//! The counters an engine keeps, as a user reads them
//! ([`Engine::stats`](crate::Engine::stats)).

#[cfg(doc)]
use crate::{Engine, RpcError, SPILLED_OUTPUT_TTL};

/// Counters of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RpcStats {
    /// Calls forwarded: requests sent, or run here (self-forwards), one-way
    /// ones included. A call whose request did not go out (an error from
    /// `forward`) is not counted.
    pub calls: u64,
    /// Requests taken as target: run by a plain handler, or queued for
    /// an asynchronous one (counted as it is queued, before its handler
    /// runs), and also those answered "unknown RPC", or "busy" for the
    /// bound on deferred requests (also in `deferred_refused`). Not those
    /// refused while draining (`refused_draining`) or before their spilled
    /// input was pulled (`pulls_refused`).
    pub handled: u64,
    /// Calls that ended in an error at the origin: an error taken with
    /// [`Engine::take_response`], a timeout or failed wait of
    /// [`Engine::call`] (or its async twin), and also a call of those
    /// two refused before its request went out (not counted in `calls`;
    /// an error [`Engine::forward`] returns counts nowhere: its caller
    /// has it).
    pub errors: u64,
    /// Calls whose output was taken successfully
    /// ([`Engine::take_response`], [`Engine::call`], or
    /// [`AsyncEngine::call`](crate::AsyncEngine::call)). One-way calls
    /// have no output and never count here.
    ///
    /// Every call counted in `calls` (one-way ones aside) ends as exactly
    /// one of `succeeded`, `errors` or `abandoned`, or is still
    /// `in_flight` or finished with its outcome not taken yet: once
    /// nothing is in flight and every outcome was taken, two-way `calls`
    /// equals `succeeded + abandoned +` the errors of calls whose request
    /// went out.
    pub succeeded: u64,
    /// Calls their caller gave up before taking an outcome:
    /// [`Engine::abandon`], or an [`AsyncEngine::call`](crate::AsyncEngine::call)
    /// future dropped before it finished. A call that timed out counts
    /// in `errors` instead, not here. (What it still holds for its
    /// target is in `abandoned_inputs`; its late response, if any, in
    /// `stray_responses`.)
    pub abandoned: u64,
    /// Malformed messages received: dropped, or (a request whose spilled
    /// input's descriptor fails its checks, a write-only one say, or is
    /// refused by the transport as its pull starts, one naming this
    /// process's memory outside what it exposes say) answered with a
    /// decode error (status 3).
    pub malformed: u64,
    /// Sends the transport accepted but then failed (at their completion:
    /// na-verbs, a message queued before the connection's hello and too
    /// large for the peer's buffer, or whose post failed; either plugin, a
    /// queued message when its peer went). A call's request fails its call
    /// with that error ([`RpcError::Transport`]); a response the
    /// transport gives back (na-verbs, for a failure of that message
    /// alone) is answered with a short error in its place (see
    /// `responses_replaced`); a notice or a one-way request that fit a
    /// message has no call to tell (nothing waits on it: the peer's TTL
    /// frees what it was about).
    pub sends_failed: u64,
    /// Messages of another protocol version received (not counted in
    /// `malformed`): requests are answered with a decode error that names
    /// both versions; a response from a call's target ends that call with
    /// [`RpcError::VersionMismatch`].
    pub version_mismatches: u64,
    /// Bytes of the messages sent (requests, responses and releases of
    /// pulled outputs; headers included).
    pub bytes_sent: u64,
    /// Calls waiting for their response.
    pub in_flight: u64,
    /// Responses that matched no call in flight (late, after a timeout or
    /// a dropped future) and were discarded.
    pub stray_responses: u64,
    /// Spilled outputs this target keeps exposed until their origin pulled
    /// them or let them go (at most [`SPILLED_OUTPUT_TTL`] each).
    pub exposed_outputs: u64,
    /// Bytes of those outputs (bounded, see
    /// [`Engine::set_max_exposed_bytes`]).
    pub exposed_bytes: u64,
    /// Outputs this target did not send because exposing them would pass
    /// a bound of [`Engine::set_max_exposed_bytes`] (their callers got a
    /// handler error).
    pub outputs_refused: u64,
    /// Spilled outputs this target let go because their origin went away
    /// (exited, crashed, lost its connection) before it pulled and
    /// released them: released when the transport reports the departure,
    /// not at [`SPILLED_OUTPUT_TTL`].
    pub outputs_origin_gone: u64,
    /// Calls this origin gave up on (and spilled one-way calls) whose
    /// input it keeps exposed until their target is done with it (at most
    /// the abandoned-input TTL each, see [`Engine::set_abandoned_input_ttl`]):
    /// a spilled input, or local bulk handles the input carried (their
    /// memory stays alive and exposed, and `Bulk::into_buffers` refuses,
    /// until the target answers, goes away, or the TTL ends).
    pub abandoned_inputs: u64,
    /// Bytes of those inputs (bounded, see
    /// [`Engine::set_max_abandoned_bytes`]).
    pub abandoned_bytes: u64,
    /// Calls this origin refused to start because their spilled input
    /// would pass that bound ([`RpcError::InputsHeld`]).
    pub inputs_refused: u64,
    /// Spilled outputs of this origin's calls that waited for room in its
    /// pull budget ([`Engine::set_max_pull_bytes`]) before their pull
    /// started: they found none when they arrived, or arrived behind
    /// others waiting for it (see [`RpcError::OutputTooLarge`] for those
    /// that can never fit).
    pub outputs_waited: u64,
    /// Spilled outputs of this origin's calls that were waiting for room
    /// in its pull budget when their target went away (its calls fail
    /// with `PeerGone`): dropped from the queue then, wherever they stood
    /// in it, not when room came back to the head.
    pub outputs_target_gone: u64,
    /// Responses this target could not send, nor an error in their place
    /// (the caller is gone, or its send backlog, full because it stopped
    /// reading, had no room even for that error): their callers see the
    /// peer go, or time out. Acknowledgements of pulled spilled one-way
    /// requests count here too, each once, when given up: the origin is
    /// gone (or its address no longer valid), their TTL (the
    /// abandoned-input one, [`Engine::set_abandoned_input_ttl`]) passed
    /// while they were sent again, or too many waited for that origin;
    /// it then keeps the input until its own TTL ends.
    pub responses_dropped: u64,
    /// Responses this target could not send (refused at the send call: a
    /// full send backlog to a caller that stopped reading, too large for
    /// the caller; or failed at their completion: na-verbs, a post error,
    /// too large for a peer whose hello came later), each answered in its
    /// place with a short [`RpcError::ResponseNotSent`] error handed to
    /// the transport (an answer from no handler, busy, unknown RPC or
    /// decode error, with itself again, its reason cut short, so that its
    /// caller still learns that nothing ran): their callers learn at once
    /// instead of at their deadline. (Should that fail at its completion
    /// too, nothing more is sent and the response counts in
    /// `responses_dropped` as well.)
    pub responses_replaced: u64,
    /// Spilled requests this target answered "busy" before pulling their
    /// input: the pull budget ([`Engine::set_max_pull_bytes`]), or their
    /// origin's share of it ([`Engine::set_max_pull_bytes_per_peer`]), had
    /// no room for it then.
    pub pulls_refused: u64,
    /// Requests for asynchronous handlers waiting or running unanswered.
    pub deferred_in_flight: u64,
    /// Requests for asynchronous handlers answered "busy" because too many
    /// were unanswered (see [`Engine::set_max_deferred`]).
    pub deferred_refused: u64,
    /// Requests refused because the engine is draining
    /// ([`Engine::begin_drain`]): answered "busy", except one-way requests
    /// with no spilled input, which get no answer.
    pub refused_draining: u64,
    /// Transfers started with [`Engine::bulk_start`] (or
    /// [`Engine::bulk`], [`Engine::bulk_batch`],
    /// [`AsyncEngine::bulk`](crate::AsyncEngine::bulk))
    /// whose end the transport has not reported yet, given-up ones
    /// ([`Engine::forget_bulk`], a dropped future) included: until then
    /// they may still touch their handles' memory.
    pub bulk_in_flight: u64,
    /// Bulk transfers this engine started that ended successfully, one per
    /// span: an origin's ([`Engine::bulk_start`] and every transfer built
    /// on it: [`Engine::bulk`], [`Engine::bulk_batch`],
    /// [`AsyncEngine::bulk`](crate::AsyncEngine::bulk), ...) and its
    /// handlers' ([`BulkCtx`](crate::BulkCtx),
    /// [`AsyncBulkCtx`](crate::AsyncBulkCtx)), given-up ones included,
    /// when their end comes; those served in memory (a handle of this
    /// process, inline data) as they start. A transfer refused at its
    /// start (an error from the call that would start it) counts nowhere,
    /// nor do the engine's own pulls of spilled inputs and outputs.
    pub bulk_done: u64,
    /// Such transfers that ended with an error: failed by the transport,
    /// or canceled (past a timeout, [`Engine::cancel_bulk`],
    /// [`Engine::forget_bulk`], a dropped future). Once none is in flight
    /// (`bulk_in_flight` 0), every transfer started counts in exactly one
    /// of `bulk_done` and `bulk_failed`.
    pub bulk_failed: u64,
    /// Bytes moved by the transfers counted in `bulk_done`.
    pub bulk_bytes: u64,
    /// Times an [`AsyncEngine`](crate::AsyncEngine)'s driver went to sleep
    /// on the endpoint's fd (each costs a kernel wake-up when work comes);
    /// 0 for an engine driven through the blocking API.
    pub driver_sleeps: u64,
    /// Slots of the call table, used or not: its memory grows with the
    /// most calls ever in flight at once, and is given back after a burst,
    /// down to 1,024 slots, when the engine goes idle ([`Engine::try_wait`]
    /// says it may sleep; an [`AsyncEngine`](crate::AsyncEngine)'s driver
    /// asks before each sleep) with at most a quarter of them used: all
    /// at once if none is, else half at a time, each half once the calls
    /// in it have ended (a call keeps its slot).
    pub call_slots: u64,
    /// Bytes of the byte buffers the engine keeps between calls for
    /// encoding, receiving and pulling (its scratch, receive buffer and
    /// spare buffers, by capacity): at most about
    /// [`set_spare_bytes`](Engine::set_spare_bytes) plus a few messages,
    /// whatever sizes the calls had.
    pub buffer_bytes: u64,
}

impl RpcStats {
    /// Counts the end of one bulk transfer of `len` bytes, `ok` or failed.
    pub(crate) fn count_bulk(&mut self, ok: bool, len: u64) {
        if ok {
            self.bulk_done += 1;
            self.bulk_bytes += len;
        } else {
            self.bulk_failed += 1;
        }
    }
}

/// The counters of an engine that it keeps as it works, as a plain
/// handler reads them through [`BulkCtx::stats`](crate::BulkCtx::stats)
/// while it runs: each field is the [`RpcStats`] field of the same name
/// (its meaning is documented there), as it stands at that moment.
///
/// [`RpcStats`]'s other fields are not here: the gauges [`Engine::stats`]
/// reads off the engine's tables as it is called (`in_flight`,
/// `bulk_in_flight`, `exposed_outputs`, `exposed_bytes`,
/// `deferred_in_flight`, `abandoned_inputs`, `abandoned_bytes`,
/// `call_slots`, `buffer_bytes`), which a handler's context does not
/// reach (reaching them would cost every request a few instructions), and
/// `driver_sleeps`, which an [`AsyncEngine`](crate::AsyncEngine)'s driver
/// keeps outside the engine. A handler that needs them reads
/// [`Engine::stats`] (or [`AsyncEngine::stats`](crate::AsyncEngine::stats))
/// once it returned, or runs as an async handler, which may read them.
///
/// A gauge read in a handler is a compile error, not a misleading 0:
///
/// ```compile_fail
/// fn calls_waiting(ctx: &hg_rpc::BulkCtx<'_>) -> u64 {
///     ctx.stats().in_flight
/// }
/// ```
///
/// ```
/// fn requests_taken(ctx: &hg_rpc::BulkCtx<'_>) -> u64 {
///     ctx.stats().handled
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CountedStats {
    /// [`RpcStats::calls`].
    pub calls: u64,
    /// [`RpcStats::handled`].
    pub handled: u64,
    /// [`RpcStats::errors`].
    pub errors: u64,
    /// [`RpcStats::succeeded`].
    pub succeeded: u64,
    /// [`RpcStats::abandoned`].
    pub abandoned: u64,
    /// [`RpcStats::malformed`].
    pub malformed: u64,
    /// [`RpcStats::sends_failed`].
    pub sends_failed: u64,
    /// [`RpcStats::version_mismatches`].
    pub version_mismatches: u64,
    /// [`RpcStats::bytes_sent`].
    pub bytes_sent: u64,
    /// [`RpcStats::stray_responses`].
    pub stray_responses: u64,
    /// [`RpcStats::outputs_refused`].
    pub outputs_refused: u64,
    /// [`RpcStats::outputs_origin_gone`].
    pub outputs_origin_gone: u64,
    /// [`RpcStats::inputs_refused`].
    pub inputs_refused: u64,
    /// [`RpcStats::outputs_waited`].
    pub outputs_waited: u64,
    /// [`RpcStats::outputs_target_gone`].
    pub outputs_target_gone: u64,
    /// [`RpcStats::responses_dropped`].
    pub responses_dropped: u64,
    /// [`RpcStats::responses_replaced`].
    pub responses_replaced: u64,
    /// [`RpcStats::pulls_refused`].
    pub pulls_refused: u64,
    /// [`RpcStats::deferred_refused`].
    pub deferred_refused: u64,
    /// [`RpcStats::refused_draining`].
    pub refused_draining: u64,
    /// [`RpcStats::bulk_done`].
    pub bulk_done: u64,
    /// [`RpcStats::bulk_failed`].
    pub bulk_failed: u64,
    /// [`RpcStats::bulk_bytes`].
    pub bulk_bytes: u64,
}

impl From<&RpcStats> for CountedStats {
    /// The counted fields of `s`. Every field of [`RpcStats`] is named
    /// here, so a field added there must be sorted as counted or not.
    fn from(s: &RpcStats) -> Self {
        let RpcStats {
            calls,
            handled,
            errors,
            succeeded,
            abandoned,
            malformed,
            sends_failed,
            version_mismatches,
            bytes_sent,
            in_flight: _,
            stray_responses,
            exposed_outputs: _,
            exposed_bytes: _,
            outputs_refused,
            outputs_origin_gone,
            abandoned_inputs: _,
            abandoned_bytes: _,
            inputs_refused,
            outputs_waited,
            outputs_target_gone,
            responses_dropped,
            responses_replaced,
            pulls_refused,
            deferred_in_flight: _,
            deferred_refused,
            refused_draining,
            bulk_in_flight: _,
            bulk_done,
            bulk_failed,
            bulk_bytes,
            driver_sleeps: _,
            call_slots: _,
            buffer_bytes: _,
        } = *s;
        CountedStats {
            calls,
            handled,
            errors,
            succeeded,
            abandoned,
            malformed,
            sends_failed,
            version_mismatches,
            bytes_sent,
            stray_responses,
            outputs_refused,
            outputs_origin_gone,
            inputs_refused,
            outputs_waited,
            outputs_target_gone,
            responses_dropped,
            responses_replaced,
            pulls_refused,
            deferred_refused,
            refused_draining,
            bulk_done,
            bulk_failed,
            bulk_bytes,
        }
    }
}
