//! Bulk transfers of an [`AsyncEngine`] and of its async handlers
//! ([`AsyncBulkCtx`](crate::AsyncBulkCtx)): memory exposed for peers, and data moved to or from
//! a peer's handle with `.await`.
//!
//! Transfers are started under the engine lock
//! ([`Engine::bulk_try_start_batch`]: where looking up the owner would
//! wait to connect, the lock is let go and the start tried again after a
//! pause, as in [`AsyncEngine::lookup`]) and their future waits for the
//! driver, which files the outcome when the transport reports it (the
//! engine logs the ids of transfers that ended, as it does for calls) and
//! fires the transfer's oneshot.
//!
//! [`Engine::bulk_try_start_batch`]: crate::Engine::bulk_try_start_batch

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span};
use na_core::{Access, Addr};
use tokio::sync::oneshot;

use super::ctx::{HandlerTransfers, RunningTransfer};
use super::{driver_stopped, lost, AsyncEngine, Shared};
use crate::engine::{BulkId, CANCEL_WAIT_WARNING};
use crate::error::{keep_first_failure, Result, RpcError};

/// What a transfer's errors name.
const WHAT: &str = "bulk transfer";

impl AsyncEngine {
    /// Exposes buffers (in order, one handle) for peers to push into or
    /// pull from (see [`Engine::expose`](crate::Engine::expose)); put the
    /// handle in RPC arguments to hand it over. The memory stays exposed
    /// exactly as long as the handle (and its clones) live.
    ///
    /// After [`shutdown`](Self::shutdown) it fails with
    /// [`RpcError::DriverStopped`], as calls and transfers do (no call can
    /// hand the handle over any more). A driver that stopped otherwise
    /// (its runtime shut down, a transport that kept failing) does not stop
    /// it: exposing needs no driver (but transfers with the handle, from
    /// this engine, are refused).
    pub fn expose(&self, buffers: Vec<Vec<u8>>, access: Access) -> Result<Bulk> {
        let mut e = self.shared.try_engine("AsyncEngine::expose")?;
        self.shared.check_not_shut_down("AsyncEngine::expose")?;
        e.expose(buffers, access)
    }

    /// Moves `len` bytes between `remote` (a peer's handle, at
    /// `remote_offset`) and `local` (ours, at `local_offset`): `Pull`
    /// reads the peer's memory, `Push` writes it. Both ranges may cross
    /// segment boundaries and are bounds-checked before anything moves.
    /// The transfer goes to the handle's owner, whatever the transport.
    ///
    /// Past `timeout` the transfer is canceled and **waited for** before
    /// [`RpcError::Timeout`] returns, as [`Engine::bulk`](crate::Engine::bulk)
    /// does: once this returns, nothing touches either handle's memory any
    /// more, so an async handler may answer its caller (who may then free
    /// that memory) right after. The transport ends a canceled transfer
    /// promptly (an RDMA operation on the wire completes, or fails by the
    /// transport's own timeout or when its connection goes); a wait of
    /// over 10 s is logged as a warning. The answer is the timeout even if
    /// the transfer finished meanwhile: the destination's contents in the
    /// range are then unspecified. A zero timeout does not wait for the
    /// transfer to finish, nor drive it: unless it ended as it started
    /// (served from this process's own memory, or from inline data), it is
    /// canceled at once, and waited for, and the answer is the timeout,
    /// even over na-sm, whose transfer moved the data in the starting
    /// call (its completion was not taken yet).
    ///
    /// A transfer the transport ends as it starts it (na-sm moves the data
    /// in the starting call) answers without waiting for the engine's
    /// driver task: the call polls the transports once and files the ends
    /// of transfers itself (it runs no handler: those run on the driver's
    /// task).
    ///
    /// If the engine's driver stops meanwhile, [`RpcError::DriverStopped`]
    /// returns at once: nothing can wait for the transport then.
    ///
    /// A handle whose owner is not connected yet makes the start look the
    /// owner up, as [`lookup`](Self::lookup) does: where connecting would
    /// wait (na-sm: the owner's accept queue is full), this task waits,
    /// without the engine lock, and starts the transfer once connected;
    /// if `timeout` (which covers the whole call, this wait included)
    /// passes first, the answer is [`RpcError::Timeout`], and if the
    /// transport's bound for a lookup passes first (na-sm:
    /// `SmConfig::handshake_timeout`), the lookup's error (a timeout
    /// naming the owner). A zero timeout does not bound that wait.
    ///
    /// Dropping the future gives the transfer up without waiting (see
    /// [`Engine::forget_bulk`](crate::Engine::forget_bulk)): the local
    /// memory stays valid (the transfer holds its handle), but the peer's
    /// may still be read or written for a while.
    ///
    /// A handle that came in a request names whatever owner its sender
    /// wrote, and this moves data with that owner: a handler that moves
    /// data with its caller's handle uses
    /// [`register_async_with_bulk`](Self::register_async_with_bulk) and
    /// its [`AsyncBulkCtx::transfer`](super::AsyncBulkCtx::transfer) instead, which refuses a handle its
    /// caller does not own.
    #[allow(clippy::too_many_arguments)]
    pub async fn bulk(
        &self,
        op: BulkOp,
        remote: &Bulk,
        remote_offset: u64,
        local: &Bulk,
        local_offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        let span = Span {
            remote_offset,
            local_offset,
            len,
        };
        self.shared
            .bulk(op, remote, local, &[span], timeout, None, None)
            .await
    }

