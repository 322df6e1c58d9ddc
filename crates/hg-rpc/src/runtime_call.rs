//! Calls of an [`AsyncEngine`]: `call` with `.await`, the one-way calls,
//! and the wait for room of a spilled input refused for the inputs held
//! for abandoned calls ([`RpcError::InputsHeld`]).
//!
//! That wait is woken, not polled: the driver notifies `Shared::room`
//! after a turn that gave held input bytes back (targets answered, went
//! away, or a TTL ended in the sweep) and when it stops. A waiting call
//! registers for the notification before each attempt, so room given
//! back between a refusal and the wait is not missed; a future dropped
//! while it waits has started nothing, and its registration goes with it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use na_core::Addr;
use tokio::sync::oneshot;

use super::{driver_stopped, lost, AsyncEngine, Shared};
use crate::engine::CallId;
use crate::error::{Result, RpcError};
use crate::rpc::Rpc;

impl AsyncEngine {
    /// Calls `R` on `dest`; fails with [`RpcError::Timeout`] after `timeout`.
    ///
    /// The timeout covers the whole call. A spilled input refused for the
    /// inputs held for abandoned calls ([`RpcError::InputsHeld`], see
    /// [`Engine::set_max_abandoned_bytes`](crate::Engine::set_max_abandoned_bytes))
    /// waits for room within it, woken when the driver gives held bytes
    /// back (not by polling); if none comes in time the call fails with
    /// `InputsHeld`, not `Timeout`, counted once in `errors` (each refused
    /// attempt counts in `inputs_refused`). If the driver stops meanwhile,
    /// the call fails at once with [`RpcError::DriverStopped`]. A call
    /// dropped while it waits for room has sent nothing and leaves
    /// nothing behind.
    ///
    /// A zero timeout waits for nothing, as
    /// [`Engine::call`](crate::Engine::call)'s does: the request is sent
    /// and the call answers only if its answer is there already (a call
    /// to this engine's own address that a plain handler answered in
    /// place); otherwise it fails at once with [`RpcError::Timeout`]
    /// (not after the tokio timer's next tick, which a response could beat).
    pub async fn call<R: Rpc>(&self, dest: &Addr, input: &R::Input, timeout: Duration) -> Result<R::Output> {
        let attempt = || {
            let (tx, rx) = oneshot::channel();
            match self.start_call::<R>(dest, input, tx) {
                Ok(id) => Ok(Ok((id, rx))),
                Err(Err(e @ RpcError::InputsHeld { .. })) => Err(e),
                Err(done) => Ok(Err(done)),
            }
        };
        let ((id, mut rx), refused_at) = match self.with_room(timeout, attempt).await {
            Ok((Ok(started), refused_at)) => (started, refused_at),
            Ok((Err(done), _)) => {
                // Never ready at once without a yield: a caller that
                // calls itself in a loop must let the driver and timers
                // run.
                tokio::task::consume_budget().await;
                return done;
            }
            Err(refused) => return Err(refused),
        };
        let left = refused_at.map_or(timeout, |t| timeout.saturating_sub(t.elapsed()));
        let mut guard = Abandon {
            shared: &self.shared,
            id,
            armed: true,
            failed: false,
        };
        let waited = if left.is_zero() {
            na_core::hint::cold_path();
            // No wait: `timeout` would poll `rx` and then a timer that
            // ends at the tokio timer's next tick, not now.
            match rx.try_recv() {
                Ok(()) => Ok(Ok(())),
                Err(oneshot::error::TryRecvError::Closed) => Ok(Err(())),
                Err(oneshot::error::TryRecvError::Empty) => Err(()),
            }
        } else {
            match self.shared.timer(|| tokio::time::timeout(left, rx)).await {
                Ok(r) => Ok(r.map_err(|_| ())),
                Err(_) => Err(()),
            }
        };
        match waited {
            Ok(Ok(())) => {
                guard.armed = false;
                let mut e = self.shared.engine();
                let r = e.take_response::<R>(id);
                // Unreachable: the driver wakes a call only for an id in
                // the engine's log of calls whose outcome it filed
                // (`notify_finished`), a filed outcome leaves the engine
                // only through `take_response` or `give_up` of that id,
                // which only this future (and its guard, disarmed now)
                // knows, and a stopped driver drops the senders (the
                // `Err` arm below) without touching the engine. Log
                // entries are taken before a call registers its waiter
                // (`start_call`), and a cookie's generation keeps a
                // reused slot's id apart. Should it happen anyway, the
                // call still counts once, in `errors`, so that
                // `calls == succeeded + errors + abandoned + in_flight`.
                debug_assert!(
                    r.is_some(),
                    "call {id:?} woken without its response in the engine"
                );
                r.unwrap_or_else(|| {
                    na_core::hint::cold_path();
                    e.count_error();
                    Err(lost(R::NAME))
                })
            }
            // The driver stopped: the guard abandons the call (its input
            // stays exposed for the TTL only if the engine is used again).
            Ok(Err(_)) => {
                let why = self.shared.waiters().stopped.clone().unwrap_or_default();
                self.shared.engine().count_error();
                guard.failed = true;
                Err(driver_stopped(R::NAME, &why))
            }
            Err(_) => {
                self.shared.engine().count_error();
                guard.failed = true;
                Err(RpcError::Timeout {
                    rpc: R::NAME.into(),
                    millis: timeout.as_millis(),
                })
            }
        }
    }

