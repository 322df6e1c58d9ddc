//! The tokio front end: `.await` on calls, one driver task per engine.
//!
//! The driver waits on the endpoint's epoll fd through tokio's `AsyncFd`:
//! no thread spins, and an idle engine uses no CPU. Each wake-up it polls
//! the transports, runs handlers, files responses and wakes the tasks whose
//! calls finished, then sleeps again once every plugin agreed (`try_wait`).

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::Addr;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::codec::{Codec, Postcard};
use crate::engine::{BulkId, CallId, Engine};
use crate::error::{Result, RpcError};
use crate::rpc::Rpc;

#[path = "runtime_bulk.rs"]
mod bulk;
#[path = "runtime_call.rs"]
mod call;
#[path = "runtime_ctx.rs"]
mod ctx;
#[path = "runtime_driver.rs"]
mod driver;
#[path = "runtime_stop.rs"]
mod stop;
pub use ctx::AsyncBulkCtx;
use driver::{drive, DriverExit};
pub use driver::{DRIVER_FAILURE_GAP, DRIVER_FAILURE_LIMIT};

/// An async handler: its context (the caller) and the encoded input in,
/// the encoded output (or the handler's error) out.
type AsyncHandler = Arc<
    dyn Fn(
            AsyncBulkCtx,
            Vec<u8>,
        ) -> Pin<Box<dyn Future<Output = std::result::Result<Vec<u8>, String>> + Send>>
        + Send
        + Sync,
>;

struct Shared {
    engine: Mutex<Engine>,
    /// The tasks waiting for their calls, and why the driver stopped once
    /// it has (then no call waits: see [`DriverExit`]).
    waiters: Mutex<Waiters>,
    async_handlers: Mutex<FastMap<u64, AsyncHandler>>,
    /// Scratch for the engine's finished calls and transfers (see
    /// `notify_finished`).
    finished: Mutex<(Vec<CallId>, Vec<BulkId>)>,
    /// Wakes the sleeping driver to look at the engine's expiries again
    /// (a call abandoned since it went to sleep may keep its input).
    rearm: tokio::sync::Notify,
    /// Wakes [`AsyncEngine::drained`] while the engine drains: after each
    /// driver turn and each async handler's answer.
    drain_moved: tokio::sync::Notify,
    /// Wakes the calls waiting for room for a spilled input
    /// ([`RpcError::InputsHeld`]): after a driver turn that gave held
    /// input bytes back, and when the driver stops.
    room: tokio::sync::Notify,
    /// The runtime the engine was spawned on: async handlers' tasks start
    /// there, also when a call is made from a thread outside it.
    runtime: tokio::runtime::Handle,
    /// Set with `Waiters::stopped` (under its lock): a call checks this
    /// flag, not the lock, before it starts.
    stopped: AtomicBool,
    /// Times the driver went to sleep on the fd (`RpcStats::driver_sleeps`).
    sleeps: AtomicU64,
    /// Requests whose handler task was dropped unanswered while the engine
    /// was locked (see [`AnswerIfDropped`]): answered by the next
    /// `spawn_deferred` (each driver turn runs one).
    orphans: Mutex<Vec<crate::engine::DeferredRequest>>,
    /// `orphans` is not empty (checked without its lock).
    has_orphans: AtomicBool,
}

thread_local! {
    /// The engines this thread holds locked (their `Shared` addresses). A
    /// plain handler runs with its engine locked: calling that engine from
    /// it would wait on itself forever, so it gets an error instead.
    static HELD: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The locked engine; while it lives, this thread is known to hold it.
struct EngineGuard<'a> {
    engine: MutexGuard<'a, Engine>,
    key: usize,
}

impl Deref for EngineGuard<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl DerefMut for EngineGuard<'_> {
    fn deref_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
}

impl Drop for EngineGuard<'_> {
    fn drop(&mut self) {
        // `try_with`: during thread exit (a runtime kept in a thread-local
        // dropping its tasks) the list may be gone already.
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&k| k == self.key) {
                h.remove(i);
            }
        });
    }
}

