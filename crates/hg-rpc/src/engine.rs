//! The RPC engine: registry, calls in flight, and the blocking progress API.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use na_core::fasthash::FastMap;
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, Endpoint, MemHandle, OpId, PluginId};

use crate::codec::{Codec, Postcard};
use crate::deferred::DeferredLedger;
pub use crate::deferred::{DEFAULT_MAX_DEFERRED_PER_PEER, DEFAULT_MAX_DEFERRED_TOTAL};
use crate::error::{Result, RpcError};
use crate::exposed::ExposedOutputs;
pub use crate::exposed::{DEFAULT_MAX_EXPOSED_PER_PEER, DEFAULT_MAX_EXPOSED_TOTAL};
use crate::header::FLAG_CHECKSUM;

/// How long a target keeps a spilled output exposed for an origin that
/// never confirms it pulled it (it died, or broke the protocol).
pub const SPILLED_OUTPUT_TTL: Duration = Duration::from_secs(60);

/// How long, by default, an origin keeps the spilled input of a call it
/// gave up on (or of a one-way call) for a target that neither answers nor
/// goes away (see [`Engine::set_abandoned_input_ttl`]).
pub const ABANDONED_INPUT_TTL: Duration = Duration::from_secs(60);

/// Repeated warnings are logged at 1, 2, 4, 8... of them; the counters in
/// [`RpcStats`] have every one.
pub(crate) use na_core::logged_at;

/// How often `trigger` looks for expired outputs and abandoned inputs.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The least `abandoned_compact_at`: entries of ended calls up to this
/// many wait for the sweep to reach them at the front.
pub(crate) const MIN_COMPACT: usize = 1024;

/// Unexpected receives the engine keeps posted for incoming requests and
/// the responses to its calls, on a transport without pull mode; with it,
/// the most messages one [`Engine::trigger`] takes.
pub const POSTED_REQUEST_BUFFERS: usize = 64;

/// Default for [`Engine::set_spare_bytes`].
pub const DEFAULT_SPARE_BYTES: usize = 16 << 20;

/// The least message size an engine accepts, header included: an engine
/// refuses a plugin whose unexpected or expected messages are smaller
/// (na-verbs: `VerbsConfig::max_msg_size`, `QS_VERBS_MAX_MSG_SIZE`). So
/// every peer engine takes messages of this size, and one no larger goes
/// out eagerly without asking the plugin for the destination's own limit
/// (see [`na_core::Plugin::max_unexpected_size_to`]): the busy path of
/// small calls pays nothing for peers whose limits differ.
pub const MIN_EAGER_SIZE: usize = 1024;

// na-verbs refuses a `QS_VERBS_MAX_MSG_SIZE` below this very size, so
// every value the variable takes makes a plugin an engine accepts.
#[cfg(feature = "verbs")]
const _: () = assert!(na_verbs::config_env::ENV_MAX_MSG_SIZE_FLOOR == MIN_EAGER_SIZE);

/// Default largest spilled input a target accepts, and spilled output an
/// origin accepts (see [`Engine::set_max_spill`]).
pub const DEFAULT_MAX_SPILL: u64 = 64 << 20;

/// Default of [`Engine::set_max_pull_bytes`]: 16 pulls of the largest
/// spill at once.
pub const DEFAULT_MAX_PULL_BYTES: u64 = 16 * DEFAULT_MAX_SPILL;

/// Default of [`Engine::set_max_abandoned_bytes`]: the inputs of 16 calls
/// of the largest spill given up on.
pub const DEFAULT_MAX_ABANDONED_BYTES: u64 = 16 * DEFAULT_MAX_SPILL;