    /// Moves every span between `remote` and `local` as one batch (see
    /// [`Engine::bulk_start_batch`](crate::Engine::bulk_start_batch): if any
    /// span is refused, none starts) and waits for all of them: one wait
    /// for many small transfers, where [`bulk`](Self::bulk) per span pays
    /// the engine lock, a poll and a filing of transfer ends each (and, for
    /// a transfer still in flight after it, a wake-up of the driver and of
    /// the task). The
    /// answer is the failure of the first failed span in `spans`' order,
    /// once every span has ended; an empty batch does nothing. Past
    /// `timeout` the spans still in flight are canceled and waited for, as
    /// in `bulk`, and the answer is [`RpcError::Timeout`] (even if a span
    /// failed before).
    /// A stopped driver gives [`RpcError::DriverStopped`] at once, and a
    /// dropped future forgets the spans without waiting, as in `bulk`.
    /// [`Engine::bulk_batch`](crate::Engine::bulk_batch) is the blocking
    /// twin.
    /// Everything is in flight at once: split very large batches (for
    /// example into [`BATCH_WINDOW`](crate::BATCH_WINDOW) spans).
    pub async fn bulk_batch(
        &self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        timeout: Duration,
    ) -> Result<()> {
        self.shared
            .bulk(op, remote, local, spans, timeout, None, None)
            .await
    }
}