impl Shared {
    /// Locks the engine for the driver and the API's own work (never
    /// called from a handler: see [`try_engine`](Self::try_engine)).
    fn engine(&self) -> EngineGuard<'_> {
        self.engine_for("the engine")
    }

    /// [`try_engine`](Self::try_engine) for an API that returns no
    /// `Result`: a call from a plain handler of this engine panics (its
    /// caller sees a handler error).
    fn engine_for(&self, what: &'static str) -> EngineGuard<'_> {
        self.try_engine(what).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Refuses to start a call once the driver stopped (counted as an
    /// error of `e`); one atomic load while it runs.
    fn check_running(&self, rpc: &str, e: &mut Engine) -> Result<()> {
        self.check_running_quiet(rpc).inspect_err(|_| e.count_error())
    }

    /// [`check_running`](Self::check_running) without counting the
    /// refusal as a call's error (a bulk transfer is no call).
    pub(super) fn check_running_quiet(&self, what: &str) -> Result<()> {
        if !self.stopped.load(Ordering::Acquire) {
            return Ok(());
        }
        let why = self.waiters().stopped.clone().unwrap_or_default();
        Err(driver_stopped(what, &why))
    }

    /// Records why the driver stopped (the first reason stands) and fails
    /// every waiting call; `w` is the waiters, locked.
    fn mark_stopped(&self, w: &mut Waiters, why: impl FnOnce() -> String) {
        if w.stopped.is_none() {
            w.stopped = Some(why());
            self.stopped.store(true, Ordering::Release);
        }
        // Dropping the senders wakes every waiting call (and transfer) with
        // the error.
        w.calls.clear();
        w.bulks.clear();
        // And `drained` and a lookup's pause, whose timers (on the engine's
        // runtime, which may be shutting down) are then not polled again;
        // and the calls waiting for room for their input.
        self.drain_moved.notify_waiters();
        self.room.notify_waiters();
    }

    /// Wakes the calls waiting for room for a spilled input if `e` holds
    /// fewer input bytes than `before` (the turn's start). Call with the
    /// engine locked.
    pub(super) fn room_may_have_come(&self, e: &Engine, before: u64) {
        if e.held_input_bytes() < before {
            self.room.notify_waiters();
        }
    }

    /// Locks the engine, or fails if this thread holds it already: `what`
    /// was called from a plain handler of this engine.
    fn try_engine(&self, what: &'static str) -> Result<EngineGuard<'_>> {
        let key = self as *const Shared as usize;
        // A list already gone (thread exit) holds nothing: no handler runs.
        if HELD.try_with(|h| h.borrow().contains(&key)).unwrap_or(false) {
            return Err(RpcError::HandlerReentry { what });
        }
        let engine = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        let _ = HELD.try_with(|h| h.borrow_mut().push(key));
        Ok(EngineGuard { engine, key })
    }

    /// Runs `attempt` (a lookup or a transfer's start: work whose lookup
    /// of a peer may have to connect) with the engine locked, giving it
    /// `since`, when the first attempt was made; while it fails with
    /// [`NaError::WouldBlock`](na_core::NaError::WouldBlock) (the peer's
    /// transport is not ready to take the connection: na-sm, a listener's
    /// full accept queue), tries again after a pause taken **without the
    /// lock** ([`LOOKUP_RETRY_FIRST`], doubling up to
    /// [`LOOKUP_RETRY_MAX`]), so the driver and every other task go on
    /// meanwhile. The attempt ends it: the transport itself gives up once
    /// its bound for a lookup has passed since `since` (na-sm:
    /// `SmConfig::handshake_timeout`), with the error a blocking lookup
    /// would give. Returns the engine, still locked, with the outcome.
    /// `peer` is what the trace events name. With `timeout` (a caller's
    /// whole budget, starting at `since`), the waiting also ends when it
    /// has passed, with [`RpcError::Timeout`]: a transfer's timeout covers
    /// the lookup of its peer, not only the transfer after it.
    pub(super) async fn retry_while_blocked<'s, T>(
        &'s self,
        what: &'static str,
        peer: &str,
        since: Instant,
        timeout: Option<Duration>,
        mut attempt: impl FnMut(&mut Engine, Instant) -> Result<T>,
    ) -> Result<(EngineGuard<'s>, T)> {
        let mut backoff = LookupBackoff::new();
        let mut waited = false;
        loop {
            {
                let mut e = self.try_engine(what)?;
                match attempt(&mut e, since) {
                    Ok(v) => {
                        if waited {
                            tracing::debug!(peer, waited = ?since.elapsed(), "hg-rpc: lookup done after waiting");
                        }
                        return Ok((e, v));
                    }
                    Err(RpcError::Transport(err)) if err.is_would_block() => {
                        if !waited {
                            tracing::debug!(
                                peer,
                                reason = %err,
                                "hg-rpc: lookup waits (retrying without the engine lock)"
                            );
                        }
                    }
                    Err(err) => {
                        if waited {
                            tracing::warn!(peer, waited = ?since.elapsed(), error = %err, "hg-rpc: lookup gave up");
                        }
                        return Err(err);
                    }
                }
            }
            waited = true;
            let left = timeout.map(|budget| budget.saturating_sub(since.elapsed()));
            // (Only a caller's timeout runs out.)
            let Some(pause) = backoff.next_pause(left) else {
                tracing::debug!(peer, waited = ?since.elapsed(), "hg-rpc: lookup gave up: the caller's timeout passed");
                return Err(RpcError::Timeout {
                    rpc: what.into(),
                    millis: timeout.unwrap_or_default().as_millis(),
                });
            };
            // The pause ends early if the driver stops (`mark_stopped`
            // notifies): registered before the look at the flag, so a stop
            // in between is not missed, and the timer, made on the
            // engine's runtime, is never polled once that runtime's time
            // driver is gone.
            let stopped = self.drain_moved.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            if self.stopped.load(Ordering::Acquire) {
                let why = self.waiters().stopped.clone().unwrap_or_default();
                return Err(driver_stopped(what, &why));
            }
            let _ = self.timer(|| tokio::time::timeout(pause, stopped)).await;
        }
    }

    /// Makes a timer (`make`: a `tokio::time` sleep or timeout) on the
    /// engine's runtime, whatever runtime (if any) the calling task runs
    /// on. tokio ties a timer to the runtime current where it is made, and
    /// panics if there is none or if that one has no time driver; but the
    /// engine's futures may be polled by any executor (another runtime,
    /// one built without timers, a `block_on` with no runtime at all). The
    /// engine's runtime has a time driver (`spawn` checks) and runs the
    /// timer; the future holding it may then be polled from anywhere.
    pub(super) fn timer<T>(&self, make: impl FnOnce() -> T) -> T {
        let _on_engine_runtime = self.runtime.enter();
        make()
    }

    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the tasks whose calls finished since the last time, as the
    /// engine logged them: the cost follows the calls that finished, not
    /// the calls in flight. Call with the engine locked.
    fn notify_finished(&self, e: &mut Engine) {
        let mut done = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        let (calls, bulks) = &mut *done;
        e.take_finished(calls);
        e.take_finished_bulks(bulks);
        if calls.is_empty() && bulks.is_empty() {
            return;
        }
        let mut w = self.waiters();
        // A call without a waiter finished before its caller waited (a
        // self-forward), or its caller gave up: nobody to wake. Likewise a
        // transfer whose future was dropped.
        for id in calls.drain(..) {
            if let Some(tx) = w.calls.remove(&id) {
                let _ = tx.send(());
            }
        }
        for id in bulks.drain(..) {
            if let Some(tx) = w.bulks.remove(&id) {
                let _ = tx.send(());
            }
        }
    }

    /// Wakes the driver to work out its deadline again when `e` keeps more
    /// spilled data than `before` (work done outside the driver's turn: a
    /// spilled one-way call, an async handler's spilled output). A driver
    /// asleep with no deadline would otherwise keep it past its TTL.
    fn rearm_if_more_kept(&self, e: &Engine, before: u64) {
        if e.kept_bytes() > before {
            self.rearm.notify_one();
        }
    }

    /// A forward to `dest` that was our own address ran a plain handler
    /// here, on the caller's task, and a handler that moves bulk data
    /// polls the transports (`transfer_window`): that leaves them unarmed,
    /// and may set aside completions for the driver. Wake the driver to
    /// handle them and arm again before it sleeps, or messages that come
    /// later would find nobody listening for their wake-up.
    fn self_forward_ran(&self, e: &Engine, dest: &Addr) {
        if dest == e.self_addr() {
            self.rearm.notify_one();
        }
    }

    /// Wakes whoever awaits [`AsyncEngine::drained`] if `e` drains: what
    /// it waits for may have happened. Call with the engine locked.
    fn drain_may_have_moved(&self, e: &Engine) {
        if e.is_draining() {
            self.drain_moved.notify_waiters();
        }
    }

    /// What a task that started transfers does in place of waiting for the
    /// driver: files the ends the transports have ready and wakes their
    /// waiters, without running handlers (they stay on the driver's task)
    /// or filing responses. Call with the engine locked, and wake the
    /// driver after it (`rearm`): the poll may have found other work, and
    /// left the transports unarmed.
    pub(super) fn file_transfer_ends(&self, e: &mut Engine) {
        if let Err(err) = e.file_transfer_ends() {
            tracing::warn!(error = %err, "hg-rpc: progress failed while filing transfer ends");
        }
        self.notify_finished(e);
    }

    /// Starts a task per request waiting for an async handler. Call with
    /// the engine locked.
    fn spawn_deferred(self: &Arc<Self>, e: &mut Engine) {
        while let Some(req) = e.take_deferred() {
            let handler = self
                .async_handlers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&req.rpc_id())
                .cloned();
            let Some(handler) = handler else {
                e.respond_deferred(req, Err("no async handler installed".into()));
                continue;
            };
            // Weak: a handler still running when the AsyncEngine is dropped
            // does not keep the engine (its listener, connections, shared
            // memory) alive; its answer is dropped.
            let shared = Arc::downgrade(self);
            let mut req = req;
            // The handler owns the input; answering needs only the
            // request's header and source.
            let input = std::mem::take(&mut req.payload);
            let transfers = ctx::HandlerTransfers::new();
            // Made before the task, and moved into it: answers if the task
            // is dropped before its handler's answer went, even unpolled
            // (a runtime shut down meanwhile, or already closed, which
            // drops the task inside `spawn`).
            let guard = AnswerIfDropped {
                req: Some(req),
                shared: shared.clone(),
                transfers: transfers.clone(),
            };
            self.runtime.spawn(async move {
                // First, so dropped last (after the handler's transfers).
                let mut unanswered = guard;
                let source = unanswered.req.as_ref().map(|r| r.source().clone());
                let Some(source) = source else { return };
                let ctx = AsyncBulkCtx::new(source, shared.clone(), transfers.clone());
                let result = answer_even_if_it_panics(&handler, ctx, input).await;
                // The handler's transfers (dropped ones, and those of a
                // context it kept past its return) end before its answer.
                ctx::wait_for_transfers(&transfers, &shared).await;
                let Some(req) = unanswered.req.take() else { return };
                if !transfers.lock().is_idle() {
                    // A transfer given up with its end unknown (the driver
                    // stopped under it) may still move data, and the
                    // caller may free its memory at the answer.
                    tracing::warn!(
                        peer = %req.source(),
                        "an async handler's transfers may still move data (the driver stopped under them): \
                         its caller gets no answer"
                    );
                    return;
                }
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let mut e = shared.engine();
                let kept = e.kept_bytes();
                e.respond_deferred(req, result);
                shared.notify_finished(&mut e);
                shared.rearm_if_more_kept(&e, kept);
                shared.drain_may_have_moved(&e);
            });
        }
        self.answer_orphans(e);
    }

    /// Answers the requests whose handler task was dropped while the
    /// engine was locked (see [`AnswerIfDropped`]). Call with the engine
    /// locked.
    fn answer_orphans(&self, e: &mut Engine) {
        if !self.has_orphans.load(Ordering::Acquire) {
            return;
        }
        let orphans = {
            let mut o = self.orphans.lock().unwrap_or_else(|p| p.into_inner());
            self.has_orphans.store(false, Ordering::Release);
            std::mem::take(&mut *o)
        };
        for req in orphans {
            e.respond_deferred(req, Err(DROPPED_HANDLER.into()));
        }
        self.notify_finished(e);
        self.drain_may_have_moved(e);
    }
}

/// Why the driver stopped after [`AsyncEngine::shutdown`].
const SHUT_DOWN: &str = "AsyncEngine::shutdown was called";

/// The handler error a request gets whose handler task was dropped.
const DROPPED_HANDLER: &str =
    "the handler's task was dropped before it answered (its runtime shut down, or the task was aborted)";

/// An async handler's request while its task runs (made before the task,
/// so it covers a task dropped unpolled). If the task is dropped before it
/// answered (its runtime shut down, or it was aborted), the caller is told
/// so at once, not left to its timeout, provided none of the handler's
/// transfers may still be moving data (the caller may free its memory at
/// the answer; then it is left unanswered, with a warning). With the
/// engine locked (by this thread: a task dropped inside `spawn`; or by
/// another), the request waits in `Shared::orphans` for the next turn.
struct AnswerIfDropped {
    req: Option<crate::engine::DeferredRequest>,
    shared: std::sync::Weak<Shared>,
    transfers: Arc<ctx::HandlerTransfers>,
}

impl Drop for AnswerIfDropped {
    fn drop(&mut self) {
        let Some(req) = self.req.take() else { return };
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if !self.transfers.lock().is_idle() {
            tracing::warn!(
                peer = %req.source(),
                "an async handler's task was dropped before it answered, with transfers that may still move \
                 data: its caller gets no answer"
            );
            return;
        }
        tracing::warn!(peer = %req.source(), "an async handler's task was dropped before it answered; answering with an error");
        // `try_lock`: this thread may hold the engine (a task dropped
        // inside `spawn`), and another may for long (never wait in a drop).
        if let Ok(mut e) = shared.engine.try_lock() {
            e.respond_deferred(req, Err(DROPPED_HANDLER.into()));
            shared.notify_finished(&mut e);
            shared.drain_may_have_moved(&e);
            return;
        }
        shared.orphans.lock().unwrap_or_else(|p| p.into_inner()).push(req);
        shared.has_orphans.store(true, Ordering::Release);
        shared.rearm.notify_one();
    }
}

/// Runs an async handler to its result; a panic (while making the future
/// or polling it) becomes a handler error, so the caller is answered
/// instead of waiting for its timeout.
async fn answer_even_if_it_panics(
    handler: &AsyncHandler,
    ctx: AsyncBulkCtx,
    input: Vec<u8>,
) -> std::result::Result<Vec<u8>, String> {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::task::Poll;
    let panicked = |payload: Box<dyn std::any::Any + Send>| {
        format!(
            "the handler panicked: {}",
            crate::engine::serve_ops::panic_text(&*payload)
        )
    };
    // AssertUnwindSafe: after a panic the future is never polled again and
    // the handler's state is dropped; only the error leaves.
    let mut fut = match catch_unwind(AssertUnwindSafe(|| handler(ctx, input))) {
        Ok(f) => f,
        Err(p) => return Err(panicked(p)),
    };
    std::future::poll_fn(
        |cx| match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(poll) => poll,
            Err(p) => Poll::Ready(Err(panicked(p))),
        },
    )
    .await
}

