//! The context of an async handler ([`AsyncBulkCtx`]) and what its answer
//! waits for ([`HandlerTransfers`]).
//!
//! A handler's caller may free its memory as soon as it has the answer, so
//! once the handler returned its context starts no transfer, and the answer
//! goes out only when none of the context's transfers is in flight. Three kinds of
//! transfer calls are counted: the ones the handler awaits (ended when it
//! returns), the ones whose future it dropped (canceled, kept in a list
//! until the transport ends them), and the ones a context moved into
//! another task still runs (counted until they return).

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use hg_bulk::{Bulk, BulkOp, Span};
use na_core::{Access, Addr};
use tokio::sync::{oneshot, Notify};

#[cfg(doc)]
use super::AsyncEngine;
use super::{driver_stopped, Shared};
use crate::engine::{check_owner, BulkId, CANCEL_WAIT_WARNING};
use crate::error::{Result, RpcError};

/// What a transfer's errors name.
const WHAT: &str = "bulk transfer";

/// The transfers of one async handler's context; its task waits for them
/// ([`wait_for_transfers`]) before it answers.
#[derive(Default)]
pub(super) struct HandlerTransfers {
    state: Mutex<TransfersState>,
    /// Notified when the last running transfer call returns.
    idle: Notify,
}

#[derive(Default)]
pub(super) struct TransfersState {
    /// The handler returned: no transfer starts any more (those running
    /// go on, and the answer waits for them).
    closing: bool,
    /// Transfer calls that started and have not returned or been dropped.
    running: usize,
    /// Transfers whose futures were dropped before they ended: canceled,
    /// each with the oneshot the driver fires at its end.
    dropped: Vec<(BulkId, oneshot::Receiver<()>)>,
    /// Dropped transfers taken out of `dropped` whose end the handler's
    /// task is waiting for now.
    waiting: usize,
    /// A transfer whose end nobody will learn (given up while the driver
    /// had stopped): it may still move data.
    unsure: bool,
}

impl TransfersState {
    /// No transfer call runs and no dropped transfer waits for its end:
    /// nothing of the handler's moves data.
    pub(super) fn is_idle(&self) -> bool {
        self.running == 0 && self.dropped.is_empty() && self.waiting == 0 && !self.unsure
    }

    /// A transfer of the handler's was given up with no one to learn its
    /// end (see `unsure`).
    pub(super) fn mark_unsure(&mut self) {
        self.unsure = true;
    }

    /// Keeps a dropped transfer for the answer to wait for. Only a running
    /// transfer call drops transfers, and the wait ends only when none
    /// runs: the list is never left behind with something in it.
    pub(super) fn keep_dropped(&mut self, id: BulkId, ended: oneshot::Receiver<()>) {
        self.dropped.push((id, ended));
    }
}

impl HandlerTransfers {
    /// A handler's empty set.
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, TransfersState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a transfer call in, unless the handler returned already.
    fn enter(self: &Arc<Self>) -> Result<RunningTransfer> {
        let mut st = self.lock();
        if st.closing {
            return Err(RpcError::BulkRefused {
                reason: "the handler already returned and its answer is going (or went) to its caller, \
                         which may then free its memory: a context kept past its handler starts no transfer"
                    .into(),
            });
        }
        st.running += 1;
        Ok(RunningTransfer(self.clone()))
    }
}

/// One transfer call of a handler's context, counted until it is dropped
/// (at the end of the call, or with its future). `Shared::bulk` takes it
/// as an argument, so it is dropped after the call's own guard has left
/// the transfers it gives up in the dropped list.
pub(super) struct RunningTransfer(Arc<HandlerTransfers>);

impl RunningTransfer {
    /// The handler's transfers.
    pub(super) fn transfers(&self) -> &HandlerTransfers {
        &self.0
    }
}

impl Drop for RunningTransfer {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.running -= 1;
        if st.running == 0 {
            // A permit if nobody waits yet: the wait cannot miss it.
            self.0.idle.notify_one();
        }
    }
}

/// Closes the handler's context to new transfers, then waits until no
/// transfer call of it runs and every transfer it dropped has ended (a
/// warning after 10 s). Called by the handler's task as soon as the
/// handler returned, before it answers: the caller may free its memory at
/// the answer. (Closed first, so that a task that keeps the context and
/// starts transfer after transfer cannot hold the answer back for ever.)
/// It runs on the handler's task, on the engine's runtime: its timers are
/// made there without [`Shared::timer`].
pub(super) async fn wait_for_transfers(transfers: &HandlerTransfers, shared: &Weak<Shared>) {
    transfers.lock().closing = true;
    let (started, mut warned) = (Instant::now(), false);
    loop {
        let next = {
            let mut st = transfers.lock();
            if st.running > 0 {
                None
            } else if let Some(d) = st.dropped.pop() {
                // Counted until its end is known (the task may be dropped
                // while it waits: then never idle).
                st.waiting += 1;
                Some(d)
            } else {
                return;
            }
        };
        let Some((id, mut rx)) = next else {
            // A context kept past the handler (in a task of its own)
            // still moves data.
            if warned {
                transfers.idle.notified().await;
            } else if tokio::time::timeout(CANCEL_WAIT_WARNING, transfers.idle.notified())
                .await
                .is_err()
            {
                warned = true;
                tracing::warn!(
                    waited = ?started.elapsed(),
                    "a transfer of a handler's context (kept past the handler) is still running; \
                     the handler's answer waits for it"
                );
            }
            continue;
        };
        let ended = match tokio::time::timeout(CANCEL_WAIT_WARNING, &mut rx).await {
            Ok(r) => r.is_ok(),
            Err(_) => {
                tracing::warn!(
                    waited = ?started.elapsed(),
                    "a handler's dropped bulk transfer is still in flight; its answer waits for it"
                );
                // Fails at once if the driver stopped: nothing files it then.
                rx.await.is_ok()
            }
        };
        {
            let mut st = transfers.lock();
            st.waiting -= 1;
            if !ended {
                st.mark_unsure();
            }
        }
        if let Some(s) = shared.upgrade() {
            let _ = s.engine().take_bulk(id);
        }
    }
}

