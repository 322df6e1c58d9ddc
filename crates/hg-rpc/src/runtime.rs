//! The tokio front end: `.await` on calls, one driver task per engine.
//!
//! The driver waits on the endpoint's epoll fd through tokio's `AsyncFd`:
//! no thread spins, and an idle engine uses no CPU. Each wake-up it polls
//! the transports, runs handlers, files responses and wakes the tasks whose
//! calls finished, then sleeps again once every plugin agreed (`try_wait`).

use std::cell::RefCell;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;
use na_core::Addr;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::engine::{BulkId, CallId, Engine};
use crate::error::{Result, RpcError};
use crate::lookup_backoff::LookupBackoff;
#[cfg(doc)]
use crate::lookup_backoff::{LOOKUP_RETRY_FIRST, LOOKUP_RETRY_MAX};

#[path = "runtime_bulk.rs"]
mod bulk;
#[path = "runtime_call.rs"]
mod call;
#[path = "runtime_ctx.rs"]
mod ctx;
#[path = "runtime_driver.rs"]
mod driver;
#[path = "runtime_handlers.rs"]
mod handlers;
#[path = "runtime_stop.rs"]
mod stop;
pub use ctx::AsyncBulkCtx;
use driver::{drive, DriverExit};
pub use driver::{DRIVER_FAILURE_GAP, DRIVER_FAILURE_LIMIT};
use handlers::AsyncHandler;

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
    /// [`AsyncEngine::shutdown`] was called (set with `stopped`, under the
    /// engine lock): the engine is done for good, and what works without
    /// a driver (a lookup, an `expose`) is refused too.
    shut_down: AtomicBool,
    /// Times the driver went to sleep on the fd (`RpcStats::driver_sleeps`).
    sleeps: AtomicU64,
    /// Requests whose handler task was dropped unanswered while the engine
    /// was locked (see [`AnswerIfDropped`](handlers::AnswerIfDropped)): answered by the next
    /// `spawn_deferred` (each driver turn runs one).
    orphans: Mutex<Vec<crate::engine::DeferredRequest>>,
    /// `orphans` is not empty (checked without its lock).
    has_orphans: AtomicBool,
    /// The deadline the driver sleeps until, as [`Shared::code`] encodes
    /// it ([`AWAKE`] while it turns, [`NO_DEADLINE`] for none): set under
    /// the engine lock as it decides to sleep, so work done outside its
    /// turn under that lock knows whether the driver would wake in time
    /// for the engine's next expiry ([`Shared::wake_if_sooner`]).
    sleeps_until: AtomicU64,
    /// The instant `sleeps_until` counts from (the engine's spawn).
    epoch: Instant,
}

/// [`Shared::sleeps_until`] while the driver is awake: it asks the
/// engine's next expiry anew before it sleeps, so nothing need wake it.
const AWAKE: u64 = 0;

/// [`Shared::sleeps_until`] while the driver sleeps with no deadline.
const NO_DEADLINE: u64 = u64::MAX;

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
        self.try_engine(what)
            .unwrap_or_else(|e| panic!("{}", na_core::ErrorChain(&e)))
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

    /// Refuses `what` (work that needs no driver: a lookup, an `expose`)
    /// once [`AsyncEngine::shutdown`] was called, with the error calls get
    /// then. Call with the engine locked (`shutdown` sets the flag under
    /// that lock, so nothing started under it comes after).
    fn check_not_shut_down(&self, what: &str) -> Result<()> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(driver_stopped(what, SHUT_DOWN));
        }
        Ok(())
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
                                reason = %na_core::ErrorChain(&err),
                                "hg-rpc: lookup waits (retrying without the engine lock)"
                            );
                        }
                    }
                    Err(err) => {
                        if waited {
                            tracing::warn!(peer, waited = ?since.elapsed(), error = %na_core::ErrorChain(&err), "hg-rpc: lookup gave up");
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

    /// Wakes the driver to work out its deadline again if `e`'s
    /// [`next_expiry`](Engine::next_expiry) is now sooner than the
    /// deadline it sleeps until. Call with the engine locked, after any
    /// work done outside the driver's turn that may bring the next expiry
    /// forward: more spilled data kept for a TTL (a spilled one-way call,
    /// an async handler's spilled output, a call given up that keeps its
    /// input), a notice the transport refused that waits for a retry (a
    /// release of a waiting output, sent as an async handler's answer
    /// gives pull budget back).
    /// A driver asleep with a later deadline, or none, would otherwise
    /// let a TTL or a retry pass unnoticed until the next traffic. Nothing
    /// to do while the driver turns: it asks again before it sleeps.
    fn wake_if_sooner(&self, e: &Engine) {
        // The driver publishes its deadline under the engine lock, which
        // the caller holds: a sleep decided before is seen here, one
        // decided after sees this work.
        let asleep = self.sleeps_until.load(Ordering::Acquire);
        if asleep == AWAKE {
            return;
        }
        if self.code(e.next_expiry()) < asleep {
            // Stored if the driver is not waiting yet (it let the lock go
            // and has still to poll its sleep): that sleep ends at once.
            self.rearm.notify_one();
        }
    }

    /// The driver decided to sleep until `at` (none: until an event).
    /// Call with the engine locked.
    pub(super) fn sleeping_until(&self, at: Option<Instant>) {
        self.sleeps_until.store(self.code(at), Ordering::Release);
    }

    /// The driver woke up (it turns before it sleeps again).
    pub(super) fn woke(&self) {
        self.sleeps_until.store(AWAKE, Ordering::Release);
    }

    /// `at` as [`sleeps_until`](Self::sleeps_until) holds it: nanoseconds
    /// since `epoch` plus one (never [`AWAKE`]), [`NO_DEADLINE`] for none;
    /// sooner is smaller.
    fn code(&self, at: Option<Instant>) -> u64 {
        at.map_or(NO_DEADLINE, |at| {
            let since = at.saturating_duration_since(self.epoch).as_nanos();
            u64::try_from(since)
                .unwrap_or(u64::MAX)
                .saturating_add(1)
                .min(NO_DEADLINE - 1)
        })
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
            tracing::warn!(error = %na_core::ErrorChain(&err), "hg-rpc: progress failed while filing transfer ends");
        }
        self.notify_finished(e);
    }
}

