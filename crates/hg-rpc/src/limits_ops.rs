//! The engine's limits and settings: buffers kept for reuse, spill and
//! pull budgets, bounds on deferred requests and exposed outputs, the TTLs
//! of spilled payloads, handler transfer timeouts and checksums.

use std::time::Duration;

use super::Engine;
#[cfg(doc)]
use super::{
    BulkCtx, ABANDONED_INPUT_TTL, BATCH_WINDOW, CHECKSUM_ENV, DEFAULT_HANDLER_TRANSFER_TIMEOUT,
    DEFAULT_MAX_ABANDONED_BYTES, DEFAULT_MAX_DEFERRED_PER_PEER, DEFAULT_MAX_DEFERRED_TOTAL,
    DEFAULT_MAX_EXPOSED_PER_PEER, DEFAULT_MAX_EXPOSED_TOTAL, DEFAULT_MAX_PULL_BYTES, DEFAULT_MAX_SPILL,
    DEFAULT_SPARE_BYTES, SPILLED_OUTPUT_TTL,
};
use crate::codec::Codec;
#[cfg(doc)]
use crate::error::RpcError;
use crate::header::FLAG_CHECKSUM;

impl<C: Codec> Engine<C> {
    /// How many bytes of large buffers (those spilled data was pulled into,
    /// and spilled inputs once released) the engine keeps for the next
    /// spill instead of freeing them; [`DEFAULT_SPARE_BYTES`] unless set,
    /// at most 16 buffers, 0 keeps none. A fresh buffer per spill costs its
    /// page faults: with none kept, 1 MiB calls ran at ~700/s here, with
    /// them kept at ~5,700/s (`hg-perf rate --sizes 1M`; 16 in flight:
    /// ~800/s and ~2,300/s).
    pub fn set_spare_bytes(&mut self, bytes: usize) {
        self.spare_bytes = bytes;
        while self.spare_bufs.iter().map(Vec::capacity).sum::<usize>() > bytes {
            self.spare_bufs.pop();
        }
    }

    /// Largest spilled data this engine pulls: an input as a target (a
    /// bigger one is answered with a decode error) and an output as an
    /// origin (a call whose output is bigger fails with
    /// [`RpcError::OutputTooLarge`] naming the limit). A peer cannot make us
    /// allocate more; raise it on the calling side too for RPCs that
    /// return more than [`DEFAULT_MAX_SPILL`].
    pub fn set_max_spill(&mut self, bytes: u64) {
        self.max_spill = bytes;
    }

    /// How long one transfer call of a handler
    /// ([`BulkCtx::transfer_batch`], [`BulkCtx::transfer`]) may take
    /// before it fails (default [`DEFAULT_HANDLER_TRANSFER_TIMEOUT`]).
    /// Raise it for handlers that move more than the network carries in
    /// that time. The engine serves nothing else while a handler waits;
    /// past the timeout the handler also waits for the transport to end
    /// the transfers it cancels (see [`BulkCtx::transfer_batch`]). With
    /// `Duration::ZERO` every transfer that goes through the transport
    /// fails (its end is reported at a later progress call, even over
    /// na-sm), and so does any batch of more than [`BATCH_WINDOW`] spans.
    pub fn set_handler_transfer_timeout(&mut self, timeout: Duration) {
        self.handler_transfer_timeout = timeout;
    }

    /// Most bytes of spilled data this engine pulls at once (inputs as a
    /// target, outputs as an origin; default [`DEFAULT_MAX_PULL_BYTES`]),
    /// counting the pulled inputs that deferred (async) handlers still
    /// hold: a request stays counted until it is answered or dropped.
    /// Each pull's buffer is allocated when it starts, so without a limit
    /// peers could make the engine commit `max_spill` per message they
    /// send. A spilled request that would pass it now is answered busy
    /// (status 4, [`RpcError::Busy`] at its origin: it may fit later); one
    /// larger than the whole budget, with a decode error (it never fits).
    /// As an origin, a spilled output that finds no room now waits for
    /// it, pulled as soon as pulls in flight end (or deferred requests
    /// holding pulled inputs are answered), within its call's timeout; one
    /// larger than the whole budget fails its call with
    /// [`RpcError::OutputTooLarge`] (the handler ran; no retry can fetch
    /// it). A caller of [`forward`](Self::forward) bounds that wait by
    /// giving up on the call ([`abandon`](Self::abandon)), as
    /// [`call`](Self::call) and `AsyncEngine::call` do at their timeout:
    /// the target is then told to let the output go.
    /// One origin's inputs may take only a share of it
    /// ([`set_max_pull_bytes_per_peer`](Self::set_max_pull_bytes_per_peer),
    /// half unless set). Spilled outputs that wait for room are tried
    /// again at once under the new budget (one that no longer fits it
    /// at all fails its call with [`RpcError::OutputTooLarge`]).
    pub fn set_max_pull_bytes(&mut self, bytes: u64) {
        self.max_pull_bytes = bytes;
        self.pull_budget_freed();
    }

