//! The RPC engine: registry, calls in flight, and the blocking progress API.

use std::collections::VecDeque;

use na_core::fasthash::FastMap;
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, Endpoint, MemHandle, MsgBuf, NaError, OpId, PluginId, Tag};

use crate::call_table::{CallTable, NO_CALL};
use crate::codec::{Codec, Postcard};
use crate::error::{Result, RpcError};
use crate::header::{Header, Status, FLAG_CHECKSUM, FLAG_ONE_WAY, FLAG_RESPONSE, FLAG_SPILL, HEADER_LEN};
use crate::rpc::{rpc_id, Rpc};
use crate::spill::{self, RELEASE_RPC};

/// How long a target keeps a spilled output exposed for an origin that
/// never confirms it pulled it (it died, or broke the protocol).
pub const SPILLED_OUTPUT_TTL: Duration = Duration::from_secs(60);

/// Unexpected receives the engine keeps posted for incoming requests and
/// the responses to its calls.
pub const POSTED_REQUEST_BUFFERS: usize = 64;

/// Default largest spilled input a target accepts (see
/// [`Engine::set_max_spill`]).
pub const DEFAULT_MAX_SPILL: u64 = 64 << 20;

type HandlerFn =
    Box<dyn FnMut(&mut BulkCtx<'_>, &[u8]) -> std::result::Result<Vec<u8>, (Status, String)> + Send>;

#[path = "bulk_ops.rs"]
mod bulk_ops;
#[path = "serve_ops.rs"]
mod serve_ops;
pub use bulk_ops::{BulkCtx, BulkId, BATCH_WINDOW};

struct Handler {
    name: &'static str,
    /// `None`: a deferred handler; requests wait in `deferred_requests` for
    /// an executor (the tokio front end) to answer them.
    run: Option<HandlerFn>,
}

/// A request for a deferred (asynchronous) handler, waiting to be answered
/// with [`Engine::respond_deferred`].
pub struct DeferredRequest {
    src: Addr,
    header: Header,
    /// The encoded input.
    pub payload: Vec<u8>,
}

impl DeferredRequest {
    /// The RPC id.
    pub fn rpc_id(&self) -> u64 {
        self.header.rpc_id
    }
}

/// Identifies a call made with [`Engine::forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallId(u64);

/// What a posted operation is for, kept in `Engine::ops` by its id.
/// Sends and posted message receives, one or two per message, keep their
/// role in the id instead ([`SEND_OP`], [`REQUEST_OP`]) and have no entry.
enum OpRole {
    /// The pull of a spilled request's input (key into `pulls`).
    Pull(u64),
    /// The pull of a spilled response's output (key into `pulls`; cookie).
    PullOutput(u64, u64),
    /// A transfer started with `bulk_start` (its id).
    Bulk(u64),
    /// The watch on a peer we call (its token; see `Engine::watches`).
    Watch(u64),
}

/// Bit of an [`OpId`] that marks a send (nothing to do on success).
const SEND_OP: u64 = 1 << 63;
/// Bit of an [`OpId`] that marks a posted unexpected receive (requests
/// for us, and responses to our calls).
const REQUEST_OP: u64 = 1 << 62;
/// Bit of an [`OpId`] that marks the watch receive on a called peer.
const WATCH_OP: u64 = 1 << 61;

/// Tag of request messages (unexpected messages; receivers route on the
/// header's response flag, the tag only helps a reader of traces).
const REQUEST_TAG: Tag = 0;
/// Tag of response messages (unexpected messages too).
const RESPONSE_TAG: Tag = 1;
/// Tag of the watch receive: an expected receive that no message ever
/// matches; it exists to fail when its peer goes away.
const WATCH_TAG: Tag = 0;

/// A request whose spilled input is being pulled from its origin.
struct PendingPull {
    src: Addr,
    header: Header,
    mem: MemHandle,
}

struct Call {
    rpc: &'static str,
    /// Token of the target; `None` for a self-forward. A response counts
    /// only if it comes from this peer.
    peer: Option<u64>,
    /// The response payload or error, once it arrived.
    outcome: Option<Result<Payload>>,
    /// The caller gave up, but the call must stay until its response
    /// comes: its spilled input is still exposed to the target. The
    /// response is then discarded.
    abandoned: bool,
    /// The exposed input of a spilled request, kept until the response.
    spill: Option<MemHandle>,
}

/// A response payload: `buf[start..]`. A response that arrived in one
/// message keeps its receive buffer (`start` is then the header length)
/// rather than a copy, and [`Engine::take_response`] recycles the buffer.
struct Payload {
    buf: Vec<u8>,
    start: usize,
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        self.buf.get(self.start..).unwrap_or_default()
    }
}