/// Why the driver stopped after [`AsyncEngine::shutdown`].
const SHUT_DOWN: &str = "AsyncEngine::shutdown was called";

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
            shut_down: AtomicBool::new(false),
            sleeps: AtomicU64::new(0),
            // Awake: the driver works before it first sleeps.
            sleeps_until: AtomicU64::new(AWAKE),
            epoch: Instant::now(),
        });
        // A deferred request dropped unanswered (on any thread) gives its
        // pulled input's room back outside the engine: wake the driver to
        // try the outputs that wait for it (so its sleep needs no deadline
        // while they wait: `Engine::next_expiry`). Weak: the engine,
        // inside `Shared`, keeps the hook. (An engine that registered a
        // deferred handler before it was spawned keeps the hook that
        // made, the endpoint's `Waker`: its eventfd, in the epoll set the
        // driver sleeps on, wakes the driver as well.)
        let weak = Arc::downgrade(&shared);
        shared.engine().wake_on_returned_inputs(move || {
            if let Some(shared) = weak.upgrade() {
                shared.rearm.notify_one();
            }
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
    ///
    /// After [`shutdown`](Self::shutdown) it fails with
    /// [`RpcError::DriverStopped`], as calls do: the engine is done for
    /// good. A driver that stopped otherwise (its runtime shut down, a
    /// transport that kept failing) does not stop lookups, which need no
    /// driver (but calls to the address found then fail).
    pub async fn lookup(&self, uri: &str) -> Result<Addr> {
        let (_engine, addr) = self
            .shared
            .retry_while_blocked("AsyncEngine::lookup", uri, Instant::now(), None, |e, since| {
                self.shared.check_not_shut_down("AsyncEngine::lookup")?;
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
    /// this engine (see [`register`](Self::register)); code that may run
    /// there uses [`try_stats`](Self::try_stats).
    pub fn stats(&self) -> crate::RpcStats {
        crate::RpcStats {
            driver_sleeps: self.shared.sleeps.load(Ordering::Relaxed),
            ..self.shared.engine_for("AsyncEngine::stats").stats()
        }
    }

    /// [`stats`](Self::stats), or `None` instead of a panic where the
    /// engine cannot be read: from a plain handler of this engine, which
    /// runs with it locked (such a handler has its counters through
    /// [`BulkCtx::stats`](crate::BulkCtx::stats) if it is registered with
    /// [`register_with_bulk`](crate::Engine::register_with_bulk)).
    pub fn try_stats(&self) -> Option<crate::RpcStats> {
        let e = self.shared.try_engine("AsyncEngine::try_stats").ok()?;
        Some(crate::RpcStats {
            driver_sleeps: self.shared.sleeps.load(Ordering::Relaxed),
            ..e.stats()
        })
    }

    /// The counters of the engine's transport plugin (see
    /// [`Engine::transport_stats`](crate::Engine::transport_stats)): bytes
    /// its gets and puts moved, messages, peers. Panics if called from a
    /// plain handler of this engine, as [`stats`](Self::stats) does.
    pub fn transport_stats(&self) -> na_core::PluginStats {
        self.shared
            .engine_for("AsyncEngine::transport_stats")
            .transport_stats()
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

/// The error of the (argued unreachable) fallback where a waiter was woken
/// but the engine held no outcome for it (see `AsyncEngine::call`).
fn lost(rpc: &str) -> RpcError {
    RpcError::Transport(na_core::NaError::Plugin {
        plugin: "hg-rpc",
        message: format!(
            "the outcome of {rpc} was lost after its wake-up (an hg-rpc defect: please report it)"
        ),
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

#[cfg(test)]
#[path = "runtime_wake_tests.rs"]
mod wake_tests;

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