    /// Most bytes of spilled inputs one origin may have this target pull
    /// and hold at once: its pulls in flight plus the pulled inputs its
    /// requests for async handlers hold until answered, within
    /// [`set_max_pull_bytes`](Self::set_max_pull_bytes)'s budget. Unless
    /// set, half of that budget (whatever it is set to), so that one
    /// origin that sends many large-input calls (to slow async handlers
    /// above all) leaves the other half to the others instead of having
    /// each of their spilled requests answered busy. A request past its
    /// origin's share is answered busy (status 4, [`RpcError::Busy`],
    /// counted in `RpcStats::pulls_refused`), before anything is pulled;
    /// an origin that holds none is never refused for its share (only for
    /// the budget), so an input larger than the share still goes alone.
    /// Shares are per origin process where the transport vouches for
    /// the process behind an address (na-sm: the kernel's pid and its
    /// start time, `na_core::Plugin::peer_process`), so that one process
    /// that opens many connections (under many instance names) still
    /// holds one share; per address otherwise (na-verbs). So on na-sm
    /// the calls of every other engine (context) in this engine's own
    /// process hold one share between them, the origin of its
    /// self-forwards too (which pull nothing, but count in the deferred
    /// bound of that origin, see [`set_max_deferred`](Self::set_max_deferred)):
    /// contexts of one process that send each other many large inputs
    /// may need a larger share. Several greedy
    /// processes together may still fill the budget; lower the share for
    /// servers with many clients. Spilled outputs this engine pulls as an
    /// origin count in the budget only (with a floor of their own:
    /// [`set_output_pull_floor`](Self::set_output_pull_floor)).
    pub fn set_max_pull_bytes_per_peer(&mut self, bytes: u64) {
        self.max_pull_per_peer = Some(bytes);
    }

    /// The floor of this engine's own calls' spilled outputs in the pull
    /// budget ([`set_max_pull_bytes`](Self::set_max_pull_bytes)), which
    /// they share with the inputs other origins have us pull and hold:
    /// while the outputs being pulled hold less than `bytes`, an output
    /// that fits under it is pulled even if inputs fill the budget (pulls
    /// then hold at most the budget plus the floor), so that hostile or
    /// merely busy origins cannot starve our own calls (their outputs
    /// would wait for room until the calls time out). Unless set, a
    /// quarter of the budget (whatever it is set to); never above it.
    /// With no inputs held it changes nothing (outputs alone stay within
    /// the budget). Waiting outputs are tried again at once.
    pub fn set_output_pull_floor(&mut self, bytes: u64) {
        self.output_pull_floor = Some(bytes);
        self.pull_budget_freed();
    }

    /// Most requests for asynchronous (deferred) handlers that may wait or
    /// run unanswered at once: from one origin (`per_peer`) and from all
    /// (`total`); defaults [`DEFAULT_MAX_DEFERRED_PER_PEER`] and
    /// [`DEFAULT_MAX_DEFERRED_TOTAL`]. Past either, a request is answered
    /// busy at once (status 4, [`RpcError::Busy`] at its origin; a one-way
    /// request is dropped), never queued: a caller cannot make us queue
    /// requests, and start tasks for them, faster than handlers finish.
    /// A spilled input is checked before it is pulled. An origin is a
    /// process where the transport names it, else an address (as for
    /// [`set_max_pull_bytes_per_peer`](Self::set_max_pull_bytes_per_peer)):
    /// on na-sm this engine's self-forwards and the calls of every other
    /// engine in its own process share one origin's `per_peer` (so a
    /// process of many contexts that forward to one another holds at most
    /// that many deferred requests here between them; raise it to match).
    pub fn set_max_deferred(&mut self, per_peer: usize, total: usize) {
        self.max_deferred = (per_peer, total);
    }

    /// Most bytes of spilled outputs this target keeps exposed for one
    /// origin that has not pulled them yet (`per_peer`), and for all
    /// origins (`total`); defaults [`DEFAULT_MAX_EXPOSED_PER_PEER`] (what
    /// one origin pulls at once by default) and
    /// [`DEFAULT_MAX_EXPOSED_TOTAL`]. An origin that asks for large outputs
    /// and never pulls them would otherwise make us hold each for
    /// [`SPILLED_OUTPUT_TTL`]. A call whose output would pass a bound gets
    /// a handler error that says so (its handler did run). An origin is a
    /// process where the transport names it, else an address (as for
    /// [`set_max_pull_bytes_per_peer`](Self::set_max_pull_bytes_per_peer)):
    /// on na-sm every other engine in this engine's own process shares
    /// one origin's `per_peer` (with its self-forwards, whose outputs are
    /// never spilled).
    pub fn set_max_exposed_bytes(&mut self, per_peer: u64, total: u64) {
        self.exposed.set_limits(per_peer, total);
    }