/// An [`Engine`] driven by a tokio task; calls are futures.
///
/// Create it inside a tokio runtime with [`AsyncEngine::spawn`]; the
/// runtime needs both its I/O and its time drivers (`enable_all`, as
/// `#[tokio::main]` and `#[tokio::test]` set up): the driver sleeps on the
/// endpoint's fd, and timeouts, TTLs and the pause after a failed turn
/// are timers. Dropping a call's future abandons the call cleanly (a late
/// response is discarded). Dropping the `AsyncEngine` stops the driver.
///
/// Its futures (calls, [`drained`](Self::drained), transfers) need not be
/// polled on that runtime: another runtime, one built without timers, or
/// an executor that is no tokio runtime at all may poll them. Their
/// timers are made on the engine's runtime, which must keep running (as
/// the driver needs it to anyway).
pub struct AsyncEngine {
    shared: Arc<Shared>,
    driver: JoinHandle<()>,
}

impl AsyncEngine {
    /// Moves `engine` behind a driver task on the current tokio runtime.
    /// The driver sleeps on the endpoint's fd whenever nothing is ready:
    /// no CPU while waiting, and a kernel wake-up (tens of microseconds on
    /// a VM) for each message that comes while it sleeps. See
    /// [`spawn_with_spin`](Self::spawn_with_spin) for the other trade.
    pub fn spawn(engine: Engine) -> io::Result<Self> {
        Self::spawn_with_spin(engine, Duration::ZERO)
    }