#[path = "bulk_ctx.rs"]
mod bulk_ctx;
#[path = "bulk_ops.rs"]
mod bulk_ops;
#[path = "bulk_wait_ops.rs"]
mod bulk_wait_ops;
#[path = "call_ops.rs"]
mod call_ops;
#[path = "call_wait_ops.rs"]
mod call_wait_ops;
#[path = "debug_span.rs"]
mod debug_span;
#[path = "drain_ops.rs"]
mod drain_ops;
#[path = "engine_records.rs"]
mod engine_records;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
#[path = "fuzzing.rs"]
pub mod fuzzing;
#[path = "limits_ops.rs"]
mod limits_ops;
#[path = "notice_ops.rs"]
mod notice_ops;
#[path = "progress_ops.rs"]
mod progress_ops;
#[path = "pull_share_ops.rs"]
mod pull_share_ops;
#[path = "register_ops.rs"]
mod register_ops;
#[path = "response_ops.rs"]
mod response_ops;
#[path = "serve_ops.rs"]
pub(crate) mod serve_ops;
#[path = "serve_spill_ops.rs"]
mod serve_spill_ops;
#[cfg(test)]
#[path = "engine_test_support.rs"]
pub(crate) mod test_support;
#[path = "unsent_response_ops.rs"]
mod unsent_response_ops;
#[path = "wire_headers.rs"]
mod wire_headers;

use crate::env_switches::{checksums_from_env, recv_pull_from_env};
pub use crate::env_switches::{CHECKSUM_ENV, RECV_MODE_ENV};
pub use crate::stats::{CountedStats, RpcStats};
pub(crate) use bulk_ctx::{check_owner, CANCEL_WAIT_WARNING};
pub use bulk_ctx::{BulkCtx, BATCH_WINDOW, DEFAULT_HANDLER_TRANSFER_TIMEOUT};
pub use bulk_ops::BulkId;
pub(crate) use debug_span::DebugSpan;
use engine_records::{
    request_send_op, Call, Calls, OpRole, PendingPull, WaitingOutput, CALL_SEND_COOKIE, CALL_SEND_OP,
    NOTICE_AGAIN_OP, REQUEST_OP, REQUEST_TAG, RESENT_OP, RESPONSE_TAG, SEND_OP, WATCH_OP, WATCH_TAG,
};
pub use register_ops::DeferredRequest;
use register_ops::Handler;
#[doc(hidden)]
pub use unsent_response_ops::RESENT_REASON_MAX;
use wire_headers::{header, response_header, response_outcome};

/// Identifies a call made with [`Engine::forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallId(u64);