impl Shared {
    /// [`AsyncEngine::bulk_batch`] (and `bulk`, one span), for the engine
    /// and for handlers' contexts (`handler`: the call, counted among its
    /// handler's transfers, where a dropped future leaves its transfers to
    /// be waited for). An argument, so that it is dropped after the
    /// call's own locals, the guard that leaves them there included.
    /// `via`: the caller of the handler, through whose address a handle
    /// it owns is reached without a lookup (see
    /// [`hg_bulk::start_batch_via`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn bulk(
        self: &Arc<Self>,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        timeout: Duration,
        handler: Option<RunningTransfer>,
        via: Option<&Addr>,
    ) -> Result<()> {
        if spans.is_empty() {
            return Ok(());
        }
        // The timeout covers the whole call, the lookup of the owner
        // included (a zero one waits for neither: see below).
        let (begun, tokio_begun) = (Instant::now(), tokio::time::Instant::now());
        let budget = (!timeout.is_zero()).then_some(timeout);
        let mut failure = None;
        let mut waits = Vec::new();
        {
            // A transfer with a peer not yet connected looks it up, and
            // where that would wait to connect, this task waits (without
            // the engine lock) and starts the batch again.
            let (mut e, ids) = self
                .retry_while_blocked("AsyncEngine::bulk", remote.owner(), begun, budget, |e, since| {
                    self.check_running_quiet(WHAT)?;
                    e.bulk_start_batch_with(op, remote, local, spans, Some(since), via)
                })
                .await?;
            // Moved in memory or from inline data: done already.
            let mut ended: Vec<(BulkId, Option<Result<()>>)> =
                ids.into_iter().map(|id| (id, e.take_bulk(id))).collect();
            // The transport may have the ends ready without an fd event
            // (na-sm moves the data as it starts it): filing them here
            // (only transfer ends: handlers stay on the driver's task) spares
            // this task a wake-up of the driver and then one of its own. The
            // driver is woken anyway, to arm the transports before it sleeps
            // and to handle what else the poll found. A zero timeout makes
            // no progress on the caller's behalf (as `Engine::bulk`).
            if !timeout.is_zero() && ended.iter().any(|(_, r)| r.is_none()) {
                self.file_transfer_ends(&mut e);
                for (id, r) in &mut ended {
                    if r.is_none() {
                        *r = e.take_bulk(*id);
                    }
                }
                self.rearm.notify_one();
            }
            #[cfg(test)]
            run_before_registering();
            // Registered under the engine lock, which the driver holds
            // while it files outcomes: it cannot miss these transfers.
            // The driver may have stopped since the start was allowed (the
            // stop takes only the waiters' lock).
            let mut w = self.waiters();
            if let Some(why) = &w.stopped {
                let err = driver_stopped(WHAT, why);
                drop(w);
                let mut forgotten = false;
                for (id, r) in ended {
                    if r.is_none() {
                        e.forget_bulk(id);
                        forgotten = true;
                    }
                }
                // A handler's given up because the driver stopped: nobody
                // learns its end, so its task must not answer as if idle
                // (as in `ForgetBulk::drop`).
                if let (true, Some(h)) = (forgotten, &handler) {
                    h.transfers().lock().mark_unsure();
                }
                return Err(err);
            }
            // `ended` is in the spans' order (one id per span).
            for (at, (id, r)) in ended.into_iter().enumerate() {
                match r {
                    Some(r) => keep_first_failure(&mut failure, at, r),
                    None => {
                        let (tx, rx) = oneshot::channel();
                        w.bulks.insert(id, tx);
                        waits.push((id, rx, at));
                    }
                }
            }
        }
        if waits.is_empty() {
            // Ended within the call (na-sm): no await gave the scheduler a
            // turn, and a loop of such transfers must not starve the
            // runtime's other tasks (the driver, a `select!` branch).
            tokio::task::coop::consume_budget().await;
            return failure.map_or(Ok(()), |(_, e)| Err(e));
        }
        let mut guard = ForgetBulk {
            shared: self,
            ids: waits.iter().map(|(id, _, _)| *id).collect(),
            ended: 0,
            detach: handler.as_ref().map(RunningTransfer::transfers),
        };
        // A zero timeout does not wait for the transfers (as
        // `Engine::bulk`): their outcomes may be at hand, but the driver has
        // not filed them.
        let deadline = (!timeout.is_zero()).then(|| {
            // `Duration::MAX` and the like: no deadline in practice.
            tokio_begun
                .checked_add(timeout)
                .unwrap_or_else(|| tokio_begun + Duration::from_secs(100 * 365 * 86_400))
        });
        for (id, rx, at) in &mut waits {
            let waited = match deadline {
                Some(at) => self.timer(|| tokio::time::timeout_at(at, &mut *rx)).await.ok(),
                None => None,
            };
            match waited {
                Some(Ok(())) => {
                    guard.ended += 1;
                    let r = self.engine().take_bulk(*id);
                    // Unreachable: the driver fires a waiter only once the
                    // transfer's outcome is filed (`notify_finished`, under
                    // the engine lock, for an id of the engine's log of
                    // ended transfers), and a filed outcome leaves the
                    // engine only through `take_bulk` or `forget_bulk` of
                    // that id, which only this future (and its guard, which
                    // leaves the ids ended so far alone) knows: the engine
                    // is out of the user's reach behind the driver. A
                    // stopped driver drops the senders (the `Err` arm
                    // below) without touching the engine. Should it happen
                    // anyway, the span fails (its end was counted in
                    // `bulk_done` or `bulk_failed` when it was filed) and
                    // the loss is logged, as an error: a transfer whose
                    // outcome nobody can tell.
                    debug_assert!(
                        r.is_some(),
                        "transfer {id:?} woken without its outcome in the engine"
                    );
                    let r = r.unwrap_or_else(|| {
                        na_core::hint::cold_path();
                        tracing::error!(
                            transfer = ?id,
                            "a bulk transfer's outcome was lost after its wake-up; failing its span"
                        );
                        Err(lost(WHAT))
                    });
                    keep_first_failure(&mut failure, *at, r);
                }
                // The driver stopped: the guard forgets the rest.
                Some(Err(_)) => return Err(self.stopped_error(WHAT)),
                None => break,
            }
        }
        if guard.ended == waits.len() {
            return failure.map_or(Ok(()), |(_, e)| Err(e));
        }
        // Past the timeout: the rest are canceled and waited for.
        {
            let mut e = self.engine();
            for &(id, _, _) in &waits[guard.ended..] {
                e.cancel_bulk(id);
            }
        }
        self.rearm.notify_one();
        let (started, mut warned) = (Instant::now(), false);
        while guard.ended < waits.len() {
            let (id, rx, _) = &mut waits[guard.ended];
            let ended = match self
                .timer(|| tokio::time::timeout(CANCEL_WAIT_WARNING, &mut *rx))
                .await
            {
                Ok(r) => r,
                Err(_) => {
                    if !warned {
                        warned = true;
                        tracing::warn!(
                            waited = ?started.elapsed(),
                            "timed-out bulk transfers are still in flight; AsyncEngine::bulk waits for them"
                        );
                    }
                    continue;
                }
            };
            if ended.is_err() {
                return Err(self.stopped_error(WHAT));
            }
            guard.ended += 1;
            // Its outcome (canceled, or what it ended with) is not the answer.
            let _ = self.engine().take_bulk(*id);
        }
        Err(RpcError::Timeout {
            rpc: WHAT.into(),
            millis: timeout.as_millis(),
        })
    }

    /// The error of work that was waiting when the driver stopped.
    fn stopped_error(&self, what: &str) -> RpcError {
        let why = self.waiters().stopped.clone().unwrap_or_default();
        driver_stopped(what, &why)
    }
}