/// What an async handler registered with
/// [`AsyncEngine::register_async_with_bulk`] may do while it runs: learn
/// who called, expose memory, and move data with the caller's handles.
///
/// As with [`BulkCtx`](crate::BulkCtx), a transfer goes only to the
/// caller: a handle in the request names whatever owner its sender wrote,
/// and a client must not be able to aim the server's push or pull at a
/// third process. A handler meant to move data with other processes says
/// so with [`allow_any_owner`](Self::allow_any_owner).
///
/// The context refers to its engine weakly (a transfer holds it while it
/// runs): a handler still running after the [`AsyncEngine`] was dropped
/// gets [`RpcError::DriverStopped`].
pub struct AsyncBulkCtx {
    caller: Addr,
    shared: Weak<Shared>,
    any_owner: bool,
    /// The handler's transfers, which its answer waits for.
    transfers: Arc<HandlerTransfers>,
}

impl AsyncBulkCtx {
    pub(super) fn new(caller: Addr, shared: Weak<Shared>, transfers: Arc<HandlerTransfers>) -> Self {
        AsyncBulkCtx {
            caller,
            shared,
            any_owner: false,
            transfers,
        }
    }

    /// Who sent the request being handled.
    pub fn caller(&self) -> &Addr {
        &self.caller
    }

    /// Lifts the caller-only rule for this handler's transfers. An owner
    /// not yet connected is looked up as [`AsyncEngine::bulk`] does:
    /// where connecting would wait, this handler's task waits, not the
    /// engine.
    pub fn allow_any_owner(&mut self) {
        self.any_owner = true;
    }

    fn engine(&self) -> Result<Arc<Shared>> {
        self.shared
            .upgrade()
            .ok_or_else(|| driver_stopped(WHAT, "the AsyncEngine was dropped"))
    }

    /// Exposes buffers as one handle (see [`AsyncEngine::expose`]).
    pub fn expose(&self, buffers: Vec<Vec<u8>>, access: Access) -> Result<Bulk> {
        let shared = self.engine()?;
        // As for a transfer: once the AsyncEngine was dropped, nothing.
        shared.check_running_quiet("AsyncBulkCtx::expose")?;
        let exposed = shared.try_engine("AsyncBulkCtx::expose")?.expose(buffers, access);
        exposed
    }

    /// Moves `len` bytes between the caller's handle `remote` and `local`,
    /// as [`AsyncEngine::bulk`] does (canceled and waited for past
    /// `timeout`), after checking that `remote` is the caller's
    /// ([`RpcError::BulkRefused`] if not).
    ///
    /// If this future is dropped before the transfer ended (a `select!`
    /// or a timeout around it, a `try_join!` whose other branch failed, a
    /// panic in the handler), the transfer is canceled and the handler's
    /// answer waits for it to end: its caller may free its memory as soon
    /// as it has the answer.
    ///
    /// The same holds for a context moved into a task of its own that
    /// outlives the handler: once the handler returned, a new transfer
    /// through the context is refused ([`RpcError::BulkRefused`]: the
    /// caller may free its memory at the answer), and the answer waits
    /// until every transfer call of the context that started before has
    /// returned or been dropped (a warning after 10 s).
    #[allow(clippy::too_many_arguments)]
    pub async fn transfer(
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
        self.transfer_batch(op, remote, local, &[span], timeout).await
    }