/// An RPC engine over one NA plugin of an [`Endpoint`].
///
/// # Call order
/// 1. [`Engine::new`] with an endpoint and the plugin to use (it posts
///    receives for incoming requests at once).
/// 2. [`register`](Self::register) handlers (targets); both sides use the
///    same [`Rpc`](crate::Rpc) definitions.
/// 3. Origin: [`call`](Self::call) (blocking, with a timeout) or
///    [`forward`](Self::forward) + [`take_response`](Self::take_response).
/// 4. Drive it: [`progress`](Self::progress) waits for network work,
///    [`trigger`](Self::trigger) runs handlers and files responses. `call`
///    does both itself while it waits.
/// 5. A server drains before it is dropped ([`begin_drain`](Self::begin_drain),
///    then drive it until [`drained`](Self::drained)): a drop loses the
///    answers its transport still queues, the requests it has not
///    answered and its notices, and logs a warning with their counts.
pub struct Engine<C: Codec = Postcard> {
    ep: Endpoint,
    plugin: PluginId,
    me: Addr,
    codec: C,
    handlers: FastMap<u64, Handler>,
    ops: FastMap<OpId, OpRole>,
    calls: Calls,
    /// The local bulk handles the input of a call in `calls` carried (see
    /// `hg_bulk::collect_lent`), by cookie, for the calls that had any:
    /// kept alive and exposed until the call leaves the table, since the
    /// target may transfer to or from them until it answers, even after
    /// the caller gave up. Apart from `Call`, so that the usual call,
    /// which lends nothing, pays one emptiness check.
    lent: FastMap<u64, Box<[MemHandle]>>,
    /// Seals of spilled payloads (see `spill`; `next_seal`): a counter,
    /// and the secret key of the keyed hash (SipHash, a PRF) that turns it
    /// into a seal, so that no seal a peer saw tells it any other.
    seal_count: u64,
    seal_key: std::collections::hash_map::RandomState,
    /// How long a spilled output waits for its origin's pull (see
    /// [`set_spilled_output_ttl`](Self::set_spilled_output_ttl)).
    output_ttl: Duration,
    next_op: u64,
    /// Peers we have calls to, or spilled outputs exposed for, by token:
    /// each has one watch, an expected receive that no message matches.
    /// The plugin fails it when the peer goes away (exit, crash, broken
    /// connection), and that fails the peer's calls and releases its
    /// outputs. Responses themselves arrive in the unexpected receives we
    /// keep posted anyway, so a call posts no receive of its own.
    watches: FastMap<u64, Addr>,
    /// The token of the peer watched last (skips the lookup for a run of
    /// calls to one peer).
    last_watched: Option<u64>,
    /// Our plugin's message limit (the smaller of unexpected and expected).
    max_msg: usize,
    /// A message no larger than this goes out eagerly to any peer: the
    /// smaller of `max_msg` and what every peer accepts (the plugin's
    /// `min_peer_unexpected_size`, at least [`MIN_EAGER_SIZE`]). A larger
    /// one asks the plugin for its destination's limit (`limit_to`).
    eager_floor: usize,
    scratch: Vec<u8>,
    stats: RpcStats,
    finished_self: VecDeque<u64>,
    /// Notices the transport could not take (its send backlog full), sent
    /// again by `trigger`: releases of pulled spilled outputs and
    /// acknowledgements of pulled spilled one-way requests. Lost, they
    /// would keep the peer holding (and charging) the memory for its
    /// whole TTL.
    unsent_notices: crate::notices::UnsentNotices,
    /// Calls whose outcome was filed since the last
    /// [`take_finished`](Self::take_finished), kept only once
    /// [`log_finished`](Self::log_finished) asked for them.
    finished_log: Option<Vec<CallId>>,
    /// Receive buffers of handled messages, posted again at the next
    /// progress call (see [`Engine::repost_buffers`]).
    repost: Vec<Vec<u8>>,
    /// The transport is in pull mode: messages are taken from it by
    /// `trigger` into `rx_buf`, and no receives are posted.
    pull: bool,
    /// [`begin_drain`](Self::begin_drain) was called: requests are refused.
    draining: bool,
    /// Where a pulled message is copied (kept for its capacity).
    rx_buf: Vec<u8>,
    pulls: FastMap<u64, PendingPull>,
    /// Spilled outputs of calls in flight that found no room in the pull
    /// budget, oldest first: pulled, in order, as pulls end and deferred
    /// requests holding pulled inputs are answered (see
    /// `pull_waiting_outputs`); a call given up on leaves at once.
    output_waits: VecDeque<WaitingOutput>,
    /// Large byte buffers kept for reuse: those spilled data was pulled
    /// into, and the exposed inputs of finished spilled requests (see
    /// `pull_buffer` and `keep_spare_buffer`).
    spare_bufs: Vec<Vec<u8>>,
    /// Most bytes `spare_bufs` may hold together.
    spare_bytes: usize,
    max_spill: u64,
    /// How long one transfer call of a handler may take (see
    /// `set_handler_transfer_timeout`).
    handler_transfer_timeout: Duration,
    /// Bytes of the pulls in flight (`pulls`), and their limit.
    pull_bytes: u64,
    /// Bytes of pulled inputs that deferred requests still hold (see
    /// `PullCharge`).
    deferred_bytes: Arc<AtomicU64>,
    /// Wakes the sleeper when a deferred request's pulled input comes
    /// back outside the engine (see `register_ops::ReturnWake`): set by
    /// the first `register_deferred` (the endpoint's waker) or by
    /// `AsyncEngine::spawn` (the driver's), whichever comes first.
    returned_input_wake: register_ops::ReturnWake,
    max_pull_bytes: u64,
    /// Bytes of the spilled inputs being pulled, per origin (their share,
    /// with what their deferred requests hold; see `pull_share_ops.rs`).
    input_pulls_by_peer: FastMap<crate::origin::Origin, u64>,
    /// One origin's share of `max_pull_bytes`, if set (else half of it).
    max_pull_per_peer: Option<u64>,
    /// Bytes of our own calls' outputs being pulled (in `pull_bytes`
    /// too): what [`set_output_pull_floor`](Self::set_output_pull_floor)
    /// bounds when others' inputs hold the budget.
    output_pull_bytes: u64,
    /// The floor of our own calls' output pulls, if set (else a quarter
    /// of `max_pull_bytes`; see `pull_share_ops.rs`).
    output_pull_floor: Option<u64>,
    /// Spilled outputs waiting for their origin to pull them, by (peer
    /// address token, cookie), with the time they were exposed (bounded
    /// per `Origin`, see `exposed.rs`).
    exposed: ExposedOutputs,
    last_sweep: Instant,
    /// Calls marked abandoned, by cookie, in the order they were (one TTL
    /// for all, so also in the order their TTLs end). Entries of calls
    /// that ended since stay until the sweep reaches them: the front is
    /// the earliest an input can expire, never later. Empty: a trigger
    /// reads no clock for them.
    abandoned_order: VecDeque<(Instant, u64)>,
    /// Length of `abandoned_order` past which the sweep drops the entries
    /// of ended calls behind the front too (twice what it kept last time,
    /// so that a call kept for its whole TTL does not let the entries of
    /// calls answered behind it pile up, at an amortized cost of one
    /// visit per entry).
    abandoned_compact_at: usize,
    /// Entries of `abandoned_order` the sweeps looked at, in all: what the
    /// abandoned-input TTL costs, which follows the inputs kept and
    /// dropped, not the calls in flight (a counter for tests).
    abandoned_visits: u64,
    /// Entries of `abandoned_order` that `next_expiry` looked at, in all:
    /// one per ask while inputs are kept, not the calls in flight (a
    /// counter for tests; atomic only to be counted through `&self`, by a
    /// relaxed load and store: never contended).
    expiry_visits: AtomicU64,
    abandoned_ttl: Duration,
    /// Bytes of the spilled inputs of abandoned calls, and their bound.
    abandoned_bytes: u64,
    max_abandoned_bytes: u64,
    /// Completions that arrived while a handler waited for its bulk
    /// transfer; handled by the next `trigger`.
    deferred: VecDeque<Completion>,
    /// Outcomes of bulk transfers started with `bulk_start`.
    bulk_done: FastMap<u64, Result<()>>,
    /// Transfers whose outcome was filed since the last
    /// [`take_finished_bulks`](Self::take_finished_bulks), kept only once
    /// [`log_finished_bulks`](Self::log_finished_bulks) asked for them.
    finished_bulks: Option<Vec<BulkId>>,
    /// Requests for deferred handlers, oldest first.
    deferred_requests: VecDeque<DeferredRequest>,
    /// Requests for deferred handlers not yet answered (queued or running),
    /// per origin; bounded by `max_deferred` (per origin, in all).
    deferred_ledger: DeferredLedger,
    max_deferred: (usize, usize),
    /// `FLAG_CHECKSUM` when this origin's requests carry a checksum
    /// (see [`Engine::set_checksums`]), else 0.
    checksum_flag: u8,
}

