//! Registration: handlers by RPC name (plain ones, run in place, and
//! deferred ones, whose requests wait for an executor such as the tokio
//! front end), and the requests of deferred handlers: their admission
//! under [`Engine::set_max_deferred`]'s bounds, the pulled bytes they
//! hold, and their answers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use na_core::fasthash::FastMap;
use na_core::Addr;

use super::{logged_at, response_header, BulkCtx, Engine};
use crate::codec::Codec;
use crate::deferred::{DeferredLedger, DeferredTicket};
use crate::error::{Result, RpcError};
use crate::header::{Header, Status};
use crate::origin::Origin;
use crate::rpc::{rpc_id, Rpc};

/// A plain handler: decodes the input, runs, and appends the encoded
/// output to the buffer it is given (empty; a spare one when the engine
/// has one, so a large output need not fault in fresh pages).
pub(super) type HandlerFn =
    Box<dyn FnMut(&mut BulkCtx<'_>, &[u8], &mut Vec<u8>) -> std::result::Result<(), (Status, String)> + Send>;

/// A registered handler (see [`Engine::take_handlers`]).
pub(crate) struct Handler {
    pub(super) name: &'static str,
    /// `None`: a deferred handler; requests wait in `deferred_requests` for
    /// an executor (the tokio front end) to answer them.
    pub(super) run: Option<HandlerFn>,
}

/// A request for a deferred (asynchronous) handler, waiting to be answered
/// with [`Engine::respond_deferred`].
///
/// Dropped unanswered, its caller gets no answer (it times out), and a
/// spilled input it held leaves the pull budget: the drop, on any thread,
/// wakes the engine's sleeper (a blocking [`progress`](Engine::progress),
/// a loop of your own asleep on the endpoint's fd, an
/// [`AsyncEngine`](crate::AsyncEngine)'s driver), and spilled outputs of
/// this engine's own calls that waited for that room are pulled at its
/// next `progress` or [`try_wait`](Engine::try_wait).
pub struct DeferredRequest {
    pub(super) src: Addr,
    pub(super) header: Header,
    /// The encoded input.
    pub payload: Vec<u8>,
    /// A pulled (spilled) input counts against the engine's pull budget
    /// until the request is answered or dropped.
    charge: Option<PullCharge>,
    /// Its place under [`Engine::set_max_deferred`]'s bounds, until then.
    _ticket: DeferredTicket,
}

/// Bytes of a pulled input held by a handler not yet answered, counted in
/// [`Engine::set_max_pull_bytes`]'s budget, and in its origin's share of
/// it ([`Engine::set_max_pull_bytes_per_peer`]), until dropped.
pub(super) struct PullCharge {
    bytes: u64,
    held: Arc<AtomicU64>,
    peer: Origin,
    ledger: DeferredLedger,
    /// Called when the charge is dropped outside
    /// [`Engine::respond_deferred`] (which tries the waiting outputs
    /// itself), once set: see [`ReturnWake`].
    wake: ReturnWake,
    /// Given back by `respond_deferred`, under the engine's `&mut`: no
    /// wake-up needed.
    answered: bool,
}

/// What wakes the engine's sleeper when a deferred request's pulled
/// input gives its room back outside the engine (the request dropped
/// unanswered, on any thread), so that no sleep needs a deadline while
/// spilled outputs wait for that room (`Engine::next_expiry`). Set once,
/// before any request can hold room: by the first
/// [`Engine::register_deferred`] (only deferred handlers' requests hold
/// pulled inputs), to the endpoint's [`Waker`](na_core::Waker), which
/// ends a blocking `progress`'s sleep or a sleep of the user's own on the
/// endpoint's fd; or earlier by the tokio front end, to wake its driver.
/// Shared with every charge.
pub(crate) type ReturnWake = Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>;

impl Drop for PullCharge {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
        self.ledger.release_bytes(self.peer, self.bytes);
        // After the room is back: a sleeper woken now sees it (a wake-up
        // that comes before the sleep is kept for it: tokio's
        // `Notify::notify_one` stores a permit, the endpoint's `Waker`
        // keeps its eventfd readable until the endpoint takes it).
        if !self.answered {
            if let Some(wake) = self.wake.get() {
                wake();
            }
        }
    }
}

impl DeferredRequest {
    pub(super) fn new(
        src: &Addr,
        header: &Header,
        payload: Vec<u8>,
        ticket: DeferredTicket,
        charge: Option<PullCharge>,
    ) -> Self {
        DeferredRequest {
            src: src.clone(),
            header: *header,
            payload,
            charge,
            _ticket: ticket,
        }
    }

    /// The RPC id.
    pub fn rpc_id(&self) -> u64 {
        self.header.rpc_id
    }

    /// Who sent the request.
    pub fn source(&self) -> &Addr {
        &self.src
    }
}