    /// Makes `attempt` until it is not refused for held inputs (`Err`,
    /// always an [`RpcError::InputsHeld`]), waiting between attempts for
    /// the driver to give held bytes back, within `timeout`. Gives the
    /// first attempt that was not refused (`Ok`, with when the first
    /// refusal was, if any: the caller's timeout has run since), or the
    /// last refusal once `timeout` passed without room (counted once as
    /// an error). A stop of the driver ends the wait: `attempt` must then
    /// fail with the stop's error (every attempt checks that the driver
    /// runs first). A call that is not refused reads no clock here.
    async fn with_room<T>(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut() -> std::result::Result<T, RpcError>,
    ) -> Result<(T, Option<Instant>)> {
        let mut refused_at: Option<Instant> = None;
        loop {
            // Registered before the attempt: room given back between a
            // refusal and the wait is not missed.
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            let refused = match attempt() {
                Ok(v) => return Ok((v, refused_at)),
                Err(e) => e,
            };
            if self.shared.stopped.load(Ordering::Acquire) {
                // The next attempt fails with the stop's own error, as
                // any call after it does.
                continue;
            }
            let left = timeout.saturating_sub(refused_at.get_or_insert_with(Instant::now).elapsed());
            if left.is_zero()
                || self
                    .shared
                    .timer(|| tokio::time::timeout(left, room))
                    .await
                    .is_err()
            {
                self.shared.engine().count_error();
                // A zero timeout awaited nothing: yield all the same.
                tokio::task::consume_budget().await;
                return Err(refused);
            }
        }
    }

    /// The engine's part of [`call`](Self::call): forwards and registers
    /// the waiter (`Ok(id)`), or gives the call's end when it is known at
    /// once (`Err`: refused, or a self-forward answered in place).
    fn start_call<R: Rpc>(
        &self,
        dest: &Addr,
        input: &R::Input,
        tx: oneshot::Sender<()>,
    ) -> std::result::Result<CallId, Result<R::Output>> {
        let mut e = self.shared.try_engine("AsyncEngine::call").map_err(Err)?;
        self.shared.check_running(R::NAME, &mut e).map_err(Err)?;
        // A refusal for held inputs counts once, when `call` gives up.
        let id = e
            .forward::<R>(dest, input)
            .inspect_err(|err| {
                if !matches!(err, RpcError::InputsHeld { .. }) {
                    e.count_error()
                }
            })
            .map_err(Err)?;
        self.shared.self_forward_ran(&e, dest);
        // A self-forward to an async handler is answered by a task.
        self.shared.spawn_deferred(&mut e);
        // A self-forward to a plain handler finished right here: its id
        // leaves the engine's log now, not at the driver's next wake-up
        // (which only network work brings).
        self.shared.notify_finished(&mut e);
        if let Some(r) = e.take_response::<R>(id) {
            return Err(r);
        }
        // Registered under the engine lock, which the driver holds while it
        // files responses: it cannot miss this call. Nor can its stop
        // (registered under the waiters' lock, which the exit holds while
        // it fails the waiting calls).
        let mut w = self.shared.waiters();
        if let Some(why) = &w.stopped {
            let err = driver_stopped(R::NAME, why);
            drop(w);
            e.give_up(id);
            e.count_error();
            return Err(Err(err));
        }
        w.calls.insert(id, tx);
        Ok(id)
    }