impl Engine<Postcard> {
    /// An engine with the default codec.
    pub fn new(ep: Endpoint, plugin: PluginId) -> Result<Self> {
        Self::with_codec(ep, plugin, Postcard)
    }

    /// An engine on a new endpoint with one shared-memory plugin (the
    /// default transport), listening if `config.listen`.
    pub fn shared_memory(config: na_sm::SmConfig, mode: na_core::ProgressMode) -> Result<Self> {
        let mut ep = Endpoint::new(mode)?;
        let id = ep.add_plugin(|id| {
            let p = na_sm::SmPlugin::new(id, config)?;
            Ok(Box::new(p) as Box<dyn na_core::Plugin>)
        })?;
        Self::new(ep, id)
    }
}

impl<C: Codec> Engine<C> {
    /// An engine with codec `codec`.
    pub fn with_codec(mut ep: Endpoint, plugin: PluginId, codec: C) -> Result<Self> {
        let p = ep.plugin(plugin)?;
        let max_msg = p.max_unexpected_size().min(p.max_expected_size());
        if max_msg < MIN_EAGER_SIZE {
            return Err(RpcError::Transport(na_core::NaError::Config {
                name: "max_unexpected_size".into(),
                value: max_msg.to_string(),
                reason: format!(
                    "hg-rpc needs messages of at least {MIN_EAGER_SIZE} bytes (na-verbs: VerbsConfig::max_msg_size, QS_VERBS_MAX_MSG_SIZE)"
                ),
            }));
        }
        let eager_floor = max_msg.min(p.min_peer_unexpected_size().max(MIN_EAGER_SIZE));
        let me = p.self_addr();
        let checksum_flag = if checksums_from_env()? { FLAG_CHECKSUM } else { 0 };
        let pull = recv_pull_from_env()? && ep.pull_unexpected(plugin)?;
        let mut e = Engine {
            ep,
            plugin,
            me,
            codec,
            handlers: FastMap::default(),
            ops: FastMap::default(),
            calls: Calls::default(),
            lent: FastMap::default(),
            seal_count: 0,
            seal_key: std::collections::hash_map::RandomState::new(),
            output_ttl: SPILLED_OUTPUT_TTL,
            next_op: 1,
            watches: FastMap::default(),
            last_watched: None,
            max_msg,
            eager_floor,
            scratch: Vec::new(),
            stats: RpcStats::default(),
            finished_self: VecDeque::new(),
            unsent_notices: Default::default(),
            finished_log: None,
            repost: Vec::new(),
            pull,
            draining: false,
            rx_buf: Vec::with_capacity(max_msg),
            pulls: FastMap::default(),
            output_waits: VecDeque::new(),
            spare_bufs: Vec::new(),
            spare_bytes: DEFAULT_SPARE_BYTES,
            max_spill: DEFAULT_MAX_SPILL,
            handler_transfer_timeout: DEFAULT_HANDLER_TRANSFER_TIMEOUT,
            pull_bytes: 0,
            deferred_bytes: Arc::default(),
            returned_input_wake: Arc::default(),
            max_pull_bytes: DEFAULT_MAX_PULL_BYTES,
            input_pulls_by_peer: FastMap::default(),
            max_pull_per_peer: None,
            output_pull_bytes: 0,
            output_pull_floor: None,
            exposed: ExposedOutputs::default(),
            last_sweep: Instant::now(),
            abandoned_order: VecDeque::new(),
            abandoned_compact_at: MIN_COMPACT,
            abandoned_visits: 0,
            expiry_visits: AtomicU64::new(0),
            abandoned_ttl: ABANDONED_INPUT_TTL,
            abandoned_bytes: 0,
            max_abandoned_bytes: DEFAULT_MAX_ABANDONED_BYTES,
            deferred: VecDeque::new(),
            bulk_done: FastMap::default(),
            finished_bulks: None,
            deferred_requests: VecDeque::new(),
            deferred_ledger: DeferredLedger::default(),
            max_deferred: (DEFAULT_MAX_DEFERRED_PER_PEER, DEFAULT_MAX_DEFERRED_TOTAL),
            checksum_flag,
        };
        if !pull {
            for _ in 0..POSTED_REQUEST_BUFFERS {
                e.post_request_buffer(Vec::with_capacity(max_msg))?;
            }
        }
        tracing::debug!(addr = %e.me, pull, "rpc engine created");
        Ok(e)
    }