impl<C: Codec> Engine<C> {
    /// Registers `handler` for RPC `R`. A second registration of the same
    /// name, or a different name with the same id, is an error. An `Err`
    /// the handler returns reaches the caller as [`RpcError::Handler`]
    /// (cut to fit one message if it is longer); so does a panic in it,
    /// and the engine serves on. The error is a `String`, and `?` turns
    /// this crate's errors into one ([`RpcError`], hg-bulk's
    /// [`BulkError`](crate::BulkError): their messages), so a handler
    /// needs no `map_err` for a [`BulkCtx`] transfer or a
    /// [`Bulk`](crate::Bulk) read; another error type goes through
    /// `map_err(|e| e.to_string())`. (A handler generic over its error
    /// type would leave the error of every `?` in an existing handler
    /// without a type to infer.)
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
        let run: HandlerFn = Box::new(move |ctx, payload, out| {
            let input: R::Input = codec
                .decode(payload)
                .map_err(|e| (Status::DecodeError, format!("input of {}: {e}", R::NAME)))?;
            let output = handler(ctx, input).map_err(|m| (Status::HandlerError, m))?;
            codec.encode(&output, out).map_err(|e| {
                (
                    Status::HandlerError,
                    format!("encoding output of {}: {e}", R::NAME),
                )
            })
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
        if id == rpc_id(crate::spill::RELEASE_RPC) {
            // The engine's own message (a spilled output's release): a
            // handler under its id would never run.
            return Err(RpcError::Registration {
                name: name.into(),
                reason: format!(
                    "its id {id:#018x} is that of {}, which the engine keeps for itself",
                    crate::spill::RELEASE_RPC
                ),
            });
        }
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

    /// Takes every registered handler out, with what its closure
    /// captured, for the caller to drop when it likes: the tokio front
    /// end's `AsyncEngine::shutdown` drops them once it let the engine's
    /// lock go (a closure may hold what keeps the engine alive). A request
    /// that comes later finds no handler registered.
    pub(crate) fn take_handlers(&mut self) -> FastMap<u64, Handler> {
        std::mem::take(&mut self.handlers)
    }

    /// Registers `R` as deferred: its requests are queued for
    /// [`take_deferred`](Self::take_deferred) and answered later with
    /// [`respond_deferred`](Self::respond_deferred) (how the tokio front end
    /// runs async handlers).
    ///
    /// The first one (outside the tokio front end, which has its own)
    /// takes the endpoint's [`Waker`](na_core::Waker) (see
    /// [`waker`](Self::waker)): a request dropped unanswered on another
    /// thread wakes the engine's sleep with it, so that spilled outputs
    /// that waited for the room it held are pulled. An error if the
    /// waker cannot be made (nothing is registered then).
    pub fn register_deferred<R: Rpc>(&mut self) -> Result<()> {
        let id = self.check_free(R::NAME)?;
        if !self.wakes_on_returned_inputs() {
            let waker = self.ep.waker()?;
            self.wake_on_returned_inputs(move || {
                // In a `Drop`: nothing to return the error to. It cannot
                // happen in practice (see `Waker::wake`); the outputs
                // then wait for the next traffic or their call's timeout.
                if let Err(e) = waker.wake() {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "waking the engine for returned pull room failed");
                }
            });
        }
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

    /// Counts `bytes` of a pulled input a deferred request of origin
    /// `peer` holds.
    pub(super) fn charge_deferred(&mut self, peer: Origin, bytes: u64) -> PullCharge {
        self.deferred_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.deferred_ledger.hold_bytes(peer, bytes);
        PullCharge {
            bytes,
            held: Arc::clone(&self.deferred_bytes),
            peer,
            ledger: self.deferred_ledger.clone(),
            wake: Arc::clone(&self.returned_input_wake),
            answered: false,
        }
    }

    /// Calls `wake` whenever a deferred request's pulled input gives its
    /// room in the pull budget back outside
    /// [`respond_deferred`](Self::respond_deferred) (dropped unanswered,
    /// on any thread), so that a sleeper it wakes tries the spilled
    /// outputs that wait for room again. Set once (later calls are
    /// ignored): by the tokio front end to wake its driver, or by the
    /// first [`register_deferred`](Self::register_deferred) to wake the
    /// endpoint; either sleeper then sleeps until
    /// [`next_expiry`](Self::next_expiry).
    pub(crate) fn wake_on_returned_inputs(&mut self, wake: impl Fn() + Send + Sync + 'static) {
        let _ = self.returned_input_wake.set(Box::new(wake));
    }

    /// True once [`wake_on_returned_inputs`](Self::wake_on_returned_inputs)
    /// was set.
    fn wakes_on_returned_inputs(&self) -> bool {
        self.returned_input_wake.get().is_some()
    }

    /// Answers a deferred request: `Ok(encoded output)` or `Err(message)`
    /// (a handler error). One-way requests get no answer.
    pub fn respond_deferred(&mut self, req: DeferredRequest, result: std::result::Result<Vec<u8>, String>) {
        let (status, out) = match result {
            Ok(out) => (Status::Ok, out),
            Err(m) => (Status::HandlerError, m.into_bytes()),
        };
        // A spilled one-way request was acknowledged when its input arrived.
        if !req.header.is_one_way() {
            self.answer(&req.src, response_header(&req.header, status), out);
        }
        // A pulled input it held leaves the pull budget with it: room for
        // spilled outputs that wait for some, tried here (no wake-up).
        let mut req = req;
        if let Some(charge) = req.charge.as_mut() {
            charge.answered = true;
        }
        drop(req);
        self.pull_budget_freed();
    }

    /// A place for one more deferred request from `peer`, or why not
    /// (counted in `deferred_refused`).
    pub(crate) fn admit_deferred(&mut self, peer: Origin) -> std::result::Result<DeferredTicket, String> {
        let (per_peer, total) = self.max_deferred;
        self.deferred_ledger.admit(peer, per_peer, total).inspect_err(|why| {
            self.stats.deferred_refused += 1;
            if logged_at(self.stats.deferred_refused) {
                tracing::warn!(refused = self.stats.deferred_refused, %why, "request for an async handler refused");
            }
        })
    }
}