    /// How long this target keeps a spilled output for an origin that
    /// neither pulls it nor lets it go (default [`SPILLED_OUTPUT_TTL`]).
    /// Past it the output is released; its seal is broken first, so an
    /// origin that pulls later gets an error, never other data. As an
    /// origin, this engine also sends a release its transport refused
    /// (or gave back) again for at most this long: the target's TTL is
    /// not on the wire, and this one stands for it (set them alike).
    pub fn set_spilled_output_ttl(&mut self, ttl: Duration) {
        self.output_ttl = ttl;
    }

    /// How long a spilled input stays exposed for a call this origin gave
    /// up on (a timeout, a dropped future) or sent one-way, when its target
    /// neither answers nor goes away; default [`ABANDONED_INPUT_TTL`].
    /// After it the call is forgotten and the input dropped, its seal
    /// broken first: a target that pulls it later gets an error, never
    /// other data. A new TTL applies to the inputs kept already too,
    /// counted from when each call was given up on. As a target, this
    /// engine also sends the acknowledgement of a pulled spilled one-way
    /// request that its transport refused (or gave back) again for at
    /// most this long from its first failure: the origin's TTL is not on
    /// the wire, and this one stands for it (set them alike; an origin
    /// whose TTL is longer holds the input for the difference).
    pub fn set_abandoned_input_ttl(&mut self, ttl: Duration) {
        self.abandoned_ttl = ttl;
    }

    /// Most bytes of spilled inputs this origin keeps exposed for calls it
    /// gave up on and for one-way calls, until their targets are done with
    /// them (or their TTL ends); default [`DEFAULT_MAX_ABANDONED_BYTES`].
    /// A caller that keeps giving up on large calls to a target that
    /// stopped answering (a short timeout in a retry loop, say) would
    /// otherwise hold every input for the TTL. A call whose spilled input
    /// would pass the bound, added to those held, is refused before
    /// anything is sent, with [`RpcError::InputsHeld`]
    /// (counted in `inputs_refused`); calls that fit a message are never
    /// refused. The bytes come back as the engine is driven (targets
    /// answer, TTLs end in [`trigger`](Self::trigger)): a blocking
    /// [`call`](Self::call) waits for room within its timeout, as do
    /// [`AsyncEngine::call`](crate::AsyncEngine::call) and
    /// [`AsyncEngine::call_one_way_within`](crate::AsyncEngine::call_one_way_within)
    /// (woken by the driver), while [`forward`](Self::forward) and the
    /// other one-way calls refuse at once (drive the engine before trying
    /// again). Give at least [`set_max_spill`](Self::set_max_spill)'s
    /// value, or the largest inputs are always refused.
    ///
    /// The bound is checked when a spilled call is sent, against the
    /// inputs already held: the inputs of calls still in flight are not
    /// counted, so calls in flight that are all given up on at once (a
    /// burst of timeouts) may hold up to the bound plus what they had in
    /// flight, until the next calls are refused and those bytes come back.
    pub fn set_max_abandoned_bytes(&mut self, bytes: u64) {
        self.max_abandoned_bytes = bytes;
    }

    /// Whether this origin's requests carry a CRC-32C of their payload
    /// (header flag bit 2, see `docs/PROTOCOL.md`); off by default, or as
    /// [`CHECKSUM_ENV`] says. A target verifies the checksum of every
    /// message that carries one (a mismatch drops it as malformed) and
    /// answers a request with a checksum by a response with one, whatever
    /// its own setting: the origin chooses, per engine. The default is off,
    /// as in Mercury: both transports deliver bytes intact (shared memory;
    /// RDMA with its link CRC), decoding is bounds-checked either way, and
    /// the checksum costs about 3 % of a busy round trip's instructions
    /// at 0 bytes and a pass over the payload at any size. Turn it on to
    /// catch a peer or a memory fault that corrupts payloads. Spilled
    /// inputs and outputs are covered too: their payload carries the
    /// data's own CRC-32C, checked after the pull.
    pub fn set_checksums(&mut self, on: bool) {
        self.checksum_flag = if on { FLAG_CHECKSUM } else { 0 };
    }

    /// Whether this origin's requests carry a checksum (see
    /// [`set_checksums`](Self::set_checksums)).
    pub fn checksums(&self) -> bool {
        self.checksum_flag != 0
    }
}