    /// Unexpected receives the engine keeps posted on its transport:
    /// [`POSTED_REQUEST_BUFFERS`], or none when the transport is in pull
    /// mode (see [`RECV_MODE_ENV`]).
    pub fn posted_receives(&self) -> usize {
        if self.pull {
            0
        } else {
            POSTED_REQUEST_BUFFERS
        }
    }

    /// Our own address.
    pub fn self_addr(&self) -> &Addr {
        &self.me
    }

    /// The endpoint (for lookups and plugin access). [`Engine::trigger`]
    /// takes every completion the endpoint queues: operations posted on it
    /// directly complete unseen (and ids with bit 61, 62 or 63 set are the
    /// engine's own: peer watches, message receives and sends).
    ///
    /// Use it in place; never replace it (`std::mem::swap` with another
    /// endpoint): the engine's posted receives, its peers' addresses and
    /// its [`waker`](Self::waker) (which dropped requests use to end a
    /// sleep) all belong to this one.
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// The plugin of the endpoint the engine runs on (receives and sends
    /// through).
    pub fn plugin(&self) -> PluginId {
        self.plugin
    }

    /// Looks up a peer address on the engine's own plugin (see
    /// [`Plugin::lookup`](na_core::Plugin::lookup)). Prefer it to
    /// `endpoint().lookup`, which takes the endpoint's first plugin of the
    /// address's scheme: an engine on another one refuses such an address
    /// ([`RpcError::ForeignAddress`]).
    pub fn lookup(&mut self, uri: &str) -> Result<Addr> {
        Ok(self.ep.plugin_mut(self.plugin)?.lookup(uri)?)
    }