    /// [`AsyncEngine::bulk_batch`] with the caller's handle `remote`, after
    /// the same check as [`transfer`](Self::transfer) (and the same rules
    /// around the handler's answer).
    pub async fn transfer_batch(
        &self,
        op: BulkOp,
        remote: &Bulk,
        local: &Bulk,
        spans: &[Span],
        timeout: Duration,
    ) -> Result<()> {
        check_owner(
            self.any_owner,
            &self.caller,
            op,
            remote,
            "AsyncBulkCtx::allow_any_owner",
        )
        .map_err(|reason| RpcError::BulkRefused { reason })?;
        let running = self.transfers.enter()?;
        let engine = self.engine()?;
        engine
            .bulk(
                op,
                remote,
                local,
                spans,
                timeout,
                Some(running),
                Some(&self.caller),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler's task dropped while it waits for the end of a dropped
    /// (canceled) transfer does not leave its transfers looking idle: the
    /// transfer may still move data, so nothing may answer the caller.
    #[tokio::test]
    async fn a_task_dropped_while_it_waits_for_a_transfer_is_not_idle() {
        let t = HandlerTransfers::new();
        let (tx, rx) = oneshot::channel();
        t.lock().keep_dropped(BulkId(7), rx);
        let t2 = t.clone();
        let task = tokio::spawn(async move { wait_for_transfers(&t2, &Weak::new()).await });
        while !t.lock().dropped.is_empty() {
            tokio::task::yield_now().await;
        }
        assert!(!t.lock().is_idle(), "idle while its task waits for the transfer");
        task.abort();
        let _ = task.await;
        assert!(!t.lock().is_idle(), "idle after its task was dropped mid-wait");
        drop(tx);
    }

    /// A transfer whose end nobody reports (the driver stopped) leaves the
    /// set unsure for good, even once the wait for it returned.
    #[tokio::test]
    async fn a_transfer_whose_end_is_unknown_is_never_idle() {
        let t = HandlerTransfers::new();
        let (tx, rx) = oneshot::channel::<()>();
        t.lock().keep_dropped(BulkId(8), rx);
        drop(tx);
        wait_for_transfers(&t, &Weak::new()).await;
        assert!(!t.lock().is_idle());
        let fresh = HandlerTransfers::new();
        assert!(fresh.lock().is_idle());
    }

    /// An RPC whose async handler pulls the caller's handle.
    struct PullIt;
    impl crate::Rpc for PullIt {
        const NAME: &'static str = "test.pull-it";
        type Input = Bulk;
        type Output = ();
    }

    /// A handler's transfer started while the driver runs, which finds
    /// the driver stopped when it comes to register its waiter (the
    /// AsyncEngine dropped by another thread in between), is given up in
    /// flight: nobody will learn its end, so the handler's transfers are
    /// never idle again, and its task does not answer (the caller times
    /// out rather than free memory the transfer may still move).
    /// The drop is made at that point by the test hook, on this thread.
    #[tokio::test(flavor = "current_thread")]
    async fn a_transfer_given_up_as_the_driver_stops_under_it_leaves_its_handler_unsure() {
        use std::os::unix::fs::PermissionsExt;
        const T: Duration = Duration::from_secs(10);
        let dir = std::env::temp_dir().join(format!("hg-rpc-stopped-under-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let engine = |listen| {
            let cfg = na_sm::SmConfig {
                listen,
                ..na_sm::SmConfig::default()
            }
            .with_dir(&dir);
            crate::Engine::shared_memory(cfg, na_core::ProgressMode::default()).unwrap()
        };
        let srv = crate::AsyncEngine::spawn(engine(true)).unwrap();
        let (report, reported) = oneshot::channel();
        let report = Mutex::new(Some(report));
        srv.register_async_with_bulk::<PullIt, _, _>(move |ctx, from| {
            let report = report.lock().unwrap().take();
            async move {
                let into = ctx.expose(vec![vec![0; from.size() as usize]], Access::ReadWrite)?;
                // A zero timeout: the start files no end (na-sm's is
                // ready, not filed), so the transfer is in flight when
                // the stop is found.
                let r = ctx
                    .transfer(BulkOp::Pull, &from, 0, &into, 0, from.size(), Duration::ZERO)
                    .await;
                if let Some(report) = report {
                    let _ = report.send((r, ctx.transfers.clone()));
                }
                Ok(())
            }
        })
        .unwrap();
        // Kept to read the engine's counters once the AsyncEngine is gone.
        let shared = srv.shared.clone();
        let c = crate::AsyncEngine::spawn(engine(false)).unwrap();
        let s = c.lookup(srv.self_addr().uri()).await.unwrap();
        // Over the inline limit: a transfer, not a copy from the request.
        let ours = c.expose(vec![vec![7u8; 64 << 10]], Access::ReadOnly).unwrap();
        let mut srv = Some(srv);
        super::super::bulk::before_registering(move || drop(srv.take()));
        let call = tokio::spawn(async move { c.call::<PullIt>(&s, &ours, Duration::from_secs(2)).await });
        let (r, transfers) = tokio::time::timeout(T, reported)
            .await
            .expect("the handler never reported")
            .expect("the handler dropped its report");
        assert!(matches!(r, Err(RpcError::DriverStopped { .. })), "{r:?}");
        assert_eq!(
            shared.engine().stats().bulk_in_flight,
            1,
            "the transfer was not given up in flight: nothing tested"
        );
        assert!(
            !transfers.lock().is_idle(),
            "a transfer given up in flight left its handler's transfers idle"
        );
        // Nor does its task answer: the caller could free the memory the
        // transfer may still move (the engine is alive: `shared`).
        let answer = tokio::time::timeout(T, call)
            .await
            .expect("the call never ended")
            .unwrap();
        assert!(matches!(answer, Err(RpcError::Timeout { .. })), "{answer:?}");
        drop(shared);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