    /// Sends a one-way request, at once: a spilled input refused for the
    /// inputs held for abandoned calls fails with
    /// [`RpcError::InputsHeld`] now (this method does not wait, and may
    /// be called from outside any task);
    /// [`call_one_way_within`](Self::call_one_way_within) waits for room.
    pub fn call_one_way<R: Rpc>(&self, dest: &Addr, input: &R::Input) -> Result<()> {
        self.one_way::<R>("AsyncEngine::call_one_way", dest, input, true)
    }

    /// Sends a one-way request as [`call_one_way`](Self::call_one_way)
    /// does, but a spilled input refused for the inputs held for abandoned
    /// calls ([`RpcError::InputsHeld`]) waits for room, at most `timeout`,
    /// as [`call`](Self::call) does: woken when the driver gives held
    /// bytes back, failing with `InputsHeld` (counted once in `errors`) if
    /// none came in time, or with [`RpcError::DriverStopped`] once the
    /// driver stops. Dropped while it waits, it has sent nothing. A
    /// request that is not refused is sent without waiting (`timeout`
    /// bounds only the wait for room: nothing answers a one-way request).
    pub async fn call_one_way_within<R: Rpc>(
        &self,
        dest: &Addr,
        input: &R::Input,
        timeout: Duration,
    ) -> Result<()> {
        let attempt = || match self.one_way::<R>("AsyncEngine::call_one_way_within", dest, input, false) {
            Err(e @ RpcError::InputsHeld { .. }) => Err(e),
            sent => Ok(sent),
        };
        let (sent, _) = self.with_room(timeout, attempt).await?;
        // Ready at once otherwise: a loop of one-way calls must let the
        // driver and timers run.
        tokio::task::consume_budget().await;
        sent
    }

    /// The engine's part of a one-way call (`what` names the method for
    /// the error of a call from a plain handler); a refusal for held
    /// inputs counts as an error only with `count_held`.
    fn one_way<R: Rpc>(
        &self,
        what: &'static str,
        dest: &Addr,
        input: &R::Input,
        count_held: bool,
    ) -> Result<()> {
        let mut e = self.shared.try_engine(what)?;
        self.shared.check_running(R::NAME, &mut e)?;
        e.forward_one_way::<R>(dest, input).inspect_err(|err| {
            if count_held || !matches!(err, RpcError::InputsHeld { .. }) {
                e.count_error()
            }
        })?;
        self.shared.self_forward_ran(&e, dest);
        // A one-way self-forward to an async handler runs as a task now
        // (no network event would wake the driver for it).
        self.shared.spawn_deferred(&mut e);
        // A spilled input is kept until acknowledged, at most its TTL.
        self.shared.wake_if_sooner(&e);
        Ok(())
    }
}

/// Abandons the call when its future is dropped before it finished.
struct Abandon<'a> {
    shared: &'a Shared,
    id: CallId,
    armed: bool,
    /// The call failed (timeout, driver stopped), counted in `errors`:
    /// given up, not counted as abandoned too.
    failed: bool,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut e = self.shared.engine();
            self.shared.waiters().calls.remove(&self.id);
            if self.failed {
                e.give_up(self.id);
            } else {
                e.abandon(self.id);
            }
            // Kept (its target may still pull the input), the driver must
            // wake for its TTL; a release of its waiting output the
            // transport refused, for the retry.
            self.shared.wake_if_sooner(&e);
        }
    }
}