/// Counters of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RpcStats {
    /// Calls forwarded (including self-forwards and one-way).
    pub calls: u64,
    /// Requests handled as target.
    pub handled: u64,
    /// Calls that ended in an error at the origin.
    pub errors: u64,
    /// Malformed messages received and dropped.
    pub malformed: u64,
    /// Request and response bytes sent (headers included).
    pub bytes_sent: u64,
    /// Calls waiting for their response.
    pub in_flight: u64,
    /// Responses that matched no call in flight (late, after a timeout or
    /// a dropped future) and were discarded.
    pub stray_responses: u64,
}

/// An RPC engine over one NA plugin of an [`Endpoint`].
///
/// # Call order
/// 1. [`Engine::new`] with an endpoint and the plugin to use (it posts
///    receives for incoming requests at once).
/// 2. [`register`](Self::register) handlers (targets); both sides use the
///    same [`Rpc`] definitions.
/// 3. Origin: [`call`](Self::call) (blocking, with a timeout) or
///    [`forward`](Self::forward) + [`take_response`](Self::take_response).
/// 4. Drive it: [`progress`](Self::progress) waits for network work,
///    [`trigger`](Self::trigger) runs handlers and files responses. `call`
///    does both itself while it waits.
pub struct Engine<C: Codec = Postcard> {
    ep: Endpoint,
    plugin: PluginId,
    me: Addr,
    codec: C,
    handlers: FastMap<u64, Handler>,
    ops: FastMap<OpId, OpRole>,
    calls: CallTable<Call>,
    next_op: u64,
    /// Peers we have calls to, by token: each has one watch, an expected
    /// receive that no message matches. The plugin fails it when the peer
    /// goes away (exit, crash, broken connection), and that fails the
    /// peer's calls. Responses themselves arrive in the unexpected
    /// receives we keep posted anyway, so a call posts no receive of its
    /// own.
    watches: FastMap<u64, Addr>,
    /// The token of the peer watched last (skips the lookup for a run of
    /// calls to one peer).
    last_watched: Option<u64>,
    max_msg: usize,
    scratch: Vec<u8>,
    stats: RpcStats,
    finished_self: VecDeque<u64>,
    /// Receive buffers that completed and must be posted again, at the
    /// next progress call (see [`Engine::repost_buffers`]).
    unposted: usize,
    /// Receive buffers free for those posts (at most
    /// [`POSTED_REQUEST_BUFFERS`]; a new one is allocated when none is).
    spare_bufs: Vec<Vec<u8>>,
    pulls: FastMap<u64, PendingPull>,
    max_spill: u64,
    /// Spilled outputs waiting for their origin to pull them, by (origin
    /// token, cookie), with the time they were exposed.
    exposed: FastMap<(u64, u64), (MemHandle, Instant)>,
    last_sweep: Instant,
    /// Completions that arrived while a handler waited for its bulk
    /// transfer; handled by the next `trigger`.
    deferred: VecDeque<Completion>,
    /// Outcomes of bulk transfers started with `bulk_start`.
    bulk_done: FastMap<u64, Result<()>>,
    /// Requests for deferred handlers, oldest first.
    deferred_requests: VecDeque<DeferredRequest>,
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
    pub fn with_codec(ep: Endpoint, plugin: PluginId, codec: C) -> Result<Self> {
        let p = ep.plugin(plugin)?;
        let max_msg = p.max_unexpected_size().min(p.max_expected_size());
        let me = p.self_addr();
        let mut e = Engine {
            ep,
            plugin,
            me,
            codec,
            handlers: FastMap::default(),
            ops: FastMap::default(),
            calls: CallTable::default(),
            next_op: 1,
            watches: FastMap::default(),
            last_watched: None,
            max_msg,
            scratch: Vec::new(),
            stats: RpcStats::default(),
            finished_self: VecDeque::new(),
            unposted: 0,
            spare_bufs: Vec::new(),
            pulls: FastMap::default(),
            max_spill: DEFAULT_MAX_SPILL,
            exposed: FastMap::default(),
            last_sweep: Instant::now(),
            deferred: VecDeque::new(),
            bulk_done: FastMap::default(),
            deferred_requests: VecDeque::new(),
        };
        for _ in 0..POSTED_REQUEST_BUFFERS {
            e.post_request_buffer(Vec::with_capacity(max_msg))?;
        }
        Ok(e)
    }

