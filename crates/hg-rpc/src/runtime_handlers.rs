//! Async handlers: registration on an [`AsyncEngine`] (plain handlers
//! run on the driver; async ones get a tokio task per request), the task
//! that runs each request and answers it, and the answer its caller gets
//! if the handler panics or its task is dropped before it answered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::ctx::{self, AsyncBulkCtx};
use super::{AsyncEngine, Shared};
use crate::codec::{Codec, Postcard};
use crate::engine::Engine;
use crate::error::Result;
#[cfg(doc)]
use crate::error::RpcError;
use crate::rpc::Rpc;

/// An async handler: its context (the caller) and the encoded input in,
/// the encoded output (or the handler's error) out.
pub(super) type AsyncHandler = Arc<
    dyn Fn(
            AsyncBulkCtx,
            Vec<u8>,
        ) -> Pin<Box<dyn Future<Output = std::result::Result<Vec<u8>, String>> + Send>>
        + Send
        + Sync,
>;

impl Shared {
    /// Starts a task per request waiting for an async handler. Call with
    /// the engine locked.
    pub(super) fn spawn_deferred(self: &Arc<Self>, e: &mut Engine) {
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
                e.respond_deferred(req, result);
                shared.notify_finished(&mut e);
                // A spilled output kept for its TTL, or pull budget given
                // back that sent releases the transport refused: the
                // sleeping driver must wake for the new deadline.
                shared.wake_if_sooner(&e);
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
        // Called from a caller's task too (`spawn_deferred` after a
        // self-forward): see the answer in the handler's task.
        self.wake_if_sooner(e);
        self.drain_may_have_moved(e);
    }
}

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
pub(super) struct AnswerIfDropped {
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
        //
        // Answered here, the driver need not be woken for the answer (it
        // may sleep, armed by `try_wait`): the answer, a short handler
        // error (never spilled, so no new deadline), goes into the
        // caller's ring at once and signals the
        // caller; a send that finds the ring full is queued and, the
        // plugin being armed, asks the caller to signal room, which wakes
        // the driver to flush it; and work that queues a completion (the
        // pull of a spilled output that waited for the room this request
        // held) makes the plugin wake its sleeping owner. That is the
        // contract of `Plugin::try_wait` (na-core), kept by na-sm
        // (`send_ops.rs`: `send_on`, `queue_send`; `plugin.rs`: `rma`,
        // `wake_owner_if_work`). Inside a spin window the driver turns
        // without sleeping and sees it all on its next turn.
        if let Ok(mut e) = shared.engine.try_lock() {
            e.respond_deferred(req, Err(DROPPED_HANDLER.into()));
            shared.notify_finished(&mut e);
            // But the pull budget the request held came back: a release
            // of a waiting output the transport refused waits for a retry
            // the driver must wake for (as after any answer).
            shared.wake_if_sooner(&e);
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

impl AsyncEngine {
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
    /// tokio task, so a slow handler does not hold up others. Its error is
    /// a `String`, which `?` makes of an [`RpcError`] (a nested
    /// [`call`](Self::call), an [`AsyncBulkCtx`] transfer) or an hg-bulk
    /// [`BulkError`](crate::BulkError), as for [`Engine::register`].
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
}