#[cfg(test)]
thread_local! {
    /// What a test runs, once, at the point where a batch started on this
    /// thread is about to register its waiters (the engine locked, the
    /// waiters not): what another thread may do at that instant.
    static BEFORE_REGISTERING: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` the next time a batch started on this thread is about to
/// register its waiters (see `BEFORE_REGISTERING`).
#[cfg(test)]
pub(super) fn before_registering(f: impl FnOnce() + 'static) {
    BEFORE_REGISTERING.with(|h| *h.borrow_mut() = Some(Box::new(f)));
}

#[cfg(test)]
fn run_before_registering() {
    if let Some(f) = BEFORE_REGISTERING.with(|h| h.borrow_mut().take()) {
        f();
    }
}

/// Gives the transfers not yet ended (`ids[ended..]`) up when their
/// future is dropped (or the driver stopped); a handler's transfers are
/// canceled instead and left with its handler's transfers (`detach`), for
/// its task to wait for before it answers.
struct ForgetBulk<'a> {
    shared: &'a Shared,
    ids: Vec<BulkId>,
    ended: usize,
    detach: Option<&'a HandlerTransfers>,
}

impl Drop for ForgetBulk<'_> {
    fn drop(&mut self) {
        let Some(rest) = self.ids.get(self.ended..).filter(|r| !r.is_empty()) else {
            return;
        };
        let mut e = self.shared.engine();
        let mut w = self.shared.waiters();
        let mut handler = self.detach.map(HandlerTransfers::lock);
        for &id in rest {
            // Its waiter is there until the driver fires it (the outcome
            // is filed then) or stops.
            let in_flight = w.bulks.contains_key(&id) && w.stopped.is_none();
            // A handler's, while its answer has not gone: canceled and
            // waited for. Otherwise forgotten.
            let (tx, rx) = oneshot::channel();
            if let (true, Some(h)) = (in_flight, handler.as_mut()) {
                h.keep_dropped(id, rx);
                w.bulks.insert(id, tx);
                e.cancel_bulk(id);
            } else {
                // A handler's given up because the driver stopped: nobody
                // learns its end, so its task must not answer as if idle.
                if let (true, Some(h)) = (w.stopped.is_some(), handler.as_mut()) {
                    h.mark_unsure();
                }
                w.bulks.remove(&id);
                e.forget_bulk(id);
            }
        }
        drop(handler);
        drop(w);
        drop(e);
        // A forgotten or canceled transfer's end may be ready with no fd
        // event (na-sm): the driver files it (`bulk_in_flight` drops).
        self.shared.rearm.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(rpc: &str) -> Result<()> {
        Err(RpcError::Timeout {
            rpc: rpc.into(),
            millis: 0,
        })
    }

    fn name(failure: &Option<(usize, RpcError)>) -> Option<(usize, String)> {
        failure.as_ref().map(|(at, e)| match e {
            RpcError::Timeout { rpc, .. } => (*at, rpc.clone()),
            other => (*at, other.to_string()),
        })
    }

    /// A batch answers with its first failed span in the spans' order,
    /// whatever order they ended in: span 3 failing as the batch starts
    /// and span 1 failing later, while awaited, answers span 1's failure.
    #[test]
    fn the_first_failed_span_in_the_spans_order_is_kept() {
        let mut failure = None;
        keep_first_failure(&mut failure, 0, Ok(()));
        assert!(failure.is_none(), "a success is no failure");
        keep_first_failure(&mut failure, 3, failed("span 3"));
        keep_first_failure(&mut failure, 2, Ok(()));
        keep_first_failure(&mut failure, 1, failed("span 1"));
        keep_first_failure(&mut failure, 4, failed("span 4"));
        assert_eq!(name(&failure), Some((1, "span 1".into())));
    }
}