    /// The counters of the engine's transport plugin
    /// ([`PluginStats`](na_core::PluginStats): messages, bytes moved by
    /// one-sided gets and puts, handlers' bulk transfers and spilled
    /// payloads included, peers, backlog), without the
    /// `endpoint().plugin(plugin())` walk. Default (all zero) if the
    /// plugin was removed from the endpoint.
    pub fn transport_stats(&self) -> na_core::PluginStats {
        self.ep.plugin(self.plugin).map(|p| p.stats()).unwrap_or_default()
    }

    /// Counters.
    pub fn stats(&self) -> RpcStats {
        let (mut in_flight, mut abandoned_inputs) = (0, 0);
        for (_, c) in self.calls.iter() {
            match (&c.abandoned, &c.outcome) {
                (Some(_), _) => abandoned_inputs += 1,
                (None, None) => in_flight += 1,
                (None, Some(_)) => {}
            }
        }
        let bulk_in_flight = self
            .ops
            .values()
            .filter(|r| matches!(r, OpRole::Bulk(..) | OpRole::ForgottenBulk(_)))
            .count() as u64;
        RpcStats {
            call_slots: self.calls.capacity() as u64,
            buffer_bytes: (self.scratch.capacity()
                + self.rx_buf.capacity()
                + self.spare_bufs.iter().map(Vec::capacity).sum::<usize>()) as u64,
            in_flight,
            bulk_in_flight,
            exposed_outputs: self.exposed.len() as u64,
            exposed_bytes: self.exposed.bytes(),
            deferred_in_flight: self.deferred_ledger.total() as u64,
            abandoned_inputs,
            abandoned_bytes: self.abandoned_bytes,
            ..self.stats
        }
    }

    /// A seal for the next spilled payload: never 0 (a broken seal), and
    /// unpredictable from every other (a keyed hash of a counter, under a
    /// key drawn from the OS's random source, never sent: a peer that saw
    /// some seals cannot work out others, as it could invert splitmix64).
    fn next_seal(&mut self) -> u64 {
        use std::hash::BuildHasher;
        self.seal_count = self.seal_count.wrapping_add(1);
        self.seal_key.hash_one(self.seal_count).max(1)
    }

    fn op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    /// An id for a send: its role is in the id, so it needs no entry in
    /// `ops` (two hash-map operations fewer per message).
    fn send_op(&mut self) -> OpId {
        OpId(self.op().0 | SEND_OP)
    }

    fn post_request_buffer(&mut self, buf: Vec<u8>) -> Result<()> {
        let op = OpId(self.op().0 | REQUEST_OP);
        self.ep.post_recv_unexpected(self.plugin, buf, op)?;
        Ok(())
    }

    /// Posts again the receive buffers `trigger` handled. Deferred to the
    /// next progress call so that it is off the critical path of a call: a
    /// caller that got its response sends the next request first, and a
    /// server has already sent its response. A message that comes while
    /// buffers wait here is matched by the other posted ones, or queued by
    /// the plugin until one is posted; nothing is lost.
    fn repost_buffers(&mut self) -> Result<()> {
        while let Some(buf) = self.repost.pop() {
            self.post_request_buffer(buf)?;
        }
        Ok(())
    }
}