    /// [`spawn`](Self::spawn), with a driver that, after a turn that found
    /// work, keeps polling (yielding to the runtime's other tasks between
    /// turns) until `spin` has passed without work, and only then sleeps
    /// on the fd: what [`ProgressMode::Adaptive`](na_core::ProgressMode)
    /// is to the blocking API. While calls follow each other closer than
    /// `spin`, their responses are seen without a kernel wake-up (one call
    /// in flight goes from about ten thousand calls a second to several
    /// hundred thousand on a VM, see `hg-perf rate --mode
    /// tokio-adaptive`); the price is a runtime worker kept busy during
    /// the window. An idle engine
    /// still uses no CPU once the window has passed. `Duration::ZERO` is
    /// `spawn`. [`RpcStats::driver_sleeps`](crate::RpcStats) counts the
    /// sleeps. Outside a tokio runtime, or in one built without I/O or
    /// time, this is an error (tokio's own panic message is printed). Under tokio's
    /// paused test clock (`tokio::time::pause`) a driver keeping spilled
    /// data for a TTL wakes at once again and again until the TTL passes
    /// in real time (its deadlines are real time): do not pause the clock
    /// around engines that keep such data.
    pub fn spawn_with_spin(mut engine: Engine, spin: Duration) -> io::Result<Self> {
        // Outside a runtime: an error, not tokio's panic.
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            io::Error::other(format!(
                "AsyncEngine::spawn must be called inside a tokio runtime: {e}"
            ))
        })?;
        drop(needs_driver("time (`enable_time`)", || {
            Ok(tokio::time::sleep(Duration::ZERO))
        })?);
        let fd = engine.endpoint().as_raw_fd();
        engine.log_finished();
        engine.log_finished_bulks();
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            waiters: Mutex::new(Waiters::default()),
            async_handlers: Mutex::new(FastMap::default()),
            finished: Mutex::new((Vec::new(), Vec::new())),
            rearm: tokio::sync::Notify::new(),
            orphans: Mutex::new(Vec::new()),
            has_orphans: AtomicBool::new(false),
            drain_moved: tokio::sync::Notify::new(),
            room: tokio::sync::Notify::new(),
            runtime,
            stopped: AtomicBool::new(false),
            sleeps: AtomicU64::new(0),
        });
        // Shared never gives out `&mut Engine` (so the endpoint and its fd
        // cannot be replaced): that is what `sys::async_fd::register` needs.
        let afd = needs_driver("I/O (`enable_io`)", || {
            crate::sys::async_fd::register(fd, shared.clone())
        })?;
        // Made here, not in `drive`: a task dropped before its first poll
        // (its runtime shut down at once) drops its arguments but never
        // ran its body.
        let exit = DriverExit {
            shared: shared.clone(),
            reason: None,
        };
        let driver = tokio::spawn(drive(shared.clone(), afd, exit, spin));
        Ok(AsyncEngine { shared, driver })
    }

    /// Registers a handler (see [`Engine::register`]). It runs with the
    /// engine locked, on the driver task (or, for a call to this engine's
    /// own address, on the caller's task, in place), so it cannot call this
    /// `AsyncEngine`: from the handler's own thread, a method that
    /// returns a `Result` fails with
    /// [`RpcError::HandlerReentry`] (instead of waiting on itself
    /// forever), and `stats` and `self_addr` panic, which the caller sees
    /// as a handler error. (Another thread the handler waits for, which
    /// calls the engine, still deadlocks: that is not detected.) A handler
    /// that calls the engine, or that takes long, belongs in
    /// [`register_async`](Self::register_async).
    /// A panic in it answers the caller with a handler error.
    ///
    /// Nor may a plain handler call the blocking methods of **another**
    /// `AsyncEngine` (every method locks its engine, `call_one_way`,
    /// `expose`, `stats` and `self_addr` included) if that engine's plain
    /// handlers may, directly or through other engines, call this one:
    /// each handler then holds its own engine locked while it waits for
    /// the other's lock, and both drivers hang for good. Only a call of
    /// the handler's own engine is detected (the
    /// [`RpcError::HandlerReentry`] above); this is not. Handlers that
    /// call engines belong in [`register_async`](Self::register_async),
    /// whose tasks hold no engine locked.
    ///
    /// The engine owns its handlers: a handler that holds this engine (an
    /// `Arc<AsyncEngine>` captured by its closure) keeps it alive for ever,
    /// its driver, listener and shared memory included, even once every
    /// other `Arc` is dropped. Capture a
    /// [`Weak`](std::sync::Weak)`<AsyncEngine>` instead, or call
    /// [`shutdown`](Self::shutdown) before dropping the engine. Once the
    /// engine is shut down (or its driver stopped otherwise), registering
    /// fails with [`RpcError::DriverStopped`].
    pub fn register<R: Rpc>(
        &self,
        handler: impl FnMut(R::Input) -> std::result::Result<R::Output, String> + Send + 'static,
    ) -> Result<()> {
        let mut e = self.shared.try_engine("AsyncEngine::register")?;
        // Under the engine lock, which `shutdown` holds while it stops the
        // engine and takes the handlers out: none is left behind.
        self.shared.check_running_quiet("AsyncEngine::register")?;
        e.register::<R>(handler)
    }

    /// Registers an async handler for `R`: each request runs as its own
    /// tokio task, so a slow handler does not hold up others.
    ///
    /// A handler that makes calls on this engine (a nested RPC) needs the
    /// engine in its closure: capture a
    /// [`Weak`](std::sync::Weak)`<AsyncEngine>` and upgrade it per request,
    /// or capture an `Arc` and call [`shutdown`](Self::shutdown) before
    /// dropping the engine. The engine owns its handlers, so an `Arc` in
    /// one is a cycle: dropping every other `Arc` then stops nothing, and
    /// the driver, listener and shared memory live for ever. Registering
    /// on an engine shut down (or whose driver stopped) fails with
    /// [`RpcError::DriverStopped`].
    pub fn register_async<R, F, Fut>(&self, handler: F) -> Result<()>
    where
        R: Rpc,
        F: Fn(R::Input) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R::Output, String>> + Send + 'static,
    {
        self.register_async_with_bulk::<R, _, _>(move |_, input| handler(input))
    }

    /// [`register_async`](Self::register_async) for a handler that moves
    /// bulk data with its caller while it runs, through its
    /// [`AsyncBulkCtx`] (the async [`BulkCtx`](crate::BulkCtx)): for
    /// example a `put` that pulls the data from the client's handle in its
    /// request. The context knows the caller, so a transfer with a handle
    /// someone else owns is refused. The engine owns the handler: see
    /// [`register_async`](Self::register_async) on a handler that holds
    /// its engine.
    pub fn register_async_with_bulk<R, F, Fut>(&self, handler: F) -> Result<()>
    where
        R: Rpc,
        F: Fn(AsyncBulkCtx, R::Input) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R::Output, String>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let run: AsyncHandler = Arc::new(move |ctx: AsyncBulkCtx, payload: Vec<u8>| {
            let handler = handler.clone();
            Box::pin(async move {
                let input: R::Input = Postcard
                    .decode(&payload)
                    .map_err(|e| format!("decoding input of {}: {e}", R::NAME))?;
                let output = handler(ctx, input).await?;
                let mut out = Vec::new();
                Postcard
                    .encode(&output, &mut out)
                    .map_err(|e| format!("encoding output of {}: {e}", R::NAME))?;
                Ok(out)
            })
        });
        // Both under the engine lock, which the driver holds while it hands
        // requests to handlers: none sees the RPC registered without its
        // handler installed.
        let mut e = self.shared.try_engine("AsyncEngine::register_async")?;
        // Under the engine lock, as in `register`.
        self.shared.check_running_quiet("AsyncEngine::register_async")?;
        e.register_deferred::<R>()?;
        self.shared
            .async_handlers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(crate::rpc_id(R::NAME), run);
        Ok(())
    }

    /// Looks up a peer address on the engine's own plugin (see
    /// [`Engine::lookup`](crate::Engine::lookup)), connecting to it if
    /// needed, without blocking the engine: where the
    /// transport would wait to connect (na-sm: a peer whose listener is
    /// hung or overloaded and does not accept, its queue full), this task
    /// waits instead, trying again after short pauses (1 ms, doubling to
    /// 20 ms) taken without the engine lock, while the driver, other
    /// tasks' calls and handlers go on. If the transport's bound for a
    /// lookup passes first (na-sm: `SmConfig::handshake_timeout`, 5 s by
    /// default), the answer is the error the blocking
    /// [`Endpoint::lookup`](na_core::Endpoint::lookup) gives then:
    /// [`RpcError::Transport`] of
    /// [`NaError::Lookup`](na_core::NaError::Lookup) naming the peer, whose
    /// source is of kind [`TimedOut`](std::io::ErrorKind::TimedOut).
    /// Dropping the future gives the lookup up (nothing is left
    /// half-connected). The address must be of the engine's plugin's
    /// scheme (an address of another plugin could not be called anyway:
    /// [`RpcError::ForeignAddress`]). Under tokio's paused test clock
    /// (`tokio::time::pause`) the pauses between attempts take no real
    /// time while the transport's bound is real time: a lookup of a peer
    /// that never accepts then retries without pause until that bound.
    pub async fn lookup(&self, uri: &str) -> Result<Addr> {
        let (_engine, addr) = self
            .shared
            .retry_while_blocked("AsyncEngine::lookup", uri, Instant::now(), None, |e, since| {
                // The engine's own plugin (see `Engine::lookup`).
                let plugin = e.plugin();
                Ok(e.endpoint().plugin_mut(plugin)?.try_lookup(uri, since)?)
            })
            .await?;
        Ok(addr)
    }

    /// Our own address. Panics if called from a plain handler of this
    /// engine (see [`register`](Self::register)).
    pub fn self_addr(&self) -> Addr {
        self.shared
            .engine_for("AsyncEngine::self_addr")
            .self_addr()
            .clone()
    }

    /// The engine's counters. Panics if called from a plain handler of
    /// this engine (see [`register`](Self::register)).
    pub fn stats(&self) -> crate::RpcStats {
        crate::RpcStats {
            driver_sleeps: self.shared.sleeps.load(Ordering::Relaxed),
            ..self.shared.engine_for("AsyncEngine::stats").stats()
        }
    }
}