    /// Our own address.
    pub fn self_addr(&self) -> &Addr {
        &self.me
    }

    /// The endpoint (for lookups and plugin access). [`Engine::trigger`]
    /// takes every completion the endpoint queues: operations posted on it
    /// directly complete unseen (and ids with bit 61, 62 or 63 set are the
    /// engine's own: peer watches, message receives and sends).
    pub fn endpoint(&mut self) -> &mut Endpoint {
        &mut self.ep
    }

    /// Counters.
    pub fn stats(&self) -> RpcStats {
        RpcStats {
            in_flight: self
                .calls
                .iter()
                .filter(|(_, c)| !c.abandoned && c.outcome.is_none())
                .count() as u64,
            ..self.stats
        }
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
        while self.unposted > 0 {
            self.unposted -= 1;
            let buf = self
                .spare_bufs
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(self.max_msg));
            self.post_request_buffer(buf)?;
        }
        Ok(())
    }

    /// Keeps a receive buffer no longer in use for the next post.
    fn recycle_buffer(&mut self, mut buf: Vec<u8>) {
        if self.spare_bufs.len() < POSTED_REQUEST_BUFFERS {
            buf.clear();
            self.spare_bufs.push(buf);
        }
    }

    /// Registers `handler` for RPC `R`. A second registration of the same
    /// name, or a different name with the same id, is an error.
    pub fn register<R: Rpc>(
        &mut self,
        mut handler: impl FnMut(R::Input) -> std::result::Result<R::Output, String> + Send + 'static,
    ) -> Result<()> {
        self.register_with_bulk::<R>(move |_, input| handler(input))
    }

    /// Registers a handler that may move bulk data while it runs (through
    /// the [`BulkCtx`] it is given: pull a client's buffer, push into one).
    pub fn register_with_bulk<R: Rpc>(
        &mut self,
        mut handler: impl FnMut(&mut BulkCtx<'_>, R::Input) -> std::result::Result<R::Output, String>
            + Send
            + 'static,
    ) -> Result<()> {
        let id = self.check_free(R::NAME)?;
        let codec = self.codec.clone();
        let run: HandlerFn = Box::new(move |ctx, payload| {
            let input: R::Input = codec
                .decode(payload)
                .map_err(|e| (Status::DecodeError, format!("input of {}: {e}", R::NAME)))?;
            let output = handler(ctx, input).map_err(|m| (Status::HandlerError, m))?;
            let mut out = Vec::new();
            codec.encode(&output, &mut out).map_err(|e| {
                (
                    Status::HandlerError,
                    format!("encoding output of {}: {e}", R::NAME),
                )
            })?;
            Ok(out)
        });
        self.handlers.insert(
            id,
            Handler {
                name: R::NAME,
                run: Some(run),
            },
        );
        Ok(())
    }

    fn check_free(&self, name: &'static str) -> Result<u64> {
        let id = rpc_id(name);
        if let Some(h) = self.handlers.get(&id) {
            let reason = if h.name == name {
                "already registered".to_string()
            } else {
                format!("its id {id:#018x} collides with {}", h.name)
            };
            return Err(RpcError::Registration {
                name: name.into(),
                reason,
            });
        }
        Ok(id)
    }

    /// Registers `R` as deferred: its requests are queued for
    /// [`take_deferred`](Self::take_deferred) and answered later with
    /// [`respond_deferred`](Self::respond_deferred) (how the tokio front end
    /// runs async handlers).
    pub fn register_deferred<R: Rpc>(&mut self) -> Result<()> {
        let id = self.check_free(R::NAME)?;
        self.handlers.insert(
            id,
            Handler {
                name: R::NAME,
                run: None,
            },
        );
        Ok(())
    }

    /// The oldest request waiting for a deferred handler.
    pub fn take_deferred(&mut self) -> Option<DeferredRequest> {
        self.deferred_requests.pop_front()
    }

    /// Answers a deferred request: `Ok(encoded output)` or `Err(message)`
    /// (a handler error). One-way requests get no answer.
    pub fn respond_deferred(&mut self, req: DeferredRequest, result: std::result::Result<Vec<u8>, String>) {
        let (status, out) = match result {
            Ok(out) => (Status::Ok, out),
            Err(m) => (Status::HandlerError, m.into_bytes()),
        };
        let needs_answer = !req.header.is_one_way() || req.header.flags & FLAG_SPILL != 0;
        if needs_answer {
            self.answer(&req.src, response_header(&req.header, status), out);
        }
    }

    /// Largest spilled input this engine pulls as a target; bigger ones are
    /// refused with a decode error (a peer cannot make us allocate more).
    pub fn set_max_spill(&mut self, bytes: u64) {
        self.max_spill = bytes;
    }

    /// Encodes a request. An input too large for an eager message (and not
    /// for ourselves) is exposed read-only and described instead: the
    /// returned handle must live until the target answered.
    /// Encodes a request for `dest` into a transport message buffer (built
    /// in place: no intermediate copy; a registered buffer on RDMA), its
    /// input spilled into an exposed handle if it does not fit a message.
    fn encode_request<R: Rpc>(
        &mut self,
        dest: &Addr,
        input: &R::Input,
        flags: u8,
        cookie: u64,
        to_self: bool,
    ) -> Result<(MsgBuf, Option<MemHandle>)> {
        let mut payload = std::mem::take(&mut self.scratch);
        payload.clear();
        self.codec
            .encode(input, &mut payload)
            .map_err(|reason| RpcError::Encode {
                rpc: R::NAME.into(),
                what: "input",
                reason,
            })?;
        let id = rpc_id(R::NAME);
        if to_self || HEADER_LEN + payload.len() <= self.max_msg {
            // A self-forward never leaves the process: any size goes.
            let mut msg = if to_self {
                MsgBuf::heap(HEADER_LEN + payload.len())
            } else {
                self.ep.alloc_msg_buf(dest, HEADER_LEN + payload.len())?
            };
            // A one-way request that fits never becomes a call: its cookie
            // must not be one a later call will have.
            let cookie = if flags & FLAG_ONE_WAY != 0 {
                NO_CALL
            } else {
                cookie
            };
            let r = header(flags, Status::Ok, id, cookie).encode_into(&payload, &mut msg);
            self.scratch = payload;
            r?;
            return Ok((msg, None));
        }
        let (mem, spilled) = spill::expose(&mut self.ep, self.plugin, payload)?;
        let len = HEADER_LEN + spilled.len();
        if len > self.max_msg {
            return Err(RpcError::TooLarge {
                rpc: R::NAME.into(),
                what: "input descriptor",
                len,
                max: self.max_msg,
            });
        }
        let mut msg = self.ep.alloc_msg_buf(dest, len)?;
        header(flags | FLAG_SPILL, Status::Ok, id, cookie).encode_into(&spilled, &mut msg)?;
        Ok((msg, Some(mem)))
    }

    /// Starts a call of `R` on `dest`; see [`take_response`](Self::take_response).
    pub fn forward<R: Rpc>(&mut self, dest: &Addr, input: &R::Input) -> Result<CallId> {
        // The call is stored (under this cookie) once its request is out.
        let cookie = self.calls.next_cookie();
        let to_self = *dest == self.me;
        let (msg, spill) = self.encode_request::<R>(dest, input, FLAG_CHECKSUM, cookie, to_self)?;
        self.stats.calls += 1;
        // Built only when a subscriber wants debug spans: tracing's `log`
        // feature (which any crate in a build can switch on) would
        // otherwise format a disabled span for `log` on every call.
        let _span = tracing::level_enabled!(tracing::Level::DEBUG)
            .then(|| tracing::debug_span!("rpc forward", rpc = R::NAME, cookie, dest = %dest).entered());
        if to_self {
            // Self-forward: run the handler here, no network (a deferred
            // handler answers later, through `answer`).
            let stored = self.calls.insert(Call {
                rpc: R::NAME,
                peer: None,
                outcome: None,
                abandoned: false,
                spill: None,
            });
            debug_assert_eq!(stored, cookie);
            match self.run_handler(msg.as_slice()) {
                Ok(None) => {}
                Ok(Some((h, p))) => {
                    self.file_outcome(cookie, response_outcome(R::NAME, rpc_id(R::NAME), h, p));
                    self.finished_self.push_back(cookie);
                }
                Err(e) => {
                    self.file_outcome(cookie, Err(e));
                    self.finished_self.push_back(cookie);
                }
            }
            return Ok(CallId(cookie));
        }
        self.send_request(dest, R::NAME, cookie, msg, spill, false)?;
        Ok(CallId(cookie))
    }

    /// Watches `dest` (if not yet), sends the request and records the call.
    fn send_request(
        &mut self,
        dest: &Addr,
        rpc: &'static str,
        cookie: u64,
        msg: MsgBuf,
        spill: Option<MemHandle>,
        abandoned: bool,
    ) -> Result<()> {
        let peer = dest.token();
        if self.last_watched != Some(peer) {
            self.watch(dest)?;
        }
        let send_op = self.send_op();
        let len = msg.len();
        self.ep.send_unexpected_buf(dest, REQUEST_TAG, msg, send_op)?;
        self.stats.bytes_sent += len as u64;
        let stored = self.calls.insert(Call {
            rpc,
            peer: Some(peer),
            outcome: None,
            abandoned,
            spill,
        });
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
    fn watch_ended(&mut self, token: u64, status: std::result::Result<(), NaError>) {
        let Some(addr) = self.watches.remove(&token) else {
            return;
        };
        if self.last_watched == Some(token) {
            self.last_watched = None;
        }
        let err = match status {
            Ok(()) => {
                self.stats.malformed += 1;
                tracing::warn!(peer = %addr, "peer sent a message matching no call; ignored");
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
    pub fn forward_one_way<R: Rpc>(&mut self, dest: &Addr, input: &R::Input) -> Result<()> {
        let to_self = *dest == self.me;
        // Only a spilled one-way request becomes a call (it waits for the
        // target's acknowledgement, under this cookie); one that fits
        // carries NO_CALL (see `encode_request`).
        let cookie = self.calls.next_cookie();
        let (msg, spill) =
            self.encode_request::<R>(dest, input, FLAG_CHECKSUM | FLAG_ONE_WAY, cookie, to_self)?;
        self.stats.calls += 1;
        if to_self {
            let _ = self.run_handler(msg.as_slice());
            return Ok(());
        }
        if spill.is_some() {
            // The target acknowledges a spilled one-way request once it has
            // pulled the input; until then the input must stay exposed.
            return self.send_request(dest, R::NAME, cookie, msg, spill, true);
        }
        let op = self.send_op();
        let len = msg.len();
        self.ep.send_unexpected_buf(dest, REQUEST_TAG, msg, op)?;
        self.stats.bytes_sent += len as u64;
        Ok(())
    }

    /// The result of call `id` if its response arrived (then the call is
    /// finished and forgotten), `None` if it is still in flight.
    pub fn take_response<R: Rpc>(&mut self, id: CallId) -> Option<Result<R::Output>> {
        self.calls.get(id.0)?.outcome.as_ref()?;
        let outcome = self.calls.remove(id.0)?.outcome?;
        let r = outcome.and_then(|payload| {
            let r = self
                .codec
                .decode::<R::Output>(payload.bytes())
                .map_err(|reason| RpcError::Decode {
                    rpc: R::NAME.into(),
                    what: "output",
                    reason,
                });
            if payload.start > 0 {
                self.recycle_buffer(payload.buf);
            }
            r
        });
        if r.is_err() {
            self.stats.errors += 1;
        }
        Some(r)
    }

    /// True if call `id` has its outcome (its response arrived, or it failed).
    pub fn is_finished(&self, id: CallId) -> bool {
        self.calls.get(id.0).is_some_and(|c| c.outcome.is_some())
    }

    /// Gives up on call `id`: its response, if it ever comes, is discarded.
    /// The call is forgotten at once, unless the target may still be
    /// pulling its spilled input (then it stays, marked, until the
    /// response or the target's end says the input is no longer needed).
    pub fn abandon(&mut self, id: CallId) {
        if let Some(c) = self.calls.get_mut(id.0) {
            if c.outcome.is_some() || c.spill.is_none() {
                self.calls.remove(id.0);
            } else {
                c.abandoned = true;
            }
        }
    }

    /// Polls the transports once without blocking (see
    /// [`Endpoint::progress_now`]).
    pub fn progress_now(&mut self) -> Result<usize> {
        self.repost_buffers()?;
        Ok(self.ep.progress_now()?)
    }

    /// True if the caller may sleep on the endpoint's fd now (see
    /// [`Endpoint::try_wait`]).
    pub fn try_wait(&mut self) -> bool {
        if self.repost_buffers().is_err() {
            return false;
        }
        self.finished_self.is_empty() && self.deferred.is_empty() && self.ep.try_wait()
    }

    /// Calls `R` on `dest` and waits (driving progress) for the result, at
    /// most `timeout`. On timeout the call is abandoned: a late response is
    /// discarded.
    pub fn call<R: Rpc>(&mut self, dest: &Addr, input: &R::Input, timeout: Duration) -> Result<R::Output> {
        // The timeout covers the whole call, sending included, and a response
        // counts only if it is taken before the deadline: a caller that was
        // descheduled past it gets the timeout, not a late answer.
        let deadline = Instant::now() + timeout;
        let id = match self.forward::<R>(dest, input) {
            Ok(id) => id,
            Err(e) => {
                self.stats.errors += 1;
                return Err(e);
            }
        };
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
            self.progress(Some(left))?;
            self.trigger()?;
        }
    }

    /// Waits (per the endpoint's progress mode) until network work is
    /// ready or `timeout` passes.
    pub fn progress(&mut self, timeout: Option<Duration>) -> Result<usize> {
        self.repost_buffers()?;
        if self.ep.pending_completions() > 0 || !self.finished_self.is_empty() || !self.deferred.is_empty() {
            return Ok(self.ep.pending_completions());
        }
        Ok(self.ep.progress(timeout)?)
    }

    /// Handles every completion that is ready: runs handlers for requests
    /// and sends their responses; files responses for their calls. Returns
    /// how many completions it handled.
    pub fn trigger(&mut self) -> Result<usize> {
        let mut n = 0;
        self.finished_self.clear();
        while let Some(c) = self.deferred.pop_front().or_else(|| self.ep.pop_completion()) {
            n += 1;
            self.handle(c)?;
        }
        if !self.exposed.is_empty() && self.last_sweep.elapsed() > Duration::from_secs(1) {
            self.last_sweep = Instant::now();
            let before = self.exposed.len();
            self.exposed.retain(|_, (_, t)| t.elapsed() < SPILLED_OUTPUT_TTL);
            if self.exposed.len() < before {
                tracing::warn!(
                    expired = before - self.exposed.len(),
                    "released spilled outputs never pulled"
                );
            }
        }
        Ok(n)
    }

    /// A response (header `h`, payload `p`) arrived from `src`. It counts
    /// only for a call in flight to that same peer: a late one (the call
    /// timed out or its future was dropped) is discarded, and one from
    /// another peer (forged, or a confused peer) is malformed.
    ///
    /// `msg` is the whole message, already decoded into `h` (its payload is
    /// `msg[HEADER_LEN..]`). Returns the buffer unless the call kept it.
    fn on_response(&mut self, src: &Addr, h: &Header, msg: Vec<u8>) -> Option<Vec<u8>> {
        let cookie = h.cookie;
        let p = msg.get(HEADER_LEN..).unwrap_or_default();
        let Some(call) = self.calls.get(cookie) else {
            self.stats.stray_responses += 1;
            tracing::debug!(peer = %src, cookie, "discarding a response for no call in flight");
            return Some(msg);
        };
        if call.peer != Some(src.token()) || call.outcome.is_some() {
            self.stats.malformed += 1;
            tracing::warn!(peer = %src, cookie, "dropping a response that does not match its call");
            return Some(msg);
        }
        let outcome = if h.flags & FLAG_SPILL == 0 {
            // The common case first: it needs no call name. A payload of a
            // quarter of its buffer or more is read in place (no copy); a
            // smaller one is copied, so that a call whose response waits to
            // be taken holds at most 4x its payload.
            if h.status == Status::Ok && p.len() < msg.capacity() / 4 {
                self.file_outcome(cookie, Ok(p.to_vec()));
                return Some(msg);
            }
            if h.status == Status::Ok {
                self.file_payload(
                    cookie,
                    Ok(Payload {
                        buf: msg,
                        start: HEADER_LEN,
                    }),
                );
                return None;
            }
            response_outcome(call.rpc, h.rpc_id, *h, p)
        } else if h.status != Status::Ok {
            Err(RpcError::Malformed {
                reason: "a spilled response must have status ok".into(),
            })
        } else {
            match self.start_pull(src, h, p, true) {
                // The outcome is filed when the pull completes.
                Ok(()) => return Some(msg),
                Err(reason) => {
                    self.release_output(src, cookie);
                    Err(RpcError::Decode {
                        rpc: self.call_name(cookie).into(),
                        what: "output",
                        reason,
                    })
                }
            }
        };
        self.file_outcome(cookie, outcome);
        Some(msg)
    }

    fn handle(&mut self, c: Completion) -> Result<()> {
        if c.op.0 & SEND_OP != 0 {
            if let Err(e) = c.status {
                tracing::debug!(error = %e, "rpc send failed");
            }
            return Ok(());
        }
        if c.op.0 & REQUEST_OP != 0 {
            if !c.is_canceled() {
                self.unposted += 1;
            }
            let buf = c.buf.unwrap_or_default();
            let buf = match (c.status.is_ok(), c.source) {
                (true, Some(src)) => self.on_message(&src, buf)?,
                _ => Some(buf),
            };
            if let Some(buf) = buf {
                self.recycle_buffer(buf);
            }
            return Ok(());
        }
        let Some(role) = self.ops.remove(&c.op) else {
            return Ok(());
        };
        match role {
            OpRole::Watch(token) => self.watch_ended(token, c.status),
            OpRole::Bulk(id) => {
                self.bulk_done.insert(id, c.status.map_err(RpcError::Transport));
            }
            OpRole::Pull(key) => {
                if let Some(p) = self.pulls.remove(&key) {
                    let answer = match c.status {
                        Ok(()) => {
                            let data = p.mem.to_vec();
                            self.run_decoded(&p.src, &p.header, &data)
                        }
                        Err(e) => Some((
                            response_header(&p.header, Status::DecodeError),
                            format!("pulling the spilled input failed: {e}").into_bytes(),
                        )),
                    };
                    if let Some((h, out)) = answer {
                        self.respond(&p.src, h, out);
                    }
                }
            }
            OpRole::PullOutput(key, cookie) => {
                if let Some(p) = self.pulls.remove(&key) {
                    self.release_output(&p.src, cookie);
                    let rpc = self.call_name(cookie);
                    let outcome = match c.status {
                        Ok(()) => Ok(p.mem.to_vec()),
                        Err(e) => Err(RpcError::Decode {
                            rpc: rpc.into(),
                            what: "output",
                            reason: format!("pulling the spilled output failed: {e}"),
                        }),
                    };
                    self.file_outcome(cookie, outcome);
                }
            }
        }
        Ok(())
    }

    /// The registered name of call `cookie`'s RPC, for error messages.
    fn call_name(&self, cookie: u64) -> &'static str {
        self.calls.get(cookie).map_or("?", |k| k.rpc)
    }

    /// Gives call `cookie` its outcome (or forgets it if it was abandoned).
    fn file_outcome(&mut self, cookie: u64, outcome: Result<Vec<u8>>) {
        self.file_payload(cookie, outcome.map(|buf| Payload { buf, start: 0 }));
    }

    fn file_payload(&mut self, cookie: u64, outcome: Result<Payload>) {
        if let Some(call) = self.calls.get_mut(cookie) {
            call.spill = None;
            if call.abandoned {
                self.calls.remove(cookie);
            } else {
                call.outcome = Some(outcome);
            }
        }
    }

    /// Tells a target it may release the spilled output of call `cookie`.
    fn release_output(&mut self, target: &Addr, cookie: u64) {
        let mut msg = Vec::with_capacity(HEADER_LEN + 8);
        header(
            FLAG_CHECKSUM | FLAG_ONE_WAY,
            Status::Ok,
            rpc_id(RELEASE_RPC),
            cookie,
        )
        .encode_with(&cookie.to_le_bytes(), &mut msg);
        let op = self.send_op();
        if let Err(e) = self.ep.send_unexpected(target, 0, &msg, op) {
            tracing::debug!(error = %e, "cannot release a spilled output (target gone?)");
        }
    }
}

fn response_header(request: &Header, status: Status) -> Header {
    header(
        FLAG_RESPONSE | FLAG_CHECKSUM,
        status,
        request.rpc_id,
        request.cookie,
    )
}

fn header(flags: u8, status: Status, rpc_id: u64, cookie: u64) -> Header {
    Header {
        flags,
        status,
        rpc_id,
        cookie,
        payload_len: 0,
        checksum: 0,
    }
}

/// Turns a response header and payload into the call's outcome.
fn response_outcome(rpc: &str, id: u64, h: Header, payload: impl Into<Vec<u8>>) -> Result<Vec<u8>> {
    let payload = payload.into();
    let text = || String::from_utf8_lossy(&payload).into_owned();
    match h.status {
        Status::Ok => Ok(payload),
        Status::HandlerError => Err(RpcError::Handler {
            rpc: rpc.into(),
            message: text(),
        }),
        Status::UnknownRpc => Err(RpcError::UnknownRpc { rpc: rpc.into(), id }),
        Status::DecodeError => Err(RpcError::Decode {
            rpc: rpc.into(),
            what: "input",
            reason: text(),
        }),
    }
}