impl Drop for AsyncEngine {
    fn drop(&mut self) {
        let mut w = self.shared.waiters();
        self.shared
            .mark_stopped(&mut w, || "the AsyncEngine was dropped".into());
        drop(w);
        self.driver.abort();
    }
}

/// Runs `probe`, which tokio makes panic in a runtime built without the
/// driver `what` names (the engine's driver task needs both I/O and
/// time): that is an error for the caller of `spawn`, not a panic at
/// registration or, worse, in the driver task at its first sleep.
fn needs_driver<T>(what: &str, probe: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(probe)) {
        Ok(r) => r,
        // Only tokio's "... is disabled" / "... are disabled" panics: any
        // other goes on unwinding.
        Err(payload) if crate::engine::serve_ops::panic_text(payload.as_ref()).contains(" disabled") => {
            Err(io::Error::other(format!(
                "AsyncEngine::spawn needs a tokio runtime with {what} enabled (`enable_all` on its builder)"
            )))
        }
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

fn lost(rpc: &str) -> RpcError {
    RpcError::Transport(na_core::NaError::Plugin {
        plugin: "hg-rpc",
        message: format!("the engine driver stopped before {rpc} finished"),
    })
}

/// The error of a call the stopped driver (`why`) cannot serve.
fn driver_stopped(rpc: &str, why: &str) -> RpcError {
    RpcError::DriverStopped {
        rpc: rpc.into(),
        reason: why.into(),
    }
}

/// The calls tasks wait for, by id, and why the driver stopped.
#[derive(Default)]
struct Waiters {
    calls: FastMap<CallId, oneshot::Sender<()>>,
    /// Transfers of [`AsyncEngine::bulk`] in flight.
    bulks: FastMap<BulkId, oneshot::Sender<()>>,
    /// Set once, when the driver task ends: nothing files responses any
    /// more, so a call fails at once instead of waiting for its timeout.
    stopped: Option<String>,
}

/// The longest [`AsyncEngine::drained`] waits between two looks when
/// nothing wakes it (a safety net: the driver's turns and async handlers'
/// answers wake it).
pub const DRAIN_RECHECK: Duration = Duration::from_millis(50);

/// The first pause of a lookup that would wait to connect (see
/// [`AsyncEngine::lookup`]) before it tries again; each later pause is
/// twice the one before, up to [`LOOKUP_RETRY_MAX`].
pub(crate) const LOOKUP_RETRY_FIRST: Duration = Duration::from_millis(1);

/// See [`LOOKUP_RETRY_FIRST`].
pub(crate) const LOOKUP_RETRY_MAX: Duration = Duration::from_millis(20);

/// The pauses between the tries of a lookup that would wait to connect:
/// [`LOOKUP_RETRY_FIRST`], then each twice the one before up to
/// [`LOOKUP_RETRY_MAX`], never past what the caller has left. Shared by
/// the async engine's pauses (without the lock) and the blocking ones
/// (driving the engine or a handler's endpoint meanwhile).
pub(crate) struct LookupBackoff {
    next: Duration,
}

impl LookupBackoff {
    /// Before the first pause.
    pub(crate) fn new() -> Self {
        LookupBackoff {
            next: LOOKUP_RETRY_FIRST,
        }
    }

    /// The next pause, cut to `left` (the caller's time left; `None`: no
    /// bound), or `None` once nothing is left.
    pub(crate) fn next_pause(&mut self, left: Option<Duration>) -> Option<Duration> {
        let pause = match left {
            Some(left) if left.is_zero() => return None,
            Some(left) => self.next.min(left),
            None => self.next,
        };
        self.next = (self.next * 2).min(LOOKUP_RETRY_MAX);
        Some(pause)
    }

    /// The next pause before `deadline`, spent in `drive(wait)` (called
    /// until the pause has passed, with what is left of it: progress
    /// that may return early). `Ok(false)`, driving nothing, once
    /// `deadline` has passed.
    pub(crate) fn drive_pause<E>(
        &mut self,
        deadline: Instant,
        mut drive: impl FnMut(Duration) -> std::result::Result<(), E>,
    ) -> std::result::Result<bool, E> {
        let Some(pause) = self.next_pause(Some(deadline.saturating_duration_since(Instant::now()))) else {
            return Ok(false);
        };
        let retry_at = Instant::now() + pause;
        loop {
            let wait = retry_at.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Ok(true);
            }
            drive(wait)?;
        }
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn lookup_pauses_double_up_to_the_cap_and_never_pass_what_is_left() {
        let ms = Duration::from_millis;
        let mut b = LookupBackoff::new();
        let pauses: Vec<_> = (0..7).map(|_| b.next_pause(None).unwrap()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 20, 20].map(ms));
        let mut b = LookupBackoff::new();
        assert_eq!(b.next_pause(Some(ms(5))), Some(ms(1)));
        assert_eq!(b.next_pause(Some(ms(1))), Some(ms(1)), "cut to what is left");
        assert_eq!(b.next_pause(Some(Duration::ZERO)), None);
        let past = Instant::now();
        assert_eq!(
            b.drive_pause::<()>(past, |_| unreachable!("nothing left")),
            Ok(false)
        );
        // The next pause (4 ms) is spent driving, in steps that return early.
        let (t0, mut calls) = (Instant::now(), 0);
        let paused = b.drive_pause::<()>(t0 + Duration::from_secs(5), |wait| {
            calls += 1;
            std::thread::sleep(wait.min(ms(1)));
            Ok(())
        });
        assert_eq!(paused, Ok(true));
        assert!(t0.elapsed() >= ms(4), "{:?}", t0.elapsed());
        assert!(calls >= 2, "driven again until the pause passed: {calls}");
        assert_eq!(
            b.drive_pause(t0 + Duration::from_secs(5), |_| Err("broken")),
            Err("broken")
        );
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    /// Only tokio's "disabled" panics become the error; any other panic
    /// of the probe goes on.
    #[test]
    fn needs_driver_maps_only_tokios_disabled_panics() {
        let e = needs_driver("time", || -> io::Result<()> {
            panic!("A Tokio 1.x context was found, but timers are disabled.")
        })
        .unwrap_err();
        assert!(e.to_string().contains("with time enabled"), "{e}");
        let other =
            std::panic::catch_unwind(|| needs_driver("time", || -> io::Result<()> { panic!("boom") }));
        assert!(other.is_err(), "another panic was turned into an error");
        assert_eq!(needs_driver("time", || Ok(5)).unwrap(), 5);
    }
}
